"""i-quant kernels (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) against gguf.quants and float64.

Weights are random valid blocks: every index, sign and scale bit pattern is valid in these formats,
so those fields are random bytes; the fp16 super-block scale d is a random finite, non-zero value.

Tolerances, relative to S = sum_i |w_i| |x_i| per output:
- matvec accumulates float32 products in float64: error <= ~2 * 2^-24 * S;
- matmul multiplies float32 tiles with BLAS: about 1e-7 * S at k = 2048 on random data
  (the rigorous bound, k * 2^-24 * S, is loose);
both are tested at 1e-6 * S.  One wrong weight moves an output by about S / k (>= 5e-4 * S at
k <= 2048) and one wrong Q8_K step by about S / (30 k) (>= 1.5e-5 * S); leaving the activations
unrounded is off by ~1e-3 * S.  All of these fail the tests.
"""

import gguf
import numpy as np
import pytest
from gguf import quants as gguf_quants

from strata_async.kernels import quant, quant_int, quant_iq
from strata_async.kernels.reference import q8_k_activations_ref

IQ_TYPES = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S"]
REL_TOL = 1e-6


def _ggml_type(name: str) -> int:
    return int(gguf.GGMLQuantizationType[name])


def random_rows(rng: np.random.Generator, name: str, rows: int, k: int) -> np.ndarray:
    """[rows, row_bytes] uint8 of random valid blocks of the named i-quant."""
    ggml_type = _ggml_type(name)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    n_blocks = rows * k // block_elems
    blocks = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    d = (rng.uniform(1e-3, 5e-2, n_blocks) * rng.choice([-1.0, 1.0], n_blocks)).astype(np.float16)
    if name == "IQ1_M":
        # the fp16 d is split over the top nibbles of the four uint16 scale words at bytes 48..55
        scales = blocks[:, 48:56].copy().view(np.uint16)
        bits = d.view(np.uint16)
        for i in range(4):
            scales[:, i] = (scales[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
        blocks[:, 48:56] = scales.view(np.uint8)
    else:
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def reference_weights(w: np.ndarray, name: str) -> np.ndarray:
    """float64 weights decoded by gguf-py (bit-exact with ggml)."""
    return gguf_quants.dequantize(w, gguf.GGMLQuantizationType[name]).astype(np.float64)


def assert_product_close(got: np.ndarray, w64: np.ndarray, x64: np.ndarray) -> None:
    """got ([n, rows] or [rows]) against x64 @ w64.T within REL_TOL * sum |w||x|."""
    want = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    err = np.abs(got.astype(np.float64) - want)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.all(err <= REL_TOL * scale), f"max error / S = {np.max(err / scale):.3g}"


@pytest.mark.parametrize("name", IQ_TYPES)
def test_dequantize_bit_exact_with_gguf(name, rng):
    for shape in [(1, 256), (37, 512), (3, 5, 2048)]:
        rows, k = int(np.prod(shape[:-1])), shape[-1]
        w = random_rows(rng, name, rows, k)
        got = quant.dequantize(w, _ggml_type(name), shape)
        want = gguf_quants.dequantize(w, gguf.GGMLQuantizationType[name]).reshape(shape)
        assert got.dtype == np.float32 and got.shape == shape
        assert np.all(np.isfinite(got)) and np.any(got != 0)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", IQ_TYPES)
def test_matvec_against_float64(name, rng):
    for rows, k in [(1, 256), (67, 512), (131, 2048), (200, 256)]:
        w = random_rows(rng, name, rows, k)
        x = rng.standard_normal(k).astype(np.float32)
        got = quant.matvec(w, _ggml_type(name), x)
        assert_product_close(got, reference_weights(w, name), x.astype(np.float64))


@pytest.mark.parametrize("name", IQ_TYPES)
def test_matmul_against_float64(name, rng):
    rows = 131  # one full tile of 128 rows and a partial one
    ks = [256, 512, 2048]
    for i, n in enumerate([1, 2, 3, 4, 5, 6, 7, 33]):
        k = ks[i % len(ks)]
        w = random_rows(rng, name, rows, k)
        x = rng.standard_normal((n, k)).astype(np.float32)
        got = quant.matmul(w, _ggml_type(name), x)
        assert_product_close(got, reference_weights(w, name), x.astype(np.float64))


@pytest.mark.parametrize("name", IQ_TYPES)
def test_quantized_activations_match_q8_k(name, rng):
    ggml_type = _ggml_type(name)
    for rows, k, n in [(67, 256, 3), (29, 768, 2), (131, 2048, 5)]:  # 768: block pairs and an odd last block
        w = random_rows(rng, name, rows, k)
        w64 = reference_weights(w, name)
        x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 10.0)).astype(np.float32)
        x_q8 = q8_k_activations_ref(x)
        assert_product_close(quant.matmul(w, ggml_type, x, act_quant=True), w64, x_q8)
        assert_product_close(quant.matvec(w, ggml_type, x[0], act_quant=True), w64, x_q8[0])


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ3_XXS", "IQ2_S", "IQ3_S", "IQ1_S", "IQ1_M"])
def test_integer_dot_without_avx512_matches_float64(name, rng):
    """The i-quants' portable integer loops (CPUs without AVX-512BW; this one may take the vector path in matvec):
    rows against float64 of gguf's weights times the activations their Q8_K codes stand for."""
    loop = getattr(quant_iq, f"idot_{name.lower()}_loop")
    for k in (256, 768):
        w = random_rows(rng, name, 3, k)
        w64 = reference_weights(w, name)
        xq, xd, xs16 = quant_int.q8_activations(rng.standard_normal(k).astype(np.float32), 256)
        x64 = xq.astype(np.float64) * np.repeat(xd.astype(np.float64), 256)
        got = np.array([loop(w[r], xq, xd, xs16) for r in range(3)], np.float32)
        assert_product_close(got, w64, x64)
