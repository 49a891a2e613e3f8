"""Matrix products of ggml weights with int8 activations on the integer codes (prompts, quantized activations).

With ``quantized_activations`` the activations are rounded to int8 blocks as ggml rounds them, and the
product of a weight block with them is an integer sum times float scales. For a prompt chunk, each tile of
16 weight rows is decoded once to codes (kernels/code_tiles.py) and multiplied with every token by
vpdpbusd blocks (kernels/simd_gemm.py): 64 multiply-adds per instruction, where float32 tiles into BLAS do 16.
The results are the same sums as the float path's up to float32 rounding (the integer parts are exact).

Activations go in as ``TokenCodes``: per token the int8 codes, and per sub-block of the weight type the
activation block's scale and that scale times the sub-block's code sum (the bias term's factor).
"""

from __future__ import annotations

from typing import NamedTuple

import numba
import numpy as np

from .code_tiles import CODE_OFFSET, SUB_BLOCK, chunk_values, decode_tile, sub_block
from .quant_int import quantize_q8_sums
from .simd_gemm import (HAS_VNNI, ROWS, codes_1x16, codes_1x32, codes_2x16, codes_2x32, codes_3x16, codes_3x32,
                        codes_4x16, codes_4x32, codes_5x16, codes_5x32, codes_6x16, codes_6x32, codes_7x16, codes_7x32,
                        codes_8x16, codes_8x32)
from .task_queue import next_task, task_counter

__all__ = ["HAS_VNNI", "TokenCodes", "matmul_codes", "quantize_tokens", "tile_buffers", "use_codes"]


def use_codes(t: int, k: int) -> bool:
    """Whether products of type t rows of length k with several tokens' int8 activations take the code tiles:
    where the CPU has VNNI (without it the portable form is slower than float tiles) and k is a multiple of 64."""
    return HAS_VNNI and t in SUB_BLOCK and k % 64 == 0


