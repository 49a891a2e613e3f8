"""The integer matrix products on codes (kernels/int_matmul.py, code_tiles.py, simd_gemm.py) against float64
products of weights decoded by gguf.quants (Q2_0: kernels/reference.py's float64 decoder, written from the
format description) and activations rounded by ggml's rules (gguf.quants' Q8_0, reference.q8_k_activations_ref).

Weights are random bytes with random finite fp16 scales (every code and scale pattern is a valid block), so
every code value, sign pattern and sub-block scale occurs. Row counts cross the 16-row tiles and token counts
every 8/4/2/1 split. Tolerance relative to S = sum |w| |x| per output: the integer parts are exact, the float
part is two float32 multiply-adds per sub-block (error ~k / 16 * 2^-24 * S at worst), far under 1e-6 * S; a
wrong code moves an output by ~S / k, a wrong activation level by ~1e-5 S at k = 2048.
"""

import gguf
import numba
import numpy as np
import pytest

from strata_async.kernels import quant
from strata_async.kernels.code_tiles import SUB_BLOCK, chunk_values, decode_tile
from strata_async.kernels.int_matmul import matmul_codes, quantize_tokens
from strata_async.kernels.quant_legacy import Q2_0
from strata_async.kernels.reference import dequantize_q2_0_ref, q8_k_activations_ref
from strata_async.kernels.simd_gemm import HAS_VNNI, ROWS, codes_block

Q = gguf.GGMLQuantizationType
TYPES = [int(Q.Q8_0), int(Q.Q4_K), int(Q.Q6_K), int(Q.Q2_K), int(Q.IQ2_XS), Q2_0]
# byte offsets of each block's fp16 scales
SCALE_OFFSETS = {int(Q.Q8_0): (0,), int(Q.Q4_K): (0, 2), int(Q.Q6_K): (208,), int(Q.Q2_K): (80, 82),
                 int(Q.IQ2_XS): (0,), Q2_0: (0,)}
REL_TOL = 1e-6


def block_size(t: int) -> tuple[int, int]:
    return (64, 18) if t == Q2_0 else gguf.GGML_QUANT_SIZES[Q(t)]


