"""F16 and BF16 rows (ggml's unquantized storage types) times float32 vectors, against float64 of numpy's
decodes: IEEE half by np.float16, bf16 as the high 16 bits of a float32.

Tolerance: the row dots add float32 products in float32 lanes, error <= ~k * 2^-24 * S with S = sum |w| |x|;
tested at 1e-6 * S. One value's wrong decode moves an output by ~S / k >= 5e-4 * S at k <= 2048.
"""

import gguf
import numpy as np
import pytest

from strata_async.kernels import quant

Q = gguf.GGMLQuantizationType


def _rows(rng: np.random.Generator, t: Q, rows: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """[rows, 2 k] uint8 row bytes and their float64 values: random normal values of mixed magnitudes (and a
    few fp16 subnormals), rounded to the type."""
    values = rng.standard_normal((rows, k)) * 10.0 ** rng.uniform(-6, 2, (rows, k))
    if t == Q.F16:
        h = values.astype(np.float16)
        return h.view(np.uint8).reshape(rows, -1), h.astype(np.float64)
    bits = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16
    return bits.view(np.uint8).reshape(rows, -1), (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("t", [Q.F16, Q.BF16], ids=["F16", "BF16"])
@pytest.mark.parametrize("rows,k", [(1, 1), (3, 63), (5, 64), (67, 130), (131, 2048), (9, 2048 + 37)])
@pytest.mark.parametrize("act_quant", [False, True])
def test_half_rows_matvec_against_float64(rng, t, rows, k, act_quant):
    w, w64 = _rows(rng, t, rows, k)
    x = rng.standard_normal(k).astype(np.float32)
    got = quant.matvec(w, int(t), x, act_quant=act_quant)  # no activation rounding for float rows (act_block 0)
    want = w64 @ x.astype(np.float64)
    scale = np.abs(w64) @ np.abs(x.astype(np.float64))
    assert got.dtype == np.float32 and got.shape == (rows,)
    assert np.all(np.abs(got - want) <= 1e-6 * scale + 1e-30)
