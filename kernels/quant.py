"""Quantized matrix products computed straight from ggml blocks.

Every ggml format registers its block size here and has one Numba function, ``dequant_row(src, dst)``,
that decodes one row of blocks (``src``: the row's bytes, ``dst``: its float32 values);
quant_dispatch joins those functions in cached kernels: a parallel matrix-vector product (decode) and a
tiled matrix-matrix path (prefill: a tile of rows is decoded into a small float32 buffer and
multiplied with BLAS), so no call ever dequantizes a whole matrix.

``act_quant=True`` rounds the activations the way ggml does before its integer dot products
(per 32 values to Q8_0, or per 256 values to Q8_K for the k-quant and i-quant families):
the numerics of ggml's quantized-activation path, so results can be compared with it. Products with a
few tokens or more then run on the weights' integer codes where the CPU has AVX-512 VNNI (int_matmul).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


# Rows decoded per tile in matmul: big enough for BLAS to be efficient, small enough that
# the float32 tile (rows x k) stays in cache-sized territory.
_MATMUL_TILE_ROWS = 128
# Up to this many tokens, matmul decodes each row once and dots it with every token (quant_dispatch.matmul_rows)
# instead of decoding tiles for BLAS: measured 2-4x faster for 1-10 tokens, even at 16, slower from 32.
FEW_TOKENS_MAX = 16
# Matrices up to this size are multiplied by a vector on the calling thread: starting a parallel region (~3 us
# while the workers still spin, ~0.1 ms once they sleep) costs more than the product (e.g. a DeltaNet layer's
# beta/alpha rows, a shared-expert gate).
_SERIAL_MATVEC_BYTES = 256 << 10


@dataclass(frozen=True)
class QuantFormat:
    ggml_type: int
    name: str
    block_elems: int
    block_bytes: int
    act_block: int  # activation block for act_quant (32 = Q8_0, 256 = Q8_K, 0 = float activations)
    in_files: bool = True  # False: a layout the engine makes at load (quant_planes), never read from a file


_FORMATS: dict[int, QuantFormat] = {}


def register_type(ggml_type: int, name: str, block_elems: int, block_bytes: int, act_block: int,
                  in_files: bool = True) -> None:
    """Make a ggml format available to dequantize/matvec/matmul (its row decoder needs a branch in
    quant_dispatch.dequant_row)."""
    if ggml_type in _FORMATS:
        raise ValueError(f"ggml type {ggml_type} ({name}) is registered twice")
    _FORMATS[ggml_type] = QuantFormat(ggml_type, name, block_elems, block_bytes, act_block, in_files)


def _format(ggml_type: int) -> QuantFormat:
    fmt = _FORMATS.get(int(ggml_type))
    if fmt is None:
        known = ", ".join(f.name for f in sorted(_FORMATS.values(), key=lambda f: f.ggml_type))
        raise NotImplementedError(f"ggml tensor type {ggml_type} has no kernel; supported: {known}")
    return fmt


def supported_types() -> list[int]:
    """The ggml types a file's tensors may have (the engine's own load-time layouts left out)."""
    return sorted(t for t, f in _FORMATS.items() if f.in_files)


def block_size(ggml_type: int) -> tuple[int, int]:
    """(weights per block, bytes per block) of a ggml type."""
    fmt = _format(ggml_type)
    return fmt.block_elems, fmt.block_bytes


def activation_block(ggml_type: int) -> int:
    """Values per activation block that ggml rounds for this type's dot (32: Q8_0, 256: Q8_K, 0: float)."""
    return _format(ggml_type).act_block


def row_bytes(ggml_type: int, row_len: int) -> int:
    fmt = _format(ggml_type)
    if row_len % fmt.block_elems:
        raise ValueError(f"{fmt.name} rows must hold a multiple of {fmt.block_elems} values, got {row_len}")
    return row_len // fmt.block_elems * fmt.block_bytes


