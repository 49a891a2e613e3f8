"""Gated DeltaNet kernels against the float64 references and transformers' Qwen3-Next functions
(torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule, causal_conv1d_update,
causal_conv1d_fn, and the whole Qwen3NextGatedDeltaNet layer).

Inputs are fresh each run (the seed is printed for reproduction). Decays mix weak and strong heads
(g from about -0.001 to -50, as ssm_a * softplus spans). Tolerances, as max abs error on O(1)
outputs and states: 5e-6 against float64 (float32 state updates over a few hundred tokens; seen
up to 1e-6), 3e-5 against transformers' float32 torch code (seen up to 5e-6), 5e-6 between our own
two forms of the rule.
"""

import numpy as np
import pytest
from assets import randn
import torch
import torch.nn.functional as F
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextGatedDeltaNet,
    causal_conv1d_fn,
    causal_conv1d_update,
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from strata_async.kernels.deltanet import (
    causal_conv1d,
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gdn_gates,
)
from strata_async.kernels.norms import gated_rmsnorm, l2norm
from strata_async.kernels.reference import causal_conv1d_ref, gated_delta_rule_ref, gdn_gates_ref

F64_TOL = 5e-6
HF_TOL = 3e-5
SELF_TOL = 5e-6


def random_rule_inputs(rng, n, hk, hv, dk, dv):
    """Raw (un-normalized) q, k; v; g and beta through the real gate formula; a nonzero state."""
    q = randn(rng, n, hk, dk)
    k = randn(rng, n, hk, dk)
    v = randn(rng, n, hv, dv)
    ssm_a = -np.exp(rng.uniform(np.log(0.01), np.log(16.0), hv)).astype(np.float32)  # -exp(A_log)
    g, beta = gdn_gates(randn(rng, n, hv, scale=2.0), randn(rng, n, hv, scale=2.0), ssm_a, randn(rng, hv))
    state = randn(rng, hv, dk, dv, scale=0.5)
    return q, k, v, g, beta, state


def hf_rule(fn, q, k, v, g, beta, state, **kwargs):
    """Run a transformers delta-rule function (it l2-normalizes q/k itself) on batch 1."""
    t = [torch.from_numpy(a)[None] for a in (q, k, v, g, beta)]
    out, final = fn(*t, initial_state=torch.from_numpy(state)[None].clone(), output_final_state=True,
                    use_qk_l2norm_in_kernel=True, **kwargs)
    return out[0].numpy(), final[0].numpy()


SHAPES = [  # n, hk, hv, dk, dv
    (1, 2, 2, 16, 16),
    (5, 1, 3, 8, 12),
    (37, 2, 4, 32, 24),
    (130, 2, 8, 16, 16),
    (64, 4, 8, 128, 128),
]


@pytest.mark.parametrize("n, hk, hv, dk, dv", SHAPES)
def test_recurrent_rule_matches_reference_and_transformers(rng, n, hk, hv, dk, dv):
    q, k, v, g, beta, state = random_rule_inputs(rng, n, hk, hv, dk, dv)
    qn, kn = l2norm(q), l2norm(k)
    ref_out, ref_state = gated_delta_rule_ref(qn, kn, v, g, beta, state)
    hf_out, hf_state = hf_rule(torch_recurrent_gated_delta_rule, q, k, v, g, beta, state)
    s = state.copy()
    out = gated_delta_rule_recurrent(qn, kn, v, g, beta, s)
    assert out.dtype == np.float32 and out.shape == (n, hv, dv)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=F64_TOL)
    np.testing.assert_allclose(s, ref_state, rtol=0, atol=F64_TOL)
    np.testing.assert_allclose(out, hf_out, rtol=0, atol=HF_TOL)
    np.testing.assert_allclose(s, hf_state, rtol=0, atol=HF_TOL)


