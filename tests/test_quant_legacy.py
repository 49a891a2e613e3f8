"""Scalar-scale and lookup-table kernels (Q4_0, Q4_1, Q5_0, Q5_1, Q2_0, IQ4_NL, IQ4_XS, MXFP4)
against gguf.quants, float64 and, for Q2_0 (a type gguf-py does not know), the float64 decoder in
kernels/reference.py written from the format description.

Weights are random valid blocks: floats quantized by gguf.quants where it can quantize the type,
and random bytes with a random finite scale (every code pattern is valid in these formats).

Tolerances, relative to S = sum_i |w_i| |x_i| per output:
- matvec accumulates float32 products in float64: error <= ~2 * 2^-24 * S, tested at 1e-6 * S;
- matmul multiplies float32 tiles with BLAS: error grows like sqrt(k) * 2^-24 * S for random data,
  far under 1e-6 * S for k <= 2048.
A wrong weight moves an output by about S / k >= 5e-4 * S, a wrong activation step (one Q8 level,
~amax / 127 of a 32-value block) by >= ~1e-5 * S at k = 2048: both fail the 1e-6 * S test.
"""

import gguf
import numpy as np
import pytest
from gguf import quants as gguf_quants

from strata_async.kernels import quant, quant_int
from strata_async.kernels.quant_legacy import Q2_0, quantize_q2_0
from strata_async.kernels.reference import dequantize_q2_0_ref, q8_k_activations_ref

REL_TOL = 1e-6
TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_0", "IQ4_NL", "IQ4_XS", "MXFP4"]
GGUF_QUANTIZES = {"Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"}
BLOCK_ELEMS = {"Q2_0": 64, "IQ4_XS": 256}  # the rest hold 32 weights a block
# Q4_1 and Q5_1 dot with Q8_1 activations, whose values are Q8_0's (same fp16 d = amax / 127 and
# roundf); Q8_1 only adds a block sum.  gguf-py's Q8_0 therefore serves as their reference too.
Q8_K_ACTIVATIONS = {"IQ4_XS"}


def _ggml_type(name: str) -> int:
    return Q2_0 if name == "Q2_0" else int(gguf.GGMLQuantizationType[name])


def _block_bytes(name: str) -> int:
    return 18 if name == "Q2_0" else gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1]


def random_block_bytes(rng: np.random.Generator, name: str, rows: int, k: int) -> np.ndarray:
    """[rows, row_bytes] uint8: random codes and bits, a random finite non-zero scale per block."""
    n_blocks = rows * k // BLOCK_ELEMS.get(name, 32)
    blocks = rng.integers(0, 256, (n_blocks, _block_bytes(name)), dtype=np.uint8)
    if name == "MXFP4":
        blocks[:, 0] = rng.integers(110, 135, n_blocks)  # e8m0 exponent: scales 2^-18 .. 2^6
    else:
        d = (rng.uniform(1e-3, 5e-2, n_blocks) * rng.choice([-1.0, 1.0], n_blocks)).astype(np.float16)
        blocks[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
        if name in ("Q4_1", "Q5_1"):  # the fp16 min m
            m = rng.uniform(-0.5, 0.5, n_blocks).astype(np.float16)
            blocks[:, 2:4] = m.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)


def random_weights(rng: np.random.Generator, name: str, rows: int, k: int) -> np.ndarray:
    """Random valid [rows, row_bytes] weights: quantized floats where gguf-py (or, for Q2_0, our
    quantizer) can make them, random blocks otherwise."""
    values = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 1.0, (rows, 1))).astype(np.float32)
    if name in GGUF_QUANTIZES:
        return gguf_quants.quantize(values, gguf.GGMLQuantizationType[name])
    if name == "Q2_0":
        return np.frombuffer(quantize_q2_0(values), np.uint8).reshape(rows, -1)
    return random_block_bytes(rng, name, rows, k)