def _check_weights(w: np.ndarray, fmt: QuantFormat, k: int) -> None:
    if w.dtype != np.uint8 or w.ndim != 2:
        raise ValueError(f"{fmt.name} weights must be a 2-D uint8 array of row bytes, got {w.dtype} {w.shape}")
    if k % fmt.block_elems:
        raise ValueError(f"{fmt.name} rows must hold a multiple of {fmt.block_elems} values, got {k}")
    if w.shape[1] != k // fmt.block_elems * fmt.block_bytes:
        raise ValueError(f"{fmt.name} weights have {w.shape[1]} bytes per row; {k} inputs need "
                         f"{k // fmt.block_elems * fmt.block_bytes}")
    if w.strides[1] != 1:
        raise ValueError("weight rows must be contiguous")


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Decode a whole tensor to float32 (for tests, small tensors and load-time conversion)."""
    fmt = _format(ggml_type)
    shape = tuple(int(s) for s in shape)
    k = shape[-1]
    n_rows = math.prod(shape[:-1])
    w = np.ascontiguousarray(data).reshape(-1).view(np.uint8).reshape(n_rows, -1)
    _check_weights(w, fmt, k)
    out = np.empty((n_rows, k), np.float32)
    # A decoded token's embedding row on the calling thread: waking the workers would cost more than the row.
    activations.by_size(out.size, quant_dispatch.dequant_rows_serial, quant_dispatch.dequant_rows)(fmt.ggml_type,
                                                                                                 w, out)
    return out.reshape(shape)


def quantize_activations(x: np.ndarray, ggml_type: int) -> np.ndarray:
    """Round float32 activations as ggml does for this weight type's dot product."""
    fmt = _format(ggml_type)
    if fmt.act_block == 0:
        return x
    if x.shape[-1] % fmt.act_block:
        raise ValueError(f"activation length {x.shape[-1]} is not a multiple of {fmt.act_block}")
    rows = np.ascontiguousarray(x, np.float32).reshape(-1, x.shape[-1])
    out = np.empty_like(rows)
    quant_int.round_q8_rows(rows, fmt.act_block, out)
    return out.reshape(x.shape)


def matvec(w: np.ndarray, ggml_type: int, x: np.ndarray, act_quant: bool = False) -> np.ndarray:
    """y = W @ x for W given as rows of ggml blocks."""
    fmt = _format(ggml_type)
    if x.ndim != 1:
        raise ValueError(f"matvec takes a 1-D activation vector, got shape {x.shape}")
    _check_weights(w, fmt, x.shape[0])
    return _matvec(w, fmt.ggml_type, fmt.act_block, np.ascontiguousarray(x, np.float32), act_quant)


def _matvec(w: np.ndarray, t: int, act_block: int, x: np.ndarray, act_quant: bool) -> np.ndarray:
    """matvec once w and x (contiguous float32) are checked."""
    out = np.empty(w.shape[0], np.float32)
    serial = w.nbytes <= _SERIAL_MATVEC_BYTES
    if act_quant and quant_dispatch.has_int_dot(t):
        # ggml's numerics at integer speed: int8 activations times the weight codes.
        if serial:
            quant_dispatch.matvec_int_serial(t, w, x, act_block, out)
        else:
            quant_dispatch.matvec_int(t, w, x, act_block, out, 0)  # 0: Numba's thread count
        return out
    if act_quant:
        x = quantize_activations(x, t)
    if serial:
        quant_dispatch.matvec_serial(t, w, x, out)
    else:
        quant_dispatch.matvec(t, w, x, out, 0)
    return out


def _read_only(w: np.ndarray) -> np.ndarray:
    if not w.flags.writeable:
        return w
    v = w.view()
    v.flags.writeable = False
    return v


class MatvecsCall:
    """matvecs for one list of matrices, checked and grouped once: ``call(x)`` -> [W @ x for each W], the results
    of matvec. A decoded token's Python runs with cold caches (each layer streams megabytes of weights through
    them), where checking, grouping and splitting on every call had cost ~30 us a call (Device.linears keeps one
    per list of matrices).

    The matrices of one type go into one parallel region (quant_dispatch.matvecs_int / matvecs) where there are
    several and they are not all small: a DeltaNet layer's input projections, an attention layer's q, k and v."""

    def __init__(self, weights: list[tuple[np.ndarray, int]], length: int, act_quant: bool = False):
        groups: dict[tuple, list[int]] = {}
        for i, (w, t) in enumerate(weights):
            _check_weights(w, _format(t), length)
            # One compiled tuple type per group: Numba types an array by its layout too.
            groups.setdefault((t, w.dtype, w.ndim, w.flags.c_contiguous), []).append(i)
        self.length, self._n, self._act_quant = length, len(weights), bool(act_quant)
        self._alone: list[tuple[int, np.ndarray, int, int]] = []  # (output, matrix, type, act_block), one by one
        self._stacked: list[tuple[int, int, tuple, list[tuple[int, int, int]], int]] = []
        for (t, *_), idx in groups.items():
            block = _format(t).act_block
            if len(idx) == 1 or sum(weights[i][0].nbytes for i in idx) <= _SERIAL_MATVEC_BYTES:
                self._alone += [(i, weights[i][0], t, block) for i in idx]
                continue
            ws = tuple(_read_only(weights[i][0]) for i in idx)  # and by its writability (copied weights or mapped)
            ends = np.cumsum([w.shape[0] for w in ws]).tolist()
            parts = [(i, end - w.shape[0], end) for i, w, end in zip(idx, ws, ends)]
            self._stacked.append((t, block, ws, parts, ends[-1]))

    def __call__(self, x: np.ndarray) -> list[np.ndarray]:
        if x.shape != (self.length,):
            raise ValueError(f"matvecs takes a 1-D activation vector of {self.length} values, got shape {x.shape}")
        x = np.ascontiguousarray(x, np.float32)
        outs: list[np.ndarray] = [None] * self._n  # type: ignore[list-item]
        for i, w, t, block in self._alone:
            outs[i] = _matvec(w, t, block, x, self._act_quant)
        for t, block, ws, parts, rows in self._stacked:
            out = np.empty(rows, np.float32)
            if self._act_quant and quant_dispatch.has_int_dot(t):
                quant_dispatch.matvecs_int(t, ws, x, block, out, 0)
            else:
                quant_dispatch.matvecs(t, ws, quantize_activations(x, t) if self._act_quant else x, out, 0)
            for i, first, end in parts:
                outs[i] = out[first:end]
        return outs


