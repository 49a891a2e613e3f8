"""Norm kernels against the float64 references and against transformers' Qwen3-Next modules.

Inputs are fresh each run (the seed is printed for reproduction). Tolerances: against float64,
max abs error <= 2e-6 for O(1) outputs (float32 rounding of a few operations); against
transformers' float32 modules, 1e-5.
"""

import numpy as np
import pytest
from assets import randn
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextRMSNorm,
    Qwen3NextRMSNormGated,
    l2norm as hf_l2norm,
)

from strata_async.kernels.norms import gated_rmsnorm, l2norm, rmsnorm, rmsnorm_heads
from strata_async.kernels.reference import gated_rmsnorm_ref, l2norm_ref, rmsnorm_ref

F64_TOL = 2e-6
HF_TOL = 1e-5


def hf_rmsnorm(x: np.ndarray, w_hf: np.ndarray, eps: float) -> np.ndarray:
    norm = Qwen3NextRMSNorm(x.shape[-1], eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w_hf))
        return norm(torch.from_numpy(x)).numpy()


@pytest.mark.parametrize("n, d", [(1, 8), (5, 64), (3, 2048), (17, 100)])
def test_rmsnorm_matches_reference_and_transformers(rng, n, d):
    x = randn(rng, n, d, scale=3.0)
    w_hf = randn(rng, d, scale=0.3)
    # llama.cpp's converter stores HF's RMSNorm weight as weight + 1
    w_gguf = (torch.from_numpy(w_hf) + 1).numpy()
    eps = 1e-6
    out = rmsnorm(x, w_gguf, eps)
    assert out.dtype == np.float32 and out.shape == (n, d)
    np.testing.assert_allclose(out, rmsnorm_ref(x, w_gguf, eps), rtol=0, atol=F64_TOL * 3)
    np.testing.assert_allclose(out, hf_rmsnorm(x, w_hf, eps), rtol=0, atol=HF_TOL * 3)


def test_rmsnorm_eps_matters_for_small_rows(rng):
    x = randn(rng, 4, 32, scale=1e-3)
    w = randn(rng, 32)
    np.testing.assert_allclose(rmsnorm(x, w, 1e-5), rmsnorm_ref(x, w, 1e-5), rtol=1e-5, atol=1e-7)
    assert not np.allclose(rmsnorm(x, w, 1e-5), rmsnorm(x, w, 1e-9), rtol=1e-3)


@pytest.mark.parametrize("n, h, d", [(1, 2, 16), (7, 4, 256), (3, 16, 128)])
def test_rmsnorm_heads_matches_reference_and_transformers(rng, n, h, d):
    x = randn(rng, n, h, d, scale=2.0)
    w_hf = randn(rng, d, scale=0.3)
    w_gguf = (torch.from_numpy(w_hf) + 1).numpy()
    out = rmsnorm_heads(x, w_gguf, 1e-6)
    assert out.shape == (n, h, d)
    np.testing.assert_allclose(out, rmsnorm_ref(x, w_gguf, 1e-6), rtol=0, atol=F64_TOL * 2)
    # HF's q_norm/k_norm: Qwen3NextRMSNorm over the head dim of [batch, seq, heads, head_dim]
    np.testing.assert_allclose(out, hf_rmsnorm(x[None], w_hf, 1e-6)[0], rtol=0, atol=HF_TOL * 2)


@pytest.mark.parametrize("n, h, d", [(1, 1, 8), (5, 4, 128), (2, 32, 128)])
def test_gated_rmsnorm_matches_reference_and_transformers(rng, n, h, d):
    x = randn(rng, n, h, d)
    gate = randn(rng, n, h, d, scale=4.0)
    w = randn(rng, d)  # stored unchanged: HF multiplies by this weight directly
    eps = 1e-6
    out = gated_rmsnorm(x, gate, w, eps)
    # Outputs reach ~30 (normal weights times silu of gates of scale 4): float32 rounding is relative there
    # (seen 1.0e-5 at |out| 30, 3.4e-7 relative), so a relative bar joins the absolute one.
    np.testing.assert_allclose(out, gated_rmsnorm_ref(x, gate, w, eps), rtol=F64_TOL, atol=F64_TOL * 4)
    norm = Qwen3NextRMSNormGated(d, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(w))
        # the DeltaNet layer flattens [batch, seq, heads, d] to [-1, d] before the norm
        expected = norm(torch.from_numpy(x.reshape(-1, d)), torch.from_numpy(gate.reshape(-1, d))).numpy()
    np.testing.assert_allclose(out.reshape(-1, d), expected, rtol=0, atol=HF_TOL * 4)


@pytest.mark.parametrize("n, h, d", [(1, 1, 4), (9, 16, 128), (3, 2, 33)])
def test_l2norm_matches_reference_and_transformers(rng, n, h, d):
    x = randn(rng, n, h, d, scale=5.0)
    x[0, 0] *= 1e-4  # a tiny vector, where eps shows
    out = l2norm(x)
    np.testing.assert_allclose(out, l2norm_ref(x), rtol=0, atol=F64_TOL)
    np.testing.assert_allclose(out, hf_l2norm(torch.from_numpy(x), dim=-1, eps=1e-6).numpy(), rtol=0, atol=HF_TOL)
    np.testing.assert_allclose(l2norm(x, eps=1e-3), l2norm_ref(x, eps=1e-3), rtol=0, atol=F64_TOL)


def test_norms_reject_bad_arguments(rng):
    x = randn(rng, 4, 8)
    w = randn(rng, 8)
    with pytest.raises(ValueError, match="dtype float32"):
        rmsnorm(x.astype(np.float64), w, 1e-6)
    with pytest.raises(ValueError, match=r"w must have shape \[8\]"):
        rmsnorm(x, randn(rng, 7), 1e-6)
    with pytest.raises(ValueError, match="C-contiguous"):
        rmsnorm(randn(rng, 8, 4).T, randn(rng, 8)[:8], 1e-6)
    with pytest.raises(ValueError, match=r"gate must have shape \[2, 2, 8\]"):
        gated_rmsnorm(x.reshape(2, 2, 8), randn(rng, 2, 8), w, 1e-6)
    with pytest.raises(ValueError, match="shape"):
        rmsnorm_heads(x, w, 1e-6)
    with pytest.raises(ValueError, match="numpy array"):
        l2norm([[[1.0]]])
