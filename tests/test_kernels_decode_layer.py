"""kernels.decode_layer: a decoded DeltaNet layer in one compiled call gives, bit for bit, what its steps give one
call at a time through their own wrappers (norms.rmsnorm, quant.matvecs / matvec, DecodeStep, MoETokenCall), whose
kernels the float64 reference tests check. The end-to-end form (a converted model's logits, token after token) is
in test_parity_qwen3next."""

import numba
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_kernels_expert_pool import random_rows

from strata_async.kernels import quant
from strata_async.kernels.activations import mul_sigmoid
from strata_async.kernels.attention import attend, rope
from strata_async.kernels.decode_layer import AttentionMoELayerCall, AttentionShape, DeltaNetMoELayerCall
from strata_async.kernels.deltanet import DecodeStep
from strata_async.kernels.moe_token import MoETokenCall
from strata_async.kernels.norms import rmsnorm, rmsnorm_heads
from strata_async.kernels.quant_float import F32

HK, DK, HV, DV, CONV = 2, 64, 4, 64, 4
EXPERTS, FFN, TOP_K = 8, 64, 2
EPS = 1e-6


def moe_call(rng, hidden: int, shared: bool = True) -> MoETokenCall:
    experts = tuple((np.stack([random_rows(rng, Q.Q8_0, rows, k) for _ in range(EXPERTS)]), int(Q.Q8_0))
                    for rows, k in ((FFN, hidden), (FFN, hidden), (hidden, FFN)))
    router = (rng.standard_normal((EXPERTS, hidden)).astype(np.float32).view(np.uint8), F32)
    if not shared:
        return MoETokenCall(router, TOP_K, True, experts, quantized_activations=True)
    shared = tuple((random_rows(rng, Q.Q8_0, rows, k), int(Q.Q8_0))
                   for rows, k in ((FFN, hidden), (FFN, hidden), (hidden, FFN)))
    gate_inp = (rng.standard_normal((1, hidden)).astype(np.float32).view(np.uint8), F32)
    return MoETokenCall(router, TOP_K, True, experts, shared, gate_inp, quantized_activations=True)


def layer(rng, hidden: int, proj_types: tuple[Q, Q, Q], out_type: Q):
    channels = 2 * HK * DK + HV * DV
    proj = tuple((random_rows(rng, t, rows, hidden), int(t))
                 for t, rows in zip(proj_types, (channels, HV * DV, 2 * HV)))
    step = DecodeStep(rng.standard_normal((channels, CONV)).astype(np.float32) * 0.3,
                      -np.exp(rng.standard_normal(HV)).astype(np.float32), rng.standard_normal(HV).astype(np.float32),
                      1 + 0.1 * rng.standard_normal(DV).astype(np.float32), EPS, HK, DK, HV, DV, fused_ba=True,
                      tiled=False, silu_gate=True)
    out = (random_rows(rng, out_type, hidden, HV * DV), int(out_type))
    norms = [1 + 0.1 * rng.standard_normal(hidden).astype(np.float32) for _ in range(2)]
    return norms, proj, step, out, moe_call(rng, hidden)


# hidden 512: the input projections (~420 KB of Q8_0) go in one parallel region (stacked); mixed types: each
# on its own (the Q4_K one serial); a Q4_K output projection of 2048 rows runs in parallel, the others serially.
@pytest.mark.parametrize("hidden, proj_types, out_type", [
    (512, (Q.Q8_0, Q.Q8_0, Q.Q8_0), Q.Q8_0),
    (256, (Q.Q8_0, Q.Q4_K, Q.Q4_K), Q.Q4_K),
    (2048, (Q.Q4_K, Q.Q4_K, Q.Q4_K), Q.Q4_K),
], ids=["stacked", "mixed types", "wide"])
def test_layer_call_gives_its_steps_bits(hidden, proj_types, out_type):
    rng = np.random.default_rng(hidden)
    (attn_norm, ffn_norm), proj, step, out, moe = layer(rng, hidden, proj_types, out_type)
    call = DeltaNetMoELayerCall.make(attn_norm, ffn_norm, EPS, proj, step, out, moe)
    assert call is not None
    conv = [rng.standard_normal((CONV - 1, step.channels)).astype(np.float32) for _ in range(2)]
    state = [rng.standard_normal((HV, DK, DV)).astype(np.float32) * 0.1 for _ in range(2)]
    conv[1][:], state[1][:] = conv[0], state[0]
    h = rng.standard_normal(hidden).astype(np.float32)
    for _ in range(3):  # the states carry from token to token
        want = h.copy()
        x = rmsnorm(want[None], attn_norm, EPS)[0]
        qkv, z, ba = quant.matvecs(list(proj), x, act_quant=True)
        mixed = quant.matvec(*out, step(qkv, z, ba, conv[1], state[1]), act_quant=True)
        want = want + mixed
        want = want + moe(rmsnorm(want[None], ffn_norm, EPS)[0])[0]
        call(h, conv[0], state[0])
        np.testing.assert_array_equal(h, want)
        np.testing.assert_array_equal(conv[0], conv[1])
        np.testing.assert_array_equal(state[0], state[1])
        assert np.isfinite(h).all() and not np.array_equal(mixed, 0)