def reference_weights(w: np.ndarray, name: str) -> np.ndarray:
    """float64 weights from a decoder that is not ours (gguf-py, bit-exact with ggml) or, for Q2_0,
    the float64 reference decoder."""
    if name == "Q2_0":
        return dequantize_q2_0_ref(w, (w.shape[0], w.shape[1] // 18 * 64))
    return gguf_quants.dequantize(w, gguf.GGMLQuantizationType[name]).astype(np.float64)


def reference_activations(x: np.ndarray, name: str) -> np.ndarray:
    """x rounded as ggml rounds activations for this weight type, in float64."""
    if name in Q8_K_ACTIVATIONS:
        return q8_k_activations_ref(x)
    q8 = gguf_quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    return gguf_quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0).astype(np.float64)


def assert_product_close(got: np.ndarray, w64: np.ndarray, x64: np.ndarray) -> None:
    """got ([n, rows] or [rows]) against x64 @ w64.T within REL_TOL * sum |w||x|."""
    want = x64 @ w64.T
    scale = np.abs(x64) @ np.abs(w64).T
    err = np.abs(got.astype(np.float64) - want)
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.all(err <= REL_TOL * scale), f"max error / S = {np.max(err / scale):.3g}"


def _ks(name: str) -> list[int]:
    block = BLOCK_ELEMS.get(name, 32)
    return sorted({block, 3 * block if block < 256 else 512, 2048})


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_bit_exact(name, rng):
    ks = _ks(name)
    for shape in [(1, ks[0]), (37, ks[1]), (3, 5, 2048)]:
        rows, k = int(np.prod(shape[:-1])), shape[-1]
        for w in (random_block_bytes(rng, name, rows, k), random_weights(rng, name, rows, k)):
            got = quant.dequantize(w, _ggml_type(name), shape)
            want = reference_weights(w, name).reshape(shape)
            assert got.dtype == np.float32 and got.shape == shape
            assert np.all(np.isfinite(got)) and np.any(got != 0)
            np.testing.assert_array_equal(got.astype(np.float64), want)
            if name != "Q2_0":  # gguf-py decodes in float32 too: compare the bits, signed zeros included
                gguf_f32 = gguf_quants.dequantize(w, gguf.GGMLQuantizationType[name]).reshape(shape)
                np.testing.assert_array_equal(got.view(np.uint32), gguf_f32.view(np.uint32))


def test_mxfp4_every_finite_exponent(rng):
    # e = 0 and 1 decode to float32 subnormals; beyond 252 the largest level (12 * 2^(e-128)) overflows
    e = np.arange(253, dtype=np.uint8)
    blocks = np.concatenate([e[:, None], rng.integers(0, 256, (e.size, 16), dtype=np.uint8)], axis=1)
    got = quant.dequantize(blocks, _ggml_type("MXFP4"), (e.size, 32))
    want = gguf_quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.all(np.isfinite(got))


@pytest.mark.parametrize("name", TYPES)
def test_matvec_against_float64(name, rng):
    ks = _ks(name)
    for rows, k in [(1, ks[0]), (67, ks[1]), (131, 2048), (200, ks[0])]:
        w = random_weights(rng, name, rows, k)
        x = rng.standard_normal(k).astype(np.float32)
        got = quant.matvec(w, _ggml_type(name), x)
        assert_product_close(got, reference_weights(w, name), x.astype(np.float64))


@pytest.mark.parametrize("name", TYPES)
def test_matmul_against_float64(name, rng):
    rows = 131  # one full tile of 128 rows and a partial one
    ks = _ks(name)
    for i, n in enumerate([1, 2, 3, 4, 5, 6, 7, 33]):
        k = ks[i % len(ks)]
        w = random_weights(rng, name, rows, k)
        x = rng.standard_normal((n, k)).astype(np.float32)
        got = quant.matmul(w, _ggml_type(name), x)
        assert_product_close(got, reference_weights(w, name), x.astype(np.float64))


@pytest.mark.parametrize("name", TYPES)
def test_quantized_activations_match_ggml(name, rng):
    ggml_type = _ggml_type(name)
    # k = 2048 + ks[1]: whole vector steps of every dot and a remainder (Q8_0: eight octets and three blocks)
    for rows, k, n in [(67, _ks(name)[1], 3), (131, 2048, 5), (19, 2048 + _ks(name)[1], 2)]:
        w = random_weights(rng, name, rows, k)
        w64 = reference_weights(w, name)
        x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 10.0)).astype(np.float32)
        x_q = reference_activations(x, name)
        # the kernels hold activations in float32: q * d correctly rounded (exact for Q8_0's fp16 d)
        np.testing.assert_array_equal(quant.quantize_activations(x, ggml_type), x_q.astype(np.float32))
        assert_product_close(quant.matmul(w, ggml_type, x, act_quant=True), w64, x_q)
        assert_product_close(quant.matvec(w, ggml_type, x[0], act_quant=True), w64, x_q[0])


