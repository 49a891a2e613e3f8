"""k-quant (Q2_K ... Q6_K) kernels against references that are not ours.

Decoding must be bit-identical to gguf.quants.dequantize (itself bit-exact with ggml); matvec/matmul
are checked against float64 products of gguf's dequantized weights, and act_quant=True against the
same product with activations rounded by reference.q8_k_activations_ref (ggml's quantize_row_q8_K_ref).

Blocks are random bytes (every byte pattern of the code and scale fields is a valid block) with
random finite fp16 super-scales.  Inputs are fresh each run; the seed is printed for reproduction.
"""

import gguf
import numpy as np
import pytest

from strata_async.kernels import quant, quant_int
from strata_async.kernels.reference import q8_k_activations_ref

QK_K = 256
# ggml type -> byte offsets of its fp16 super-scales (d, and dmin where the format has one) in a block
SUPER_SCALE_OFFSETS = {
    10: (80, 82),   # Q2_K
    11: (108,),     # Q3_K
    12: (0, 2),     # Q4_K
    13: (0, 2),     # Q5_K
    14: (208,),     # Q6_K
}
K_TYPES = sorted(SUPER_SCALE_OFFSETS)

# Tolerances relative to sum_i |w_i| |x_i| per output.  matvec accumulates float32 products in
# float64 and rounds once to float32 (error ~ 2^-24 of the result); matmul multiplies float32 tiles
# with BLAS, whose float32 sums of k <= 2048 terms stay far below the worst case k * 2^-24.
MATVEC_TOL = 1e-6
MATMUL_TOL = 1e-5
# rows not a multiple of 64 (matvec chunking) nor of 128 (matmul tiles) and across tile edges
SHAPES = [(37, 256), (70, 512), (131, 2048)]
BATCHES = [1, 2, 3, 4, 5, 6, 7, 33]


def random_blocks(rng: np.random.Generator, ggml_type: int, rows: int, k: int) -> np.ndarray:
    """uint8 [rows, row_bytes]: random code/scale bytes, fp16 super-scales of either sign, 2^-12 .. 2^-2."""
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
    n_blocks = k // block_elems
    raw = rng.integers(0, 256, size=(rows, n_blocks, block_bytes), dtype=np.uint8)
    for off in SUPER_SCALE_OFFSETS[ggml_type]:
        mag = np.exp2(rng.uniform(-12, -2, size=(rows, n_blocks)))
        scale = (mag * rng.choice([-1.0, 1.0], size=(rows, n_blocks))).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, n_blocks, 2)
    return raw.reshape(rows, n_blocks * block_bytes)


def gguf_weights(raw: np.ndarray, ggml_type: int) -> np.ndarray:
    """The reference decode, in float64."""
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).astype(np.float64)


