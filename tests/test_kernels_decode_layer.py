"""kernels.decode_layer: a decoded DeltaNet layer in one compiled call gives, bit for bit, what its steps give one
call at a time through their own wrappers (norms.rmsnorm, quant.matvecs / matvec, DecodeStep, MoETokenCall), whose
kernels the float64 reference tests check. The end-to-end form (a converted model's logits, token after token) is
in test_parity_qwen3next."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from test_kernels_expert_pool import random_rows

from strata_async.kernels import quant
from strata_async.kernels.decode_layer import DeltaNetMoELayerCall
from strata_async.kernels.deltanet import DecodeStep
from strata_async.kernels.moe_token import MoETokenCall
from strata_async.kernels.norms import rmsnorm
from strata_async.kernels.quant_float import F32

HK, DK, HV, DV, CONV = 2, 64, 4, 64, 4
EXPERTS, FFN, TOP_K = 8, 64, 2
EPS = 1e-6


def layer(rng, hidden: int, proj_types: tuple[Q, Q, Q], out_type: Q):
    channels = 2 * HK * DK + HV * DV
    proj = tuple((random_rows(rng, t, rows, hidden), int(t))
                 for t, rows in zip(proj_types, (channels, HV * DV, 2 * HV)))
    step = DecodeStep(rng.standard_normal((channels, CONV)).astype(np.float32) * 0.3,
                      -np.exp(rng.standard_normal(HV)).astype(np.float32), rng.standard_normal(HV).astype(np.float32),
                      1 + 0.1 * rng.standard_normal(DV).astype(np.float32), EPS, HK, DK, HV, DV, fused_ba=True,
                      tiled=False, silu_gate=True)
    out = (random_rows(rng, out_type, hidden, HV * DV), int(out_type))
    experts = tuple((np.stack([random_rows(rng, Q.Q8_0, rows, k) for _ in range(EXPERTS)]), int(Q.Q8_0))
                    for rows, k in ((FFN, hidden), (FFN, hidden), (hidden, FFN)))
    shared = tuple((random_rows(rng, Q.Q8_0, rows, k), int(Q.Q8_0))
                   for rows, k in ((FFN, hidden), (FFN, hidden), (hidden, FFN)))
    router = (rng.standard_normal((EXPERTS, hidden)).astype(np.float32).view(np.uint8), F32)
    gate_inp = (rng.standard_normal((1, hidden)).astype(np.float32).view(np.uint8), F32)
    moe = MoETokenCall(router, TOP_K, True, experts, shared, gate_inp, quantized_activations=True)
    norms = [1 + 0.1 * rng.standard_normal(hidden).astype(np.float32) for _ in range(2)]
    return norms, proj, step, out, moe


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


def moe_args(rng):
    experts = tuple((np.stack([random_rows(rng, Q.Q8_0, rows, k) for _ in range(EXPERTS)]), int(Q.Q8_0))
                    for rows, k in ((FFN, 256), (FFN, 256), (256, FFN)))
    router = (rng.standard_normal((EXPERTS, 256)).astype(np.float32).view(np.uint8), F32)
    return router, TOP_K, True, experts