@pytest.mark.parametrize("n, hk, hv, dk, dv", SHAPES + [(200, 2, 4, 64, 32), (23, 1, 3, 5, 9)])
@pytest.mark.parametrize("chunk", [64, 16, 5])
def test_chunked_rule_matches_reference_recurrent_and_transformers(rng, n, hk, hv, dk, dv, chunk):
    q, k, v, g, beta, state = random_rule_inputs(rng, n, hk, hv, dk, dv)
    qn, kn = l2norm(q), l2norm(k)
    ref_out, ref_state = gated_delta_rule_ref(qn, kn, v, g, beta, state)
    s = state.copy()
    out = gated_delta_rule_chunked(qn, kn, v, g, beta, s, chunk=chunk)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=F64_TOL)
    np.testing.assert_allclose(s, ref_state, rtol=0, atol=F64_TOL)
    s_rec = state.copy()
    np.testing.assert_allclose(out, gated_delta_rule_recurrent(qn, kn, v, g, beta, s_rec), rtol=0, atol=SELF_TOL)
    np.testing.assert_allclose(s, s_rec, rtol=0, atol=SELF_TOL)
    hf_out, hf_state = hf_rule(torch_chunk_gated_delta_rule, q, k, v, g, beta, state, chunk_size=chunk)
    np.testing.assert_allclose(out, hf_out, rtol=0, atol=HF_TOL)
    np.testing.assert_allclose(s, hf_state, rtol=0, atol=HF_TOL)


def test_rule_state_carries_across_calls(rng):
    """Prefill in uneven chunked pieces, then decode token by token == one pass over everything."""
    n, hk, hv, dk, dv = 150, 2, 4, 32, 16
    q, k, v, g, beta, state = random_rule_inputs(rng, n, hk, hv, dk, dv)
    qn, kn = l2norm(q), l2norm(k)
    ref_out, ref_state = gated_delta_rule_ref(qn, kn, v, g, beta, state)
    s = state.copy()
    pieces = []
    for a, b in [(0, 70), (70, 71), (71, 140)]:
        pieces.append(gated_delta_rule_chunked(qn[a:b], kn[a:b], v[a:b], g[a:b], beta[a:b], s, chunk=32))
    for t in range(140, n):
        sl = slice(t, t + 1)
        pieces.append(gated_delta_rule_recurrent(qn[sl], kn[sl], v[sl], g[sl], beta[sl], s))
    np.testing.assert_allclose(np.concatenate(pieces), ref_out, rtol=0, atol=F64_TOL)
    np.testing.assert_allclose(s, ref_state, rtol=0, atol=F64_TOL)


def test_rule_with_underflowing_decays(rng):
    """Decays far below float32's normal range (g of -60 to -1000 per token, as a model with random weights
    gives): the kernels flush those subnormal products to zero and still match float64, and the caller's
    floating-point mode is left as it was (a subnormal product is still subnormal afterwards)."""
    n, hk, hv, dk, dv = 100, 2, 4, 32, 16
    q, k, v, _, beta, state = random_rule_inputs(rng, n, hk, hv, dk, dv)
    g = -np.exp(rng.uniform(np.log(60.0), np.log(1000.0), (n, hv))).astype(np.float32)
    g[:, 0] = -rng.uniform(0.5, 1.5, n)  # one head whose decay crosses 1e-38 inside a chunk
    qn, kn = l2norm(q), l2norm(k)
    ref_out, ref_state = gated_delta_rule_ref(qn, kn, v, g, beta, state)
    for fn in (gated_delta_rule_recurrent, gated_delta_rule_chunked):
        s = state.copy()
        np.testing.assert_allclose(fn(qn, kn, v, g, beta, s), ref_out, rtol=0, atol=F64_TOL)
        np.testing.assert_allclose(s, ref_state, rtol=0, atol=F64_TOL)
        assert np.float32(1e-30) * np.float32(1e-10) > 0


def test_rule_scale_argument(rng):
    q, k, v, g, beta, state = random_rule_inputs(rng, 20, 1, 2, 16, 8)
    qn, kn = l2norm(q), l2norm(k)
    ref_out, _ = gated_delta_rule_ref(qn, kn, v, g, beta, state, scale=0.7)
    for fn in (gated_delta_rule_recurrent, gated_delta_rule_chunked):
        np.testing.assert_allclose(fn(qn, kn, v, g, beta, state.copy(), scale=0.7), ref_out, rtol=0, atol=F64_TOL)