def random_activations(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    # per-256 block magnitudes spread over two decades so Q8_K scales differ between blocks
    x = rng.standard_normal(shape)
    blocks = x.reshape(-1, QK_K) * np.exp2(rng.uniform(-3, 3, size=(x.size // QK_K, 1)))
    return blocks.reshape(shape).astype(np.float32)


def assert_product_close(got: np.ndarray, w: np.ndarray, x: np.ndarray, tol: float) -> None:
    """got ~ x @ w.T (or w @ x for a vector x) in float64, per output within tol * sum |w||x|."""
    ref = x @ w.T
    bound = tol * (np.abs(x) @ np.abs(w).T)
    err = np.abs(got.astype(np.float64) - ref)
    assert got.shape == ref.shape
    assert np.all(err <= bound), f"max error / bound: {np.max(err / bound):.3g}"


@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_block_sizes_match_gguf(ggml_type):
    assert quant.block_size(ggml_type) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]


@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_dequantize_is_bit_exact_with_gguf(rng, ggml_type):
    raw = random_blocks(rng, ggml_type, 2 * 3, 4 * QK_K)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type))
    ours = quant.dequantize(raw, ggml_type, (2, 3, 4 * QK_K))
    assert ours.dtype == np.float32 and ours.shape == (2, 3, 4 * QK_K)
    np.testing.assert_array_equal(ours.reshape(ref.shape), ref)


@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_matvec_and_matmul_match_float64(rng, ggml_type):
    for rows, k in SHAPES:
        raw = random_blocks(rng, ggml_type, rows, k)
        w = gguf_weights(raw, ggml_type)
        x = random_activations(rng, (k,))
        assert_product_close(quant.matvec(raw, ggml_type, x), w, x.astype(np.float64), MATVEC_TOL)
        for n in BATCHES:
            xs = random_activations(rng, (n, k))
            assert_product_close(quant.matmul(raw, ggml_type, xs), w, xs.astype(np.float64), MATMUL_TOL)


def test_q8_k_activation_rounding_matches_reference(rng):
    x = random_activations(rng, (5 * QK_K,))
    x[QK_K:2 * QK_K] = 0.0  # an all-zero block has no scale and must stay zero
    x[3 * QK_K + 17] = -40.0  # a negative extreme sets the block's (signed) scale
    x[4 * QK_K + 5], x[4 * QK_K + 9] = 30.0, -30.0  # equal magnitudes: the first one's sign sets the scale
    ref = q8_k_activations_ref(x)
    for ggml_type in K_TYPES:
        np.testing.assert_array_equal(quant.quantize_activations(x, ggml_type), ref.astype(np.float32))


@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_act_quant_products_match_float64(rng, ggml_type):
    for rows, k in SHAPES:
        raw = random_blocks(rng, ggml_type, rows, k)
        w = gguf_weights(raw, ggml_type)
        x = random_activations(rng, (k,))
        got = quant.matvec(raw, ggml_type, x, act_quant=True)
        assert_product_close(got, w, q8_k_activations_ref(x), MATVEC_TOL)
        for n in BATCHES:
            xs = random_activations(rng, (n, k))
            got = quant.matmul(raw, ggml_type, xs, act_quant=True)
            assert_product_close(got, w, q8_k_activations_ref(xs), MATMUL_TOL)


@pytest.mark.parametrize("act_quant", [False, True])
def test_matvecs_match_float64(rng, act_quant):
    """Several matrices on one input (matvecs): the Q4_K ones, one of them read-only, in one parallel region over
    their rows stacked (more than the serial size, claims crossing from one matrix into the next), a lone Q6_K one
    through matvec; each against float64."""
    k = 2048
    mats = [(random_blocks(rng, 12, rows, k), 12) for rows in (300, 37, 129)]
    frozen = random_blocks(rng, 12, 70, k)
    frozen.flags.writeable = False
    mats += [(frozen, 12), (random_blocks(rng, 14, 131, k), 14)]
    x = random_activations(rng, (k,))
    xr = q8_k_activations_ref(x) if act_quant else x.astype(np.float64)
    outs = quant.matvecs(mats, x, act_quant)
    assert len(outs) == len(mats)
    for (raw, t), got in zip(mats, outs):
        assert_product_close(got, gguf_weights(raw, t), xr, MATVEC_TOL)


@pytest.mark.parametrize("act_quant", [False, True])
def test_device_linears_keep_their_calls(rng, act_quant):
    """HostDevice.linears in decode keeps one checked MatvecsCall per list of matrices: each call gives what matvec does
    for each matrix, to the bit; an input of another length is refused; lists made anew on every call (an expert's
    matrices) do not grow what it keeps without end."""
    from strata_async.runtime import device as device_module
    from strata_async.runtime.device import HostDevice
    from strata_async.runtime.weights import QTensor
    k = 512
    mats = [QTensor(f"m{i}", t, (rows, k), random_blocks(rng, t, rows, k))
            for i, (t, rows) in enumerate(((12, 300), (12, 200), (14, 64)))]
    dev = HostDevice(threads=2, quantized_activations=act_quant)
    for _ in range(3):
        x = random_activations(rng, (1, k))
        outs = dev.linears(x, tuple(mats))
        for m, got in zip(mats, outs):
            np.testing.assert_array_equal(got[0], quant.matvec(m.data, m.ggml_type, x[0], act_quant))
    assert len(dev._matvecs_calls) == 1
    with pytest.raises(ValueError):
        dev.linears(random_activations(rng, (1, k + 256)), tuple(mats))
    for _ in range(device_module._MATVECS_CALLS + 5):
        dev.linears(x, (QTensor("e", 12, (16, k), mats[0].data[:16]),))
    assert len(dev._matvecs_calls) <= device_module._MATVECS_CALLS


@pytest.mark.parametrize("ggml_type,loop", [(11, "idot_q3_k_loop"), (13, "idot_q5_k_loop")])
def test_integer_dot_loops_match_float64(rng, ggml_type, loop):
    """The Q3_K and Q5_K integer dots' portable loops (CPUs without AVX-512BW or GFNI; this one may take the vector
    path in matvec): rows against float64 of gguf's weights times the activations their Q8_K codes stand for."""
    for k in (256, 2048):
        raw = random_blocks(rng, ggml_type, 3, k)
        w = gguf_weights(raw, ggml_type)
        xq, xd, xs16 = quant_int.q8_activations(random_activations(rng, (k,)), QK_K)
        x64 = xq.astype(np.float64) * np.repeat(xd.astype(np.float64), QK_K)
        for r in range(3):
            got = getattr(quant_int, loop)(raw[r], xq, xd, xs16)
            assert_product_close(np.array([got]), w[r:r + 1], x64, MATVEC_TOL)


@pytest.mark.parametrize("ggml_type", K_TYPES)
def test_embedding_rows_match_gguf(rng, ggml_type):
    """QTensor.take_rows, a decoded token's one row (its own path) and a prompt's rows, against gguf's decoding."""
    from strata_async.runtime.weights import QTensor
    raw = random_blocks(rng, ggml_type, 9, 2 * QK_K)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type)).reshape(9, 2 * QK_K)
    table = QTensor("token_embd.weight", ggml_type, (9, 2 * QK_K), raw)
    for row in (0, 4, 8):
        np.testing.assert_array_equal(table.take_rows(np.array([row])), ref[[row]])
    np.testing.assert_array_equal(table.take_rows(np.array([8, 0, 8, 3])), ref[[8, 0, 8, 3]])
    with pytest.raises(IndexError):
        table.take_rows(np.array([9]))
