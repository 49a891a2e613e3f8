"""Attention and rotary kernels against the float64 references and transformers' Qwen3-Next code
(eager_attention_forward, apply_rotary_pos_emb with Qwen3NextRotaryEmbedding, and the whole gated
Qwen3NextAttention layer with partial rotary).

Inputs are fresh each run (the seed is printed for reproduction). Tolerances, as max abs error
on O(1) outputs: 1e-5 against float64 (float32 dot products over up to 128 values and a float32
softmax; seen up to 2e-6); 2e-5 against transformers' float32 torch code (seen up to 5e-6); rope against transformers
max|x| * max(position) * 2^-21, since transformers computes the angles position * inv_freq in
float32 (errors of a few float32 ulps of the angle) where ours are float64.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from assets import randn
import torch
from transformers import Qwen3NextConfig
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextAttention,
    Qwen3NextRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
)

from strata_async.kernels.attention import attend, attend_selected, rope
from strata_async.kernels.norms import rmsnorm_heads
from strata_async.kernels.reference import attend_ref, attend_selected_ref, rope_ref

F64_TOL = 1e-5
HF_TOL = 2e-5


def hf_attention(q, k_cache, v_cache, start_pos, scale):
    """transformers' eager attention with an explicit causal mask for queries at start_pos.."""
    n, hq, _ = q.shape
    length = start_pos + n
    hkv = k_cache.shape[1]
    mask = torch.full((n, length), float("-inf"))
    for i in range(n):
        mask[i, : start_pos + i + 1] = 0.0
    module = SimpleNamespace(num_key_value_groups=hq // hkv, training=False)
    out, _ = eager_attention_forward(
        module,
        torch.from_numpy(q).transpose(0, 1)[None],
        torch.from_numpy(k_cache[:length]).transpose(0, 1)[None],
        torch.from_numpy(v_cache[:length]).transpose(0, 1)[None],
        mask[None, None],
        scaling=scale,
    )
    return out[0].numpy()  # eager returns [batch, n, heads, dv]


ATTN_SHAPES = [  # n, start_pos, hq, hkv, d, dv
    (1, 0, 2, 2, 16, 16),  # first token
    (1, 300, 16, 2, 64, 64),  # decode
    (37, 0, 4, 1, 32, 32),  # prefill
    (20, 45, 8, 2, 16, 24),  # prefill chunk continuing a sequence, dv != d
    (9, 3, 6, 3, 8, 8),
    (70, 130, 32, 4, 128, 128),  # qwen3moe-like heads
]


@pytest.mark.parametrize("n, start_pos, hq, hkv, d, dv", ATTN_SHAPES)
def test_attend_matches_reference_and_transformers(rng, n, start_pos, hq, hkv, d, dv):
    spare = 7  # cache rows past the sequence must be ignored
    q = randn(rng, n, hq, d)
    k_cache = randn(rng, start_pos + n + spare, hkv, d, scale=2.0)
    v_cache = randn(rng, start_pos + n + spare, hkv, dv)
    out = attend(q, k_cache, v_cache, start_pos)
    assert out.dtype == np.float32 and out.shape == (n, hq, dv)
    np.testing.assert_allclose(out, attend_ref(q, k_cache, v_cache, start_pos), rtol=0, atol=F64_TOL)
    np.testing.assert_allclose(out, hf_attention(q, k_cache, v_cache, start_pos, d ** -0.5), rtol=0, atol=HF_TOL)


@pytest.mark.parametrize("key_splits", [1, 2, 3, 7])
@pytest.mark.parametrize("n, start_pos", [(1, 1000), (3, 517), (40, 200)])
def test_attend_key_splits_agree(rng, key_splits, n, start_pos):
    """Splitting the keys into ranges merged afterwards gives the one-pass result."""
    hq, hkv, d = 8, 2, 32
    q = randn(rng, n, hq, d, scale=2.0)
    k_cache = randn(rng, start_pos + n, hkv, d)
    v_cache = randn(rng, start_pos + n, hkv, d)
    out = attend(q, k_cache, v_cache, start_pos, key_splits=key_splits)
    np.testing.assert_allclose(out, attend_ref(q, k_cache, v_cache, start_pos), rtol=0, atol=F64_TOL)


def test_attend_scale_and_peaked_scores(rng):
    """A non-default scale, and scores large enough that an unstabilized softmax would overflow.

    Integer-valued q and k keep every score exact in float32 (|q.k| <= 16 * 30 * 30 < 2^24, and the
    scale 0.5 is a power of two): with random real inputs the float32 rounding of scores near 1e3
    alone moves the softmax weights by ~1e-4 relative, which says nothing about the kernel.
    """
    q = rng.integers(-30, 31, size=(5, 4, 16)).astype(np.float32)
    k_cache = rng.integers(-30, 31, size=(12, 2, 16)).astype(np.float32)
    v_cache = randn(rng, 12, 2, 16)
    out = attend(q, k_cache, v_cache, 7, scale=0.5)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, attend_ref(q, k_cache, v_cache, 7, scale=0.5), rtol=0, atol=F64_TOL)