def _nearest_grid_error(blocks: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Per-block squared error of the nearest points of {-d, 0, d, 2d}, d rounded to fp16 as stored."""
    d16 = d.astype(np.float16).astype(np.float64)[:, None]
    grid = np.array([-1.0, 0.0, 1.0, 2.0])[None, None, :] * d16[:, :, None]
    err = np.min((blocks[:, :, None] - grid) ** 2, axis=-1)
    return err.sum(axis=1)


def test_q2_0_quantizer_recovers_grid_values(rng):
    rows, k = 40, 256
    n_blocks = rows * k // 64
    d = (rng.uniform(1e-3, 10.0, n_blocks) * rng.choice([-1.0, 1.0], n_blocks)).astype(np.float16)
    codes = rng.integers(0, 4, (n_blocks, 64))
    codes[:, :4] = [0, 1, 2, 3]  # every level present, so the scale is unambiguous
    values = ((codes - 1) * d.astype(np.float32)[:, None]).astype(np.float32).reshape(rows, k)
    w = np.frombuffer(quantize_q2_0(values), np.uint8)
    assert w.size == n_blocks * 18
    np.testing.assert_array_equal(dequantize_q2_0_ref(w, (rows, k)), values.astype(np.float64))


def test_q2_0_quantizer_error(rng):
    rows, k = 64, 512
    values = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 3.0, (rows, 1))).astype(np.float32)
    values[0, :64] = np.abs(values[0, :64])  # one all-positive block: only the 0..2d half of the grid
    w = np.frombuffer(quantize_q2_0(values), np.uint8)
    got = dequantize_q2_0_ref(w, (rows, k))
    np.testing.assert_array_equal(quant.dequantize(w, Q2_0, (rows, k)).astype(np.float64), got)

    blocks = values.astype(np.float64).reshape(-1, 64)
    ours = ((got.reshape(-1, 64) - blocks) ** 2).sum(axis=1)
    amax = np.abs(blocks).max(axis=1)
    # no worse, block by block, than ggml's own rule (d = amax) or the plain d = amax / 2
    for rule in (amax, amax / 2):
        assert np.all(ours <= _nearest_grid_error(blocks, rule) * (1 + 1e-12))
    # Gaussian data on a 4-level grid: the best uniform grid leaves ~0.35 of the RMS
    rel_rms = np.sqrt(ours.sum() / (blocks ** 2).sum())
    assert rel_rms < 0.4, rel_rms


def test_q2_0_quantizer_zero_block_and_bad_input(rng):
    values = rng.standard_normal((2, 128)).astype(np.float32)
    values[1, 64:] = 0.0
    w = np.frombuffer(quantize_q2_0(values), np.uint8)
    got = dequantize_q2_0_ref(w, (2, 128))
    assert np.all(got[1, 64:] == 0.0) and np.all(np.isfinite(got))
    with pytest.raises(ValueError, match="multiple of 64"):
        quantize_q2_0(values[:, :96])
    values[0, 3] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        quantize_q2_0(values)


def test_activation_rounding_at_and_just_below_half():
    """ggml rounds Q8_0 activation codes with roundf: 0.49999997 -> 0 (floor(x + 0.5) would give 1, the sum
    rounding to 1.0 in float32), exact halves away from zero. With the block's largest value 127, d = 1."""
    below = float(np.nextafter(np.float32(0.5), np.float32(0.0)))
    x = np.zeros((1, 32), np.float32)
    x[0, :7] = [127.0, below, -below, 0.5, -0.5, 1.5, 2.5]
    got = quant.quantize_activations(x, _ggml_type("Q8_0"))
    np.testing.assert_array_equal(got, reference_activations(x, "Q8_0").astype(np.float32))
    np.testing.assert_array_equal(got[0, :7], [127.0, 0.0, 0.0, 1.0, -1.0, 2.0, 3.0])


def test_iq4_xs_integer_dot_without_vnni_matches_float64(rng):
    """The IQ4_XS integer dot's portable loop (CPUs without VNNI; this one may take the vector path in matvec):
    rows against float64 of gguf's weights times the activations their Q8_K codes stand for."""
    for k in (256, 2048):
        w = random_block_bytes(rng, "IQ4_XS", 3, k)
        w64 = reference_weights(w, "IQ4_XS")
        xq, xd, xs16 = quant_int.q8_activations(rng.standard_normal(k).astype(np.float32), 256)
        x64 = xq.astype(np.float64) * np.repeat(xd.astype(np.float64), 256)
        got = np.array([quant_int.idot_iq4_xs_loop(w[r], xq, xd, xs16) for r in range(3)], np.float32)
        assert_product_close(got, w64, x64)