def matvecs(weights: list[tuple[np.ndarray, int]], x: np.ndarray, act_quant: bool = False) -> list[np.ndarray]:
    """[matvec(w, t, x, act_quant) for w, t in weights], the same results, with the matrices of one type in one
    parallel region (MatvecsCall; a caller multiplying the same matrices again keeps one of those instead)."""
    if x.ndim != 1:
        raise ValueError(f"matvecs takes a 1-D activation vector, got shape {x.shape}")
    return MatvecsCall(weights, x.shape[0], act_quant)(x)


def matmul(w: np.ndarray, ggml_type: int, x: np.ndarray, act_quant: bool = False,
           codes: dict | None = None) -> np.ndarray:
    """Y = X @ W.T for X [n, k] float32 and W given as rows of ggml blocks; returns [n, rows]. codes: where given,
    X's int8 codes per weight type, reused from and added to it (matmuls)."""
    fmt = _format(ggml_type)
    if x.ndim != 2:
        raise ValueError(f"matmul takes a 2-D activation matrix [n, k], got shape {x.shape}")
    n, k = x.shape
    _check_weights(w, fmt, k)
    x = np.ascontiguousarray(x, np.float32)
    from . import int_matmul  # here: it imports the format modules, which import this one

    if act_quant and n > 1 and int_matmul.use_codes(fmt.ggml_type, k):
        # ggml's numerics on the integer codes: 1.2x the float tiles' speed at 2 tokens, 2-4.6x at 4-16, 1.6-2x
        # at 512 (bench/README.md)
        xq = None if codes is None else codes.get(fmt.ggml_type)
        if xq is None:
            xq = int_matmul.quantize_tokens(x, fmt.ggml_type, fmt.act_block)
            if codes is not None:
                codes[fmt.ggml_type] = xq
        return int_matmul.matmul_codes(w, fmt.ggml_type, xq)
    if act_quant:
        x = quantize_activations(x, ggml_type)
    n_rows = w.shape[0]
    out = np.empty((n, n_rows), np.float32)
    if n <= FEW_TOKENS_MAX:
        quant_dispatch.matmul_rows(fmt.ggml_type, w, x, out)
        return out

    def tiles(part: int, parts: int) -> None:
        # every parts-th tile, decoded on this thread and multiplied by single-threaded BLAS (tile_threads)
        tile = np.empty((min(_MATMUL_TILE_ROWS, n_rows), k), np.float32)
        for r0 in range(part * _MATMUL_TILE_ROWS, n_rows, parts * _MATMUL_TILE_ROWS):
            r1 = min(n_rows, r0 + _MATMUL_TILE_ROWS)
            t = tile[: r1 - r0]
            quant_dispatch.dequant_rows_serial(fmt.ggml_type, w[r0:r1], t)
            np.matmul(x, t.T, out=out[:, r0:r1])

    tile_threads.run_parts(tiles)
    return out


def matmuls(weights: list[tuple[np.ndarray, int]], x: np.ndarray, act_quant: bool = False) -> list[np.ndarray]:
    """[matmul(w, t, x, act_quant) for w, t in weights], the same results, with x rounded to int8 codes once per
    weight type rather than once per matrix (a DeltaNet layer's q/k/v and gate projections, an attention layer's
    q, k and v, an expert's gate and up all take one input)."""
    codes: dict = {}
    return [matmul(w, t, x, act_quant, codes) for w, t in weights]


# The format families register themselves on import; quant_dispatch imports them all.
from . import activations, quant_dispatch, quant_int, tile_threads  # noqa: E402