@pytest.mark.parametrize("n, hv", [(1, 4), (33, 32)])
def test_gdn_gates_match_reference_and_transformers_formula(rng, n, hv):
    alpha, b = randn(rng, n, hv, scale=8.0), randn(rng, n, hv, scale=8.0)
    a_log = np.log(rng.uniform(0.01, 16.0, hv)).astype(np.float32)
    ssm_a = (-torch.from_numpy(a_log).exp()).numpy()  # what the converter writes
    dt_bias = randn(rng, hv)
    g, beta = gdn_gates(alpha, b, ssm_a, dt_bias)
    g_ref, beta_ref = gdn_gates_ref(alpha, b, ssm_a, dt_bias)
    np.testing.assert_allclose(g, g_ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(beta, beta_ref, rtol=1e-6, atol=1e-7)
    # HF: g = -A_log.exp() * softplus(a + dt_bias); beta = b.sigmoid()
    g_hf = -torch.from_numpy(a_log).exp() * F.softplus(torch.from_numpy(alpha) + torch.from_numpy(dt_bias))
    np.testing.assert_allclose(g, g_hf.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(beta, torch.from_numpy(b).sigmoid().numpy(), rtol=1e-6, atol=1e-7)


CONV_SHAPES = [(1, 24, 4), (3, 24, 4), (10, 96, 4), (7, 40, 2), (2, 8, 3)]  # n, channels, kernel


@pytest.mark.parametrize("n, channels, kernel", CONV_SHAPES)
def test_causal_conv1d_matches_reference_and_transformers_update(rng, n, channels, kernel):
    x = randn(rng, n, channels)
    weight = randn(rng, channels, kernel, scale=0.5)
    state = randn(rng, kernel - 1, channels)
    ref_out, ref_state = causal_conv1d_ref(x, state, weight)
    hf_state = torch.from_numpy(state.T.copy())[None]  # HF keeps [batch, channels, kernel-1]
    hf_out = causal_conv1d_update(torch.from_numpy(x.T.copy())[None], hf_state, torch.from_numpy(weight),
                                  None, "silu")
    s = state.copy()
    out = causal_conv1d(x, s, weight)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=2e-6)
    np.testing.assert_allclose(s, ref_state, rtol=0, atol=0)
    np.testing.assert_allclose(out, hf_out[0].numpy().T, rtol=0, atol=1e-5)
    np.testing.assert_allclose(s, hf_state[0].numpy().T, rtol=0, atol=0)


def test_causal_conv1d_fresh_sequence_in_pieces_matches_transformers(rng):
    """A zero state is a fresh sequence: pieces of 1, 2, 5 and 9 tokens == HF's conv over all 17."""
    n, channels, kernel = 17, 48, 4
    x = randn(rng, n, channels)
    weight = randn(rng, channels, kernel, scale=0.5)
    expected = causal_conv1d_fn(torch.from_numpy(x.T.copy())[None], torch.from_numpy(weight), None,
                                activation="silu")[0].numpy().T
    state = np.zeros((kernel - 1, channels), np.float32)
    bounds = [0, 1, 3, 8, 17]
    out = np.concatenate([causal_conv1d(x[a:b], state, weight) for a, b in zip(bounds, bounds[1:])])
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(state, x[-(kernel - 1):])


def test_gated_deltanet_layer_matches_transformers(rng):
    """The kernels composed as a DeltaNet layer, on weights in GGUF layout, == Qwen3NextGatedDeltaNet
    (fresh sequence, chunked path), then one decode token continuing from the carried states ==
    the layer run on the whole sequence."""
    config = Qwen3NextConfig(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
                             linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6)
    torch.manual_seed(int(rng.integers(2**31)))
    layer = Qwen3NextGatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.A_log.copy_(torch.log(torch.empty_like(layer.A_log).uniform_(0.01, 16)))
    n = 21
    hidden = randn(rng, n + 1, 64)
    with torch.no_grad():
        expected = layer(torch.from_numpy(hidden)[None])[0].numpy()
        qkvz = layer.in_proj_qkvz(torch.from_numpy(hidden)[None])
        ba = layer.in_proj_ba(torch.from_numpy(hidden)[None])
        # HF's own split of the interleaved projections (the converter reorders the weight rows
        # to the same q | k | v and z, b, a outputs)
        q, k, v, z, b, a = (t[0].numpy() for t in layer.fix_query_key_value_ordering(qkvz, ba))
    conv_weight = layer.conv1d.weight.detach().squeeze(1).numpy()  # GGUF ssm_conv1d: [channels, kernel]
    ssm_a = (-layer.A_log.detach().exp()).numpy()
    dt_bias = layer.dt_bias.detach().numpy()
    norm_w = layer.norm.weight.detach().numpy()
    out_w = layer.out_proj.weight.detach().numpy()
    key_dim, hk, hv, dk, dv = 32, 2, 4, 16, 8

    conv_state = np.zeros((3, 2 * key_dim + hv * dv), np.float32)
    rule_state = np.zeros((hv, dk, dv), np.float32)

    def run(rows, rule):
        mixed = np.concatenate([q[rows].reshape(-1, key_dim), k[rows].reshape(-1, key_dim),
                                v[rows].reshape(-1, hv * dv)], axis=1)
        mixed = causal_conv1d(np.ascontiguousarray(mixed), conv_state, conv_weight)
        m = mixed.shape[0]
        qc = l2norm(np.ascontiguousarray(mixed[:, :key_dim]).reshape(m, hk, dk))
        kc = l2norm(np.ascontiguousarray(mixed[:, key_dim:2 * key_dim]).reshape(m, hk, dk))
        vc = np.ascontiguousarray(mixed[:, 2 * key_dim:]).reshape(m, hv, dv)
        g, beta = gdn_gates(np.ascontiguousarray(a[rows]), np.ascontiguousarray(b[rows]), ssm_a, dt_bias)
        core = rule(qc, kc, vc, g, beta, rule_state)
        normed = gated_rmsnorm(core, np.ascontiguousarray(z[rows]), norm_w, 1e-6)
        return normed.reshape(m, hv * dv) @ out_w.T

    prefill = run(slice(0, n), gated_delta_rule_chunked)
    np.testing.assert_allclose(prefill, expected[:n], rtol=0, atol=1e-4 * np.abs(expected).max())
    decode = run(slice(n, n + 1), gated_delta_rule_recurrent)
    np.testing.assert_allclose(decode, expected[n:], rtol=0, atol=1e-4 * np.abs(expected).max())


def test_deltanet_kernels_reject_bad_arguments(rng):
    q, k, v, g, beta, state = random_rule_inputs(rng, 4, 2, 4, 8, 8)
    with pytest.raises(ValueError, match="multiple of key heads"):
        gated_delta_rule_recurrent(q, k, v[:, :3].copy(), g[:, :3].copy(), beta[:, :3].copy(), state[:3].copy())
    with pytest.raises(ValueError, match=r"state must have shape \[4, 8, 8\]"):
        gated_delta_rule_chunked(q, k, v, g, beta, state[:, :4].copy())
    with pytest.raises(ValueError, match="writable"):
        ro = state.copy()
        ro.flags.writeable = False
        gated_delta_rule_chunked(q, k, v, g, beta, ro)
    with pytest.raises(ValueError, match="dtype float32"):
        gated_delta_rule_recurrent(q, k, v, g.astype(np.float64), beta, state)
    with pytest.raises(ValueError, match="at least 1"):
        gated_delta_rule_chunked(q[:0], k[:0], v[:0], g[:0], beta[:0], state)
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        gated_delta_rule_chunked(q, k, v, g, beta, state, chunk=0)
    with pytest.raises(ValueError, match=r"conv_state must have shape \[3, 8\]"):
        causal_conv1d(randn(rng, 2, 8), randn(rng, 4, 8), randn(rng, 8, 4))
    with pytest.raises(ValueError, match="C-contiguous"):
        causal_conv1d(randn(rng, 8, 2).T, randn(rng, 3, 8), randn(rng, 8, 4))


@pytest.mark.parametrize("fused_ba", [True, False], ids=["ba", "b-a"])
@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("silu_gate", [True, False], ids=["silu", "sigmoid"])
def test_decode_step_matches_float64_composition(rng, fused_ba, tiled, silu_gate):
    """DecodeStep (a decoded token's mixer between its projections in one call) == the float64 references composed
    as the layer does, token after token from carried states: convolution, q/k L2 norms, gates from the b/a
    projection (ssm_ba's per-key-head layout or betas then alphas), the rule with value head h reading key head
    h // (hv / hk) or h % hk, the gated norm (silu or sigmoid gate)."""
    from strata_async.kernels.deltanet import DecodeStep
    from strata_async.kernels.reference import rmsnorm_ref, gated_rmsnorm_ref, l2norm_ref

    hk, hv, dk, dv, kernel, eps = 2, 6, 16, 8, 4, 1e-6
    r, channels = hv // hk, 2 * hk * dk + hv * dv
    conv_w = randn(rng, channels, kernel, scale=0.5)
    ssm_a = -np.exp(rng.uniform(np.log(0.01), np.log(16.0), hv)).astype(np.float32)
    dt_bias, norm_w = randn(rng, hv), randn(rng, dv)
    step = DecodeStep(conv_w, ssm_a, dt_bias, norm_w, eps, hk, dk, hv, dv, fused_ba, tiled, silu_gate)
    conv_state, state = randn(rng, kernel - 1, channels), randn(rng, hv, dk, dv, scale=0.5)
    ref_conv, ref_state = conv_state.astype(np.float64), state.astype(np.float64)
    key_of = np.arange(hv) % hk if tiled else np.arange(hv) // r
    for _ in range(3):
        qkv, z, b, a = randn(rng, channels), randn(rng, hv * dv), randn(rng, hv, scale=2.0), randn(rng, hv, scale=2.0)
        ba = (np.stack([b.reshape(hk, r), a.reshape(hk, r)], axis=1).reshape(-1) if fused_ba
              else np.concatenate([b, a]))
        out = step(qkv, z, ba, conv_state, state)

        mixed, ref_conv = causal_conv1d_ref(qkv[None], ref_conv, conv_w)
        q = l2norm_ref(mixed[:, :hk * dk].reshape(1, hk, dk))[:, key_of]
        k = l2norm_ref(mixed[:, hk * dk:2 * hk * dk].reshape(1, hk, dk))[:, key_of]
        g, beta = gdn_gates_ref(a[None], b[None], ssm_a, dt_bias)
        o, ref_state = gated_delta_rule_ref(q, k, mixed[:, 2 * hk * dk:].reshape(1, hv, dv), g, beta, ref_state)
        zz = z.reshape(1, hv, dv).astype(np.float64)
        expected = (gated_rmsnorm_ref(o, zz, norm_w, eps) if silu_gate
                    else rmsnorm_ref(o, norm_w, eps) / (1 + np.exp(-zz))).reshape(-1)
        np.testing.assert_allclose(out, expected, rtol=0, atol=F64_TOL * max(1.0, np.abs(expected).max()))
        np.testing.assert_allclose(state, ref_state, rtol=0, atol=F64_TOL)
        np.testing.assert_allclose(conv_state, ref_conv, rtol=0, atol=1e-7)
    with pytest.raises(ValueError, match=r"ba must have shape \[12\]"):
        step(qkv, z, ba[:6].copy(), conv_state, state)
    with pytest.raises(ValueError, match="multiple of key heads"):
        DecodeStep(conv_w, ssm_a[:5].copy(), dt_bias[:5].copy(), norm_w, eps, hk, dk, 5, dv, fused_ba, tiled,
                   silu_gate)