def test_attend_in_pieces_equals_one_pass(rng):
    """Prefill in two chunks plus decode steps over a growing cache == attention over everything."""
    n, hq, hkv, d = 30, 4, 2, 16
    q = randn(rng, n, hq, d)
    k_cache = randn(rng, 64, hkv, d)
    v_cache = randn(rng, 64, hkv, d)
    whole = attend(q, k_cache, v_cache, 0)
    pieces = [attend(q[a:b], k_cache, v_cache, a) for a, b in [(0, 11), (11, 27), (27, 28), (28, 29), (29, 30)]]
    np.testing.assert_allclose(np.concatenate(pieces), whole, rtol=0, atol=F64_TOL)


def hf_rope(x, positions, theta, head_dim, partial):
    config = Qwen3NextConfig(head_dim=head_dim, rope_parameters={
        "rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial})
    rotary = Qwen3NextRotaryEmbedding(config)
    xt = torch.from_numpy(x).transpose(0, 1)[None]  # [batch, heads, n, d]
    cos, sin = rotary(xt, torch.from_numpy(positions)[None])
    out, _ = apply_rotary_pos_emb(xt, xt, cos, sin)
    return out[0].transpose(0, 1).numpy()


@pytest.mark.parametrize("n, h, d, partial, theta", [
    (1, 2, 16, 1.0, 10000.0),
    (9, 4, 256, 0.25, 10000000.0),  # Qwen3-Next: head 256, 64 rotary dims
    (33, 8, 128, 1.0, 1000000.0),  # Qwen3-MoE: full rotary
    (5, 3, 32, 0.5, 500.0),
])
def test_rope_matches_reference_and_transformers(rng, n, h, d, partial, theta):
    x = randn(rng, n, h, d)
    positions = np.sort(rng.choice(2048, size=n, replace=False)).astype(np.int64)
    rot_dim = int(d * partial)
    out = rope(x, positions, theta, rot_dim)
    assert out.dtype == np.float32 and out.shape == x.shape
    np.testing.assert_allclose(out, rope_ref(x, positions, theta, rot_dim), rtol=0, atol=F64_TOL)
    np.testing.assert_array_equal(out[..., rot_dim:], x[..., rot_dim:])
    hf_tol = np.abs(x).max() * positions.max() * 2.0 ** -21
    np.testing.assert_allclose(out, hf_rope(x, positions, theta, d, partial), rtol=0, atol=hf_tol)


def test_rope_at_large_positions_matches_reference(rng):
    x = randn(rng, 4, 2, 64)
    positions = np.array([0, 70000, 131071, 1000000], dtype=np.int32)
    np.testing.assert_allclose(rope(x, positions, 1e7, 64), rope_ref(x, positions, 1e7, 64), rtol=0, atol=1e-5)


def test_gated_attention_layer_matches_transformers(rng):
    """q/gate split, q/k RMSNorm (GGUF weights = 1 + HF weight), partial NEOX rope, attention over a
    KV cache filled in pieces, and the sigmoid output gate == Qwen3NextAttention on the whole sequence."""
    hidden, hq, hkv, hd, partial, theta, eps = 64, 4, 2, 32, 0.25, 10000.0, 1e-6
    config = Qwen3NextConfig(hidden_size=hidden, num_attention_heads=hq, num_key_value_heads=hkv, head_dim=hd,
                             rms_norm_eps=eps, attn_implementation="eager",
                             rope_parameters={"rope_type": "default", "rope_theta": theta,
                                              "partial_rotary_factor": partial})
    torch.manual_seed(int(rng.integers(2**31)))
    layer = Qwen3NextAttention(config, layer_idx=3).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    n = 19
    x = randn(rng, n, hidden)
    positions = np.arange(n)
    with torch.no_grad():
        cos_sin = Qwen3NextRotaryEmbedding(config)(torch.from_numpy(x)[None], torch.from_numpy(positions)[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        expected, _ = layer(torch.from_numpy(x)[None], cos_sin, mask)
    expected = expected[0].numpy()

    w = {name: p.detach().numpy() for name, p in layer.named_parameters()}
    q_norm_w = w["q_norm.weight"] + np.float32(1)  # what the converter writes for GGUF
    k_norm_w = w["k_norm.weight"] + np.float32(1)
    k_cache = np.zeros((n, hkv, hd), np.float32)
    v_cache = np.zeros((n, hkv, hd), np.float32)
    pieces = []
    for a, b in [(0, 12), (12, 13), (13, 19)]:
        m = b - a
        q_and_gate = (x[a:b] @ w["q_proj.weight"].T).reshape(m, hq, 2 * hd)
        q = np.ascontiguousarray(q_and_gate[..., :hd])
        gate = q_and_gate[..., hd:].reshape(m, hq * hd)
        k = (x[a:b] @ w["k_proj.weight"].T).reshape(m, hkv, hd)
        v = (x[a:b] @ w["v_proj.weight"].T).reshape(m, hkv, hd)
        q = rope(rmsnorm_heads(q, q_norm_w, eps), positions[a:b], theta, int(hd * partial))
        k_cache[a:b] = rope(rmsnorm_heads(k, k_norm_w, eps), positions[a:b], theta, int(hd * partial))
        v_cache[a:b] = v
        attn = attend(q, k_cache, v_cache, a).reshape(m, hq * hd)
        pieces.append((attn / (1 + np.exp(-gate))) @ w["o_proj.weight"].T)
    np.testing.assert_allclose(np.concatenate(pieces), expected, rtol=0, atol=2e-5 * np.abs(expected).max())


def test_attention_kernels_reject_bad_arguments(rng):
    q = randn(rng, 3, 4, 8)
    cache = randn(rng, 10, 2, 8)
    with pytest.raises(ValueError, match="write the new keys/values into the cache first"):
        attend(q, cache, cache, 8)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        attend(randn(rng, 3, 3, 8), cache, cache, 0)
    with pytest.raises(ValueError, match=r"k_cache must have shape \[\*, \*, 8\]"):
        attend(q, randn(rng, 10, 2, 4), cache, 0)
    with pytest.raises(ValueError, match="C-contiguous"):
        attend(q, cache, cache[:, :, ::-1], 0)
    with pytest.raises(ValueError, match="key_splits must be at least 1"):
        attend(q, cache, cache, 0, key_splits=0)
    with pytest.raises(ValueError, match="'neox'"):
        rope(q, np.arange(3), 1e4, 8, style="normal")
    with pytest.raises(ValueError, match="rot_dim must be even"):
        rope(q, np.arange(3), 1e4, 5)
    with pytest.raises(ValueError, match="integer numpy array"):
        rope(q, np.arange(3.0), 1e4, 8)


@pytest.mark.parametrize("n", [1, 7])
def test_attend_selected_matches_reference(rng, n):
    """Sparse (QSA) attention: each query over its own subset of rows; a causal mask gives plain attention."""
    hq, hkv, d, length = 8, 2, 16, 40
    q, k, v = randn(rng, n, hq, d), randn(rng, length + 5, hkv, d), randn(rng, length + 5, hkv, d)
    allowed = rng.random((n, length)) < 0.3
    allowed[np.arange(n), rng.integers(0, length, n)] = True  # at least one row each
    got = attend_selected(q, k, v, allowed, scale=0.2)
    np.testing.assert_allclose(got, attend_selected_ref(q, k, v, allowed, scale=0.2), rtol=1e-5, atol=1e-5)
    causal = np.arange(length)[None, :] <= (length - n + np.arange(n))[:, None]
    np.testing.assert_allclose(attend_selected(q, k, v, causal), attend(q, k, v, length - n), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="at least one"):
        attend_selected(q, k, v, np.zeros((n, length), dtype=bool))