def random_rows(rng: np.random.Generator, t: int, rows: int, k: int) -> np.ndarray:
    elems, nbytes = block_size(t)
    raw = rng.integers(0, 256, size=(rows, k // elems, nbytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[t]:
        scale = (rng.choice([-1, 1], raw.shape[:2]) * 2.0 ** rng.uniform(-12, -2, raw.shape[:2])).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def weights64(w: np.ndarray, t: int) -> np.ndarray:
    if t == Q2_0:
        return dequantize_q2_0_ref(w, (w.shape[0], w.shape[1] // 18 * 64))
    return gguf.quants.dequantize(w, Q(t)).astype(np.float64)


def activations64(x: np.ndarray, t: int) -> np.ndarray:
    if quant.activation_block(t) == 256:
        return q8_k_activations_ref(x)
    return gguf.quants.dequantize(gguf.quants.quantize(x, Q.Q8_0), Q.Q8_0).astype(np.float64)


def random_activations(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    # per-32 magnitudes over two decades, so activation scales differ between blocks and sub-blocks
    x = rng.standard_normal((n, k // 32, 32)) * np.exp2(rng.uniform(-3, 3, (n, k // 32, 1)))
    return x.reshape(n, k).astype(np.float32)


@pytest.mark.parametrize("t", TYPES)
def test_code_tiles_hold_the_exact_weights(rng, t):
    """scale * code + bias of every tile entry equals gguf's decoded weight (rows past the end: zeros)."""
    rows, k = 21, 512 + (64 if t in (int(Q.Q8_0), Q2_0) else 0)  # 64-value chunks too
    w = random_rows(rng, t, rows, k)
    ref = weights64(w, t)
    sb = SUB_BLOCK[t]
    for r0 in (0, ROWS):
        words = np.empty(k * ROWS, np.uint8)
        scale = np.empty(k // sb * ROWS, np.float32)
        bias = np.empty(k // sb * ROWS, np.float32)
        decode_tile(t, w, r0, words, scale, bias, np.empty(ROWS * chunk_values(k), np.uint8), w, r0 + ROWS)
        codes = words.reshape(k // 4, ROWS, 4).transpose(1, 0, 2).reshape(ROWS, k).astype(np.float64)
        s = np.repeat(scale.reshape(k // sb, ROWS).T, sb, axis=1).astype(np.float64)
        b = np.repeat(bias.reshape(k // sb, ROWS).T, sb, axis=1).astype(np.float64)
        n = min(ROWS, rows - r0)
        np.testing.assert_allclose(s[:n] * codes[:n] + b[:n], ref[r0:r0 + n], rtol=1e-6, atol=0)
        assert not (s[n:].any() or b[n:].any() or codes[n:].any())


@pytest.mark.parametrize("t", TYPES)
@pytest.mark.parametrize("rows,k", [(16, 256), (37, 512), (70, 2048)])
def test_matmul_codes_matches_float64(rng, t, rows, k):
    w = random_rows(rng, t, rows, k)
    w64 = weights64(w, t)
    for n in (1, 2, 3, 4, 5, 7, 8, 12, 15, 29):  # every block size 1..8 (12 = 6 + 6)
        x = random_activations(rng, n, k)
        got = matmul_codes(w, t, quantize_tokens(x, t, quant.activation_block(t)))
        x64 = activations64(x, t)
        want = x64 @ w64.T
        err = np.abs(got.astype(np.float64) - want)
        bound = REL_TOL * (np.abs(x64) @ np.abs(w64).T)
        assert got.shape == (n, rows) and got.dtype == np.float32
        assert np.all(err <= bound), f"n={n}: max error / S = {np.max(err / bound) * REL_TOL:.3g}"


@pytest.mark.parametrize("per_task", [2, 4])
def test_matmul_codes_tiles_per_task(rng, per_task):
    """Tasks of several tiles (the last one short: 5 tiles) give the products of a task per tile, bit for bit."""
    t, rows, k = TYPES[0], 70, 512
    w = random_rows(rng, t, rows, k)
    for n in (1, 9, 29):
        x = quantize_tokens(random_activations(rng, n, k), t, quant.activation_block(t))
        np.testing.assert_array_equal(matmul_codes(w, t, x, per_task), matmul_codes(w, t, x, 1))


@pytest.mark.parametrize("sb", [16, 32])
@pytest.mark.parametrize("offset", [0, 43])
def test_portable_block_matches_vnni_block(rng, sb, offset):
    """The block without VNNI (widening multiplies and adds, for CPUs without it) against the float64 product, as
    the VNNI block where the CPU has it. Activations as TokenCodes holds them: for sub-blocks of 16 a scale per
    256 values, for sub-blocks of 32 a scale per sub-block; offset 0 (codes with a free bias): float sums, the
    sub-blocks' code sums (16) or the scale times the code sum (32); offset > 0 (bias = -offset * scale): int32
    -offset times the code sums, and the block must not read the bias."""
    k, nt = 512, 4
    codes = rng.integers(0, 256, ROWS * k, dtype=np.uint8)  # every byte value, including codes above 127
    scale = rng.standard_normal(k // sb * ROWS).astype(np.float32)
    bias = rng.standard_normal(k // sb * ROWS).astype(np.float32)
    xq = rng.integers(-128, 128, nt * k, dtype=np.int8)
    act = 256 if sb == 16 else sb
    xd = rng.uniform(0.01, 1.0, nt * (k // act)).astype(np.float32)
    sums = xq.reshape(nt, k // sb, sb).sum(axis=2).reshape(-1)
    if offset:
        bias = (-offset * scale.astype(np.float64)).astype(np.float32)
        xs = (-offset * sums).astype(np.int32)
    else:
        xs = sums.astype(np.float32) if sb == 16 else (xd * sums).astype(np.float32)
    c = codes.reshape(k // 4, ROWS, 4).transpose(1, 0, 2).reshape(ROWS, k).astype(np.float64)
    w64 = (np.repeat(scale.reshape(k // sb, ROWS).T, sb, axis=1) * c
           + np.repeat(bias.reshape(k // sb, ROWS).T, sb, axis=1))
    x64 = np.repeat(xd.reshape(nt, k // act), act, axis=1) * xq.reshape(nt, k)
    want = x64 @ w64.T
    for vnni in [False] + ([True] if HAS_VNNI else []):
        block = codes_block(nt, sb, vnni)

        @numba.njit
        def run(codes, scale, bias, xq, xd, xs, out):
            block(codes, scale, bias, k // sb, xq, 0, k, xd, 0, k // act, xs, 0, k // sb, out)
        out = np.zeros(nt * ROWS, np.float32)
        run(codes, scale, np.full_like(bias, np.nan) if offset else bias, xq, xd, xs, out)
        assert np.all(np.abs(out.reshape(nt, ROWS) - want) <= REL_TOL * (np.abs(x64) @ np.abs(w64).T)), vnni


def test_matmuls_round_the_input_once_per_type_with_the_same_results(rng):
    # a layer's projections on one input: two Q4_K matrices (one rounding shared), a Q8_0 one (its own rounding)
    # and F32 rows (no codes): each result bit for bit what matmul gives alone
    k, n = 512, 9
    x = random_activations(rng, n, k)
    f32 = rng.standard_normal((24, k)).astype(np.float32).view(np.uint8)
    weights = [(random_rows(rng, Q.Q4_K, 48, k), Q.Q4_K), (random_rows(rng, Q.Q8_0, 32, k), Q.Q8_0),
               (random_rows(rng, Q.Q4_K, 16, k), Q.Q4_K), (f32, Q.F32)]
    for act_quant in (True, False):
        got = quant.matmuls(weights, x, act_quant)
        for (w, t), y in zip(weights, got):
            np.testing.assert_array_equal(y, quant.matmul(w, t, x, act_quant))
    one = quant.matmuls(weights[:1], x[:1], True)[0]  # one token: matmul's own path
    np.testing.assert_array_equal(one, quant.matmul(weights[0][0], Q.Q4_K, x[:1], True))