class TokenCodes(NamedTuple):
    """Tokens' activations rounded for one weight type: q int8 [n, k]; d float32; s the sub-blocks' code sums.
    Sub-blocks of 32 (Q8_0, Q4_K, Q2_0): d [n, k / 32] the activation scale of each sub-block. Sub-blocks of 16
    (Q6_K, Q2_K, IQ2_XS): d [n, k / 256] the scale of each Q8_K block, so the products multiply by a block's scale
    once (simd_gemm.codes_block). s [n, k / sb]: for types whose codes are offset (code_tiles.CODE_OFFSET: bias =
    -offset * scale) int32 -offset times the sub-block's code sum, which the products start their integer sums
    from (no bias term); for the others (Q4_K, Q2_K: biases from their mins) float32, the code sum times the
    sub-block's activation scale (sub-blocks of 32) or the code sum itself (16)."""
    q: np.ndarray
    d: np.ndarray
    s: np.ndarray


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _quantize_tokens(x, act_block, sb, offset, xq, xd, xs):
    n, k = x.shape
    for p in numba.prange(n):
        d_act = np.empty(k // act_block, np.float32)
        xs16 = np.empty(k // 16, np.int32)
        quantize_q8_sums(x[p], act_block, xq[p], d_act, xs16)
        for j in range(k // sb):
            s = np.int32(0)
            for h in range(sb // 16):
                s += xs16[j * sb // 16 + h]
            d = d_act[j * sb // act_block]
            if sb == 32:
                xd[p, j] = d
            if offset:
                xs[p, j] = -offset * s
            elif sb == 16:
                xs[p, j] = np.float32(s)
            else:
                xs[p, j] = d * np.float32(s)
        if sb == 16:
            xd[p, :] = d_act


def quantize_tokens(x: np.ndarray, t: int, act_block: int) -> TokenCodes:
    """x float32 [n, k] rounded to int8 blocks of act_block (ggml's Q8_0 or Q8_K rounding) for type t."""
    sb, offset = SUB_BLOCK[t], CODE_OFFSET.get(t, 0)
    n, k = x.shape
    q = np.empty((n, k), np.int8)
    d = np.empty((n, k // (act_block if sb == 16 else sb)), np.float32)
    s = np.empty((n, k // sb), np.int32 if offset else np.float32)
    _quantize_tokens(np.ascontiguousarray(x, np.float32), act_block, sb, offset, q, d, s)
    return TokenCodes(q, d, s)


@numba.njit(inline="always", nogil=True)
def _block(nt, sb, codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out):
    """The block of nt tokens (1 to 8) for sub-blocks of sb values."""
    if sb == 32:
        if nt == 8:
            codes_8x32(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
        elif nt == 7:
            codes_7x32(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
        elif nt == 6:
            codes_6x32(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
        elif nt == 5:
            codes_5x32(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
        elif nt == 4:
            codes_4x32(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
        elif nt == 3:
            codes_3x32(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
        elif nt == 2:
            codes_2x32(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
        else:
            codes_1x32(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
    elif nt == 8:
        codes_8x16(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
    elif nt == 7:
        codes_7x16(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
    elif nt == 6:
        codes_6x16(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
    elif nt == 5:
        codes_5x16(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
    elif nt == 4:
        codes_4x16(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
    elif nt == 3:
        codes_3x16(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
    elif nt == 2:
        codes_2x16(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)
    else:
        codes_1x16(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out)


@numba.njit(inline="always", nogil=True)
def tile_set(t, k, tiles):
    """Buffers of `tiles` code tiles for type t rows of length k: codes, scales and biases (a row of each per tile)
    and one staging chunk for their decodes."""
    sb = sub_block(t)
    return (np.empty((tiles, k * ROWS), np.uint8), np.empty((tiles, k // sb * ROWS), np.float32),
            np.empty((tiles, k // sb * ROWS), np.float32), np.empty(ROWS * chunk_values(k), np.uint8))


@numba.njit(inline="always", nogil=True)
def tile_buffers(t, k):
    """A code tile's buffers for type t rows of length k: codes, scales, biases and the decode's staging chunk."""
    words, scale, bias, stage = tile_set(t, k, 1)
    return words[0], scale[0], bias[0], stage


@numba.njit(inline="always", nogil=True)
def _token_blocks(n):
    """The fewest blocks of at most 8 tokens that n tokens take."""
    return (n + 7) // 8


@numba.njit(inline="always", nogil=True)
def _block_tokens(left, blocks):
    """Tokens of the next block when `left` tokens remain for `blocks` blocks: near-equal sizes."""
    return (left + blocks - 1) // blocks


@numba.njit(inline="always", nogil=True)
def tile_times_tokens(sb, words, scale, bias, xq, xd, xs, p0, p1, out, r0, buf, shift):
    """out[p + shift, r0:r0 + 16] = the tile's rows times tokens p of (xq, xd, xs) for p0 <= p < p1 (columns
    past out's end are dropped); buf: float32 scratch [8 * 16]. The tokens go in the fewest blocks of at most 8,
    of near-equal size (13 tokens: 7 + 6, not 8 + 4 + 1: a block streams the whole tile once, and its epilogue
    per sub-block costs the same for few tokens as for 8; 1.1-1.6x faster for odd counts, in cache)."""
    k = xq.shape[1]
    n_sub, n_ab = xs.shape[1], xd.shape[1]
    xqf, xdf, xsf = xq.reshape(-1), xd.reshape(-1), xs.reshape(-1)
    nr = min(ROWS, out.shape[1] - r0)
    p = p0
    blocks = _token_blocks(p1 - p0)
    while p < p1:
        nt = _block_tokens(p1 - p, blocks)
        blocks -= 1
        _block(nt, sb, words, scale, bias, n_sub, xqf, p * k, k, xdf, p * n_ab, n_ab, xsf, p * n_sub, n_sub, buf)
        for j in range(nt):
            for i in range(nr):
                out[p + j + shift, r0 + i] = buf[ROWS * j + i]
        p += nt


# Tiles of 16 rows a task of a prompt's product decodes and then takes through each block of tokens in turn, at most:
# a block's activations (8 tokens x k int8 codes: 16 KiB at k = 2048) are read from the first-level cache by every
# tile after the first, where a task per tile read every token block from the outer caches again for each tile
# (the whole prompt's codes: 1 MiB at 512 x 2048). Weights times 512 tokens, a task per tile -> per 4 tiles,
# alternating in one process (G multiply-adds a second, 1 / 2 threads): IQ2_XS 12288 x 2048 129 -> 143 / 261 ->
# 282, 2048 x 4096 153 -> 162 / 292 -> 311; Q4_K 4096 x 2048 1.05x; Q6_K 1.12x.
TILES_PER_TASK = 4


def tiles_per_task(n_tiles: int, threads: int) -> int:
    """Tiles per task of a product of n_tiles tiles on `threads` threads: up to TILES_PER_TASK while every thread
    still gets four tasks or more (small matrices: one tile a task, so all threads take part)."""
    return max(1, min(TILES_PER_TASK, n_tiles // (4 * threads)))


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _matmul_codes(t, w, xq, xd, xs, out, per_task, workers):
    """out = tokens (xq, xd, xs) times W.T: a task per per_task tiles of 16 rows, each tile decoded once, then
    every block of up to 8 tokens (tile_times_tokens' near-equal blocks) through the task's tiles in turn; the
    tasks go to `workers` workers from a counter (task_queue)."""
    sb = sub_block(t)
    n, k = xq.shape
    n_tiles = (w.shape[0] + ROWS - 1) // ROWS
    n_tasks = (n_tiles + per_task - 1) // per_task
    counter = task_counter()
    for worker in numba.prange(workers):
        words, scale, bias, stage = tile_set(t, k, per_task)
        buf = np.empty(8 * ROWS, np.float32)
        task = next_task(counter)
        while task < n_tasks:
            first = task * per_task
            count = min(per_task, n_tiles - first)
            for j in range(count):
                r0 = ROWS * (first + j)
                decode_tile(t, w, r0, words[j], scale[j], bias[j], stage, w, r0 + ROWS)
            blocks = _token_blocks(n)
            p = 0
            while p < n:
                nt = _block_tokens(n - p, blocks)
                blocks -= 1
                for j in range(count):
                    tile_times_tokens(sb, words[j], scale[j], bias[j], xq, xd, xs, p, p + nt, out, ROWS * (first + j),
                                      buf, 0)
                p += nt
            task = next_task(counter)


def matmul_codes(w: np.ndarray, t: int, x: TokenCodes, per_task: int | None = None) -> np.ndarray:
    """out [n, rows] = tokens x (quantize_tokens for type t) times W.T, W uint8 [rows, row bytes] of type t;
    per_task: tiles per task (default: tiles_per_task for this many rows and Numba's threads)."""
    out = np.empty((x.q.shape[0], w.shape[0]), np.float32)
    threads = numba.get_num_threads()
    if per_task is None:
        per_task = tiles_per_task((w.shape[0] + ROWS - 1) // ROWS, threads)
    _matmul_codes(int(t), w, x.q, x.d, x.s, out, per_task, threads)
    return out