def test_make_declines_what_it_has_no_path_for():
    rng = np.random.default_rng(1)
    (attn_norm, ffn_norm), proj, step, out, moe = layer(rng, 256, (Q.Q8_0,) * 3, Q.Q8_0)
    float_moe = MoETokenCall(*moe_args(rng), quantized_activations=False)
    shape = AttentionShape(4, 2, 64, True, 1e4, 32, 0.125)
    attention_proj = tuple((random_rows(rng, Q.Q8_0, rows, 256), int(Q.Q8_0)) for rows in (512, 128, 128))
    assert AttentionMoELayerCall.make(attn_norm, ffn_norm, EPS, attention_proj, *attn_norms(rng, 64), shape, 2, out,
                                      float_moe) is None
    assert DeltaNetMoELayerCall.make(attn_norm, ffn_norm, EPS, proj, step, out, float_moe) is None
    assert DeltaNetMoELayerCall.make(attn_norm, ffn_norm, EPS, proj, step, out, None) is None
    f32_out = (rng.standard_normal((256, HV * DV)).astype(np.float32).view(np.uint8), F32)
    assert DeltaNetMoELayerCall.make(attn_norm, ffn_norm, EPS, proj, step, f32_out, moe) is None
    call = DeltaNetMoELayerCall.make(attn_norm, ffn_norm, EPS, proj, step, out, moe)
    conv = np.zeros((CONV - 1, step.channels), np.float32)
    state = np.zeros((HV, DK, DV), np.float32)
    with pytest.raises(ValueError, match="h must be"):
        call(np.zeros(128, np.float32), conv, state)
    with pytest.raises(ValueError, match="state"):
        call(np.zeros(256, np.float32), conv, state[:2])


def attn_norms(rng, d: int) -> list[np.ndarray]:
    return [1 + 0.1 * rng.standard_normal(d).astype(np.float32) for _ in range(2)]


# One kv head on two threads past 512 cached keys: attend splits the keys into ranges (its parts path); gated
# (Qwen3-Next: per head the query, then its gate) and not (Qwen3-MoE, no shared expert).
@pytest.mark.parametrize("gated, kv_heads, start", [(True, 2, 5), (True, 1, 600), (False, 2, 300)],
                         ids=["gated", "gated, keys split", "plain"])
def test_attention_call_gives_its_steps_bits(gated, kv_heads, start):
    rng = np.random.default_rng(start)
    hidden, heads, d = 512, 4, 64
    shape = AttentionShape(heads, kv_heads, d, gated, 1e6, 32, d ** -0.5)
    q_rows = (2 if gated else 1) * heads * d
    proj = tuple((random_rows(rng, Q.Q8_0, rows, hidden), int(Q.Q8_0)) for rows in (q_rows, kv_heads * d, kv_heads * d))
    out = (random_rows(rng, Q.Q4_K, hidden, heads * d), int(Q.Q4_K))
    attn_norm, ffn_norm = attn_norms(rng, hidden)
    q_norm, k_norm = attn_norms(rng, d)
    moe = moe_call(rng, hidden, shared=gated)
    call = AttentionMoELayerCall.make(attn_norm, ffn_norm, EPS, proj, q_norm, k_norm, shape, 2, out, moe)
    assert call is not None
    caches = [rng.standard_normal((start + 8, kv_heads, d)).astype(np.float32) for _ in range(2)]
    k_cache, v_cache = caches
    k_want, v_want = k_cache.copy(), v_cache.copy()
    h = rng.standard_normal(hidden).astype(np.float32)
    numba.set_num_threads(2)
    for pos in range(start, start + 3):
        want = h.copy()
        x = rmsnorm(want[None], attn_norm, EPS)[0]
        qg, k, v = quant.matvecs(list(proj), x, act_quant=True)
        qg = qg.reshape(1, heads, 2 if gated else 1, d)
        q = rmsnorm_heads(np.ascontiguousarray(qg[:, :, 0]), q_norm, EPS)
        k = rmsnorm_heads(k.reshape(1, kv_heads, d), k_norm, EPS)
        positions = np.array([pos + 7])
        k_want[pos:pos + 1] = rope(k, positions, 1e6, 32)
        v_want[pos] = v.reshape(kv_heads, d)
        o = attend(rope(q, positions, 1e6, 32), k_want, v_want, pos, d ** -0.5).reshape(1, -1)
        if gated:
            o = mul_sigmoid(o, np.ascontiguousarray(qg[:, :, 1]).reshape(1, -1))
        want = want + quant.matvec(*out, o[0], act_quant=True)
        want = want + moe(rmsnorm(want[None], ffn_norm, EPS)[0])[0]
        call(h, k_cache, v_cache, pos, pos + 7)
        np.testing.assert_array_equal(h, want)
        np.testing.assert_array_equal(k_cache[:pos + 1], k_want[:pos + 1])
        np.testing.assert_array_equal(v_cache[:pos + 1], v_want[:pos + 1])
    with pytest.raises(ValueError, match="caches"):
        call(h, k_cache[:, :1].copy() if kv_heads > 1 else k_cache[:, :, :32].copy(), v_cache, start, start)


def moe_args(rng):
    experts = tuple((np.stack([random_rows(rng, Q.Q8_0, rows, k) for _ in range(EXPERTS)]), int(Q.Q8_0))
                    for rows, k in ((FFN, 256), (FFN, 256), (256, FFN)))
    router = (rng.standard_normal((EXPERTS, 256)).astype(np.float32).view(np.uint8), F32)
    return router, TOP_K, True, experts
