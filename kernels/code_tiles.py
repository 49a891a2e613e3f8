"""Weight rows decoded to integer codes for the integer matrix products (kernels/simd_gemm.py).

Each type's rows become uint8 codes with a float scale and bias per sub-block (value = scale * code + bias),
interleaved for 16 rows: word (4 codes) number s of row i lands at 32-bit word 16 s + i of the tile. Signed
codes are offset to unsigned ones and the offset goes into the bias (Q8_0: code q + 128, bias -128 d), since
vpdpbusd multiplies unsigned weight bytes with signed activation bytes. Every code is exact: the tile holds
precisely the values ggml's blocks encode, as the float decoders do (tests compare both with gguf's dequantize).

The tile of a prompt chunk's expert is decoded for a handful of tokens, so its decode is a real part of the work:
each row's codes come from vector shifts and masks of its packed bytes (simd_gemm's unpackers, 32-64 codes a
step) into a small staging chunk, and one 16 x 16 word transpose per 64 values interleaves 16 rows at once
(writing the words one by one at their interleaved places, with Numba's indexing, had cost 0.2-0.7 ns per
weight). The scales and biases of a block are computed for the tile's 16 rows at once, one vector per sub-block
with a lane per row, stored whole (simd_gemm.*_tile_scales): a row's scales in one vector stored lane by lane at
the tile's stride had been a quarter to half of the decode (IQ2_XS: 0.052 of 0.106 ns per weight). IQ2_XS codes
come from the 4 KiB grid with signs computed from the code bits (a 512 KiB table of whole groups, one look-up per
8 codes, was 1.3x slower). Q8_0's whole tiles skip the staging chunk (_tile_q8_0_rows). In cache on one AMD EPYC
core, before -> after the whole-tile scales: Q4_K 0.057 -> 0.043 ns per weight, Q6_K 0.079 -> 0.057, Q2_K
0.076 -> 0.047, IQ2_XS 0.104 -> 0.080, Q2_0 0.114 -> 0.090 (Q8_0 0.045-0.040, its own path). One layer's grouped
IQ2_XS gate/up of a 512-token prompt (512 experts x ~10 tokens, from RAM, 2 threads): 129 -> 88 ms.
"""

import numba

from . import quant  # noqa: F401 - first: the format modules import each other through it
from .quant_iq import _IQ2XS_TABLES, IQ2_XS
from .quant_k import Q2_K, Q4_K, Q6_K
from .quant_legacy import Q2_0
from .quant_planes import IQ2_XS_PLANES
from .quant_q8 import Q8_0
from .simd import PLANES_BYTES, prefetch_l2
from .simd_gemm import (ROWS, crumb_codes64, interleave16, iq2_xs_codes256, iq2_xs_codes256_pair,
                        iq2_xs_tile_scales, planes_codes256, planes_tile_scales, q2_0_tile_scales, q2_k_tile_scales,
                        q4_k_tile_scales, q6_codes32, q6_k_tile_scales, q8_0_tile64, q8_0_tile_scales, unpack_codes32)

# Types with a code tile, and their sub-block length (values per scale and bias).
SUB_BLOCK = {Q8_0: 32, Q4_K: 32, Q2_0: 32, Q6_K: 16, Q2_K: 16, IQ2_XS: 16, IQ2_XS_PLANES: 16}
# Types whose codes are their values plus a constant offset (bias = -offset * scale), which the products take off
# the integer sums (int_matmul.TokenCodes); Q4_K's and Q2_K's biases come from their mins.
CODE_OFFSET = {Q8_0: 128, Q2_0: 1, Q6_K: 32, IQ2_XS: 43, IQ2_XS_PLANES: 43}


@numba.njit(nogil=True, cache=True, fastmath=False)
def sub_block(t):
    """Values per scale of type t's code tiles (0: no code tile)."""
    if t == Q8_0 or t == Q4_K or t == Q2_0:
        return 32
    if t == Q6_K or t == Q2_K or t == IQ2_XS or t == IQ2_XS_PLANES:
        return 16
    return 0


# Each type's codes function writes the codes of one row's values v0 .. v0 + len(dst) into dst (contiguous;
# interleave16 reorders them for 16 rows at once); its scales function stores the scales and biases of those
# values' sub-blocks for all 16 rows of the tile at once (simd_gemm.*_tile_scales, one block a call), given the
# matrix's bytes src, row length stride, the tile's first row r0 and the n rows present.


@numba.njit(inline="always", nogil=True)
def _codes_q8_0(src, v0, dst):
    for b in range(v0 // 32, (v0 + dst.shape[0]) // 32):
        unpack_codes32(src, 34 * b + 2, 0, 0xFF, 0x80, dst, 32 * b - v0)


@numba.njit(inline="always", nogil=True)
def _scales_q8_0(src, stride, r0, n, v0, ch, scale, bias):
    for b in range(v0 // 32, (v0 + ch) // 32):
        q8_0_tile_scales(src, r0 * stride + 34 * b, stride, n, scale, bias, ROWS * b)


@numba.njit(inline="always", nogil=True)
def _codes_q4_k(src, v0, dst):
    o = 144 * (v0 // 256)
    for g in range(4):  # 32 bytes: low nibbles are sub-block 2 g, high nibbles 2 g + 1
        unpack_codes32(src, o + 16 + 32 * g, 0, 0xF, 0, dst, 64 * g)
        unpack_codes32(src, o + 16 + 32 * g, 4, 0xF, 0, dst, 64 * g + 32)


@numba.njit(inline="always", nogil=True)
def _scales_q4_k(src, stride, r0, n, v0, ch, scale, bias):
    q4_k_tile_scales(src, r0 * stride + 144 * (v0 // 256), stride, n, scale, bias, ROWS * (v0 // 32))


@numba.njit(inline="always", nogil=True)
def _codes_q6_k(src, v0, dst):
    o = 210 * (v0 // 256)
    for half in range(2):  # value 128 half + 32 q + l: ql nibble, qh bit pair q (dequant_q6_k)
        ql, qh, y = o + 64 * half, o + 128 + 32 * half, 128 * half
        for q in range(4):  # quarter q: the low (q < 2) or high nibbles of ql bytes 32 (q % 2) + l
            q6_codes32(src, ql + 32 * (q % 2), qh, 4 * (q // 2), 2 * q, dst, y + 32 * q)


@numba.njit(inline="always", nogil=True)
def _scales_q6_k(src, stride, r0, n, v0, ch, scale, bias):
    q6_k_tile_scales(src, r0 * stride + 210 * (v0 // 256), stride, n, scale, bias, ROWS * (v0 // 16))


@numba.njit(inline="always", nogil=True)
def _codes_q2_k(src, v0, dst):
    o = 84 * (v0 // 256)
    for half in range(2):  # value 128 half + 32 q + l: bits 2 q of qs byte 32 half + l
        qs, y = o + 16 + 32 * half, 128 * half
        for q in range(4):
            unpack_codes32(src, qs, 2 * q, 3, 0, dst, y + 32 * q)


@numba.njit(inline="always", nogil=True)
def _scales_q2_k(src, stride, r0, n, v0, ch, scale, bias):
    q2_k_tile_scales(src, r0 * stride + 84 * (v0 // 256), stride, n, scale, bias, ROWS * (v0 // 16))


@numba.njit(inline="always", nogil=True)
def _codes_iq2_xs(src, v0, dst):
    iq2_xs_codes256(_IQ2XS_TABLES, src, 74 * (v0 // 256), dst, 0)


@numba.njit(inline="always", nogil=True)
def _pair_codes_iq2_xs(src_a, src_b, v0, dst_a, dst_b):
    """_codes_iq2_xs of two rows at once, one grid look-up for both blocks (simd._level_words)."""
    o = 74 * (v0 // 256)
    iq2_xs_codes256_pair(_IQ2XS_TABLES, src_a, o, dst_a, src_b, o, dst_b)


@numba.njit(inline="always", nogil=True)
def _scales_iq2_xs(src, stride, r0, n, v0, ch, scale, bias):
    iq2_xs_tile_scales(src, r0 * stride + 74 * (v0 // 256), stride, n, scale, bias, ROWS * (v0 // 16))


@numba.njit(inline="always", nogil=True)
def _codes_planes(src, v0, dst):
    planes_codes256(src, PLANES_BYTES * (v0 // 256), dst, 0)


@numba.njit(inline="always", nogil=True)
def _scales_planes(src, stride, r0, n, v0, ch, scale, bias):
    planes_tile_scales(src, r0 * stride + PLANES_BYTES * (v0 // 256), stride, n, scale, bias, ROWS * (v0 // 16))


@numba.njit(inline="always", nogil=True)
def _codes_q2_0(src, v0, dst):
    for b in range(v0 // 64, (v0 + dst.shape[0]) // 64):
        crumb_codes64(src, 18 * b + 2, dst, 64 * b - v0)


@numba.njit(inline="always", nogil=True)
def _scales_q2_0(src, stride, r0, n, v0, ch, scale, bias):
    for b in range(v0 // 64, (v0 + ch) // 64):
        q2_0_tile_scales(src, r0 * stride + 18 * b, stride, n, scale, bias, ROWS * 2 * b)


@numba.njit(inline="always", nogil=True)
def chunk_values(k):
    """Values per chunk of a tile decode (code tiles need k a multiple of 64)."""
    return 256 if k % 256 == 0 else 64


@numba.njit(nogil=True, cache=True, fastmath=False)
def _zero_rows(n, ch, stage):
    """Staged rows n .. 15 of a chunk (past the matrix's end): zero codes, once a tile (the codes functions never
    write them); a call of its own, kept out of the decode loops (_tile_decoder)."""
    for i in range(n, ROWS):
        stage[i * ch:(i + 1) * ch] = 0


# Chunks ahead that a tile decode asks for: at chunk c, every row's bytes of chunk c + 2 (past the tile's end,
# the next tile's). The 16 rows are read as 16 interleaved short streams (272 bytes of each per Q8_0 chunk), which
# the hardware prefetchers follow poorly: one layer's grouped gate/up (512 experts x 10 tokens) decoded from RAM at
# 0.28 ns per weight per thread against 0.09 in cache; asking for the chunks ahead made it 0.15 (Q8_0; Q4_K 0.17
# -> 0.13, IQ2_XS 0.17 -> 0.16), where asking for the whole next tile at once had helped little (1 or 3 chunks:
# within 5%). The requests go to L2 (simd.prefetch_l2): into L1 they stalled the decode's own loads.
PREFETCH_CHUNKS = 2


@numba.njit(inline="always", nogil=True)
def _prefetch_rows(w, r0, off, n):
    """Ask for bytes off .. off + n of rows r0 .. r0 + 15 of w (those that exist)."""
    for i in range(r0, min(r0 + ROWS, w.shape[0])):
        prefetch_l2(w[i], off, n)


@numba.njit(inline="always", nogil=True)
def _prefetch_ahead(w, r0, nxt, n0, c, n_chunks):
    """At chunk c of n_chunks: ask for chunk c + PREFETCH_CHUNKS of rows r0.. of w, or past w's last chunk, the
    chunk of nxt's rows n0.. that many chunks on (a chunk of a row is whole blocks: 64 or 256 values)."""
    ahead = c + PREFETCH_CHUNKS
    if ahead < n_chunks:
        cb = w.shape[1] // n_chunks
        _prefetch_rows(w, r0, ahead * cb, cb)
    else:
        cb = nxt.shape[1] // n_chunks
        _prefetch_rows(nxt, n0, (ahead - n_chunks) * cb, cb)


def _row_codes(codes, pair_codes):
    """The codes of rows r0 .. r0 + n - 1 of a chunk into stage: codes a row at a time, or with pair_codes two."""
    if pair_codes is None:
        @numba.njit(inline="always", nogil=True)
        def rows(w, r0, n, v0, ch, stage):
            for i in range(n):
                codes(w[r0 + i], v0, stage[i * ch:(i + 1) * ch])
        return rows

    @numba.njit(inline="always", nogil=True)
    def row_pairs(w, r0, n, v0, ch, stage):
        for i in range(0, n - 1, 2):
            pair_codes(w[r0 + i], w[r0 + i + 1], v0, stage[i * ch:(i + 1) * ch], stage[(i + 1) * ch:(i + 2) * ch])
        if n % 2:
            codes(w[r0 + n - 1], v0, stage[(n - 1) * ch:n * ch])
    return row_pairs


def _tile_decoder(codes, scales, block_values=0, pair_codes=None):
    """The chunk loop of decode_tile for one type's codes and scales functions: one loop nest per type, since a
    branch on the type inside it (six decoders inlined in one loop) made the decode ~3x slower. block_values:
    the type's block length where it is 256 (every row length a multiple: the chunk is a compile-time constant,
    and the staging offsets and transposes with it), else 0. In cache on one core, alternating builds, ns per
    weight: Q4_K 0.047-0.051 -> 0.043-0.044, Q6_K 0.067-0.070 -> 0.059-0.061, Q2_K 0.054-0.055 -> 0.046-0.048,
    IQ2_XS 0.090 -> 0.080. A whole tile (16 rows present) takes the loop with 16 rows a compile-time constant, a
    tile past the matrix's end its own copy with zeroed rows: one loop for both, its row count a variable and the
    zeroing inlined, ran every whole tile slower (same measure: IQ2_XS 0.077-0.081 -> 0.065-0.067, Q2_0
    0.068-0.072 -> 0.057-0.059, Q6_K 0.055-0.058 -> 0.051-0.053; Q8_0, Q4_K, Q2_K within 3%). pair_codes: where
    given, the codes of two rows' chunks at once (IQ2_XS: one grid look-up for both blocks, 0.065 -> 0.061 ns a
    weight in the same measure)."""

    row_codes = _row_codes(codes, pair_codes)

    @numba.njit(inline="always", nogil=True)
    def chunks(w, r0, n, words, scale, bias, stage, nxt, n0):
        k = words.shape[0] // ROWS
        ch = block_values if block_values else chunk_values(k)
        n_chunks = k // ch
        src, stride = w.reshape(-1), w.shape[1]
        for c in range(n_chunks):
            v0 = c * ch
            _prefetch_ahead(w, r0, nxt, n0, c, n_chunks)
            row_codes(w, r0, n, v0, ch, stage)
            scales(src, stride, r0, n, v0, ch, scale, bias)
            interleave16(stage, ch, words, 4 * v0)

    @numba.njit(inline="always", nogil=True)
    def decode(w, r0, words, scale, bias, stage, nxt, n0):
        n = min(ROWS, w.shape[0] - r0)
        if n == ROWS:
            chunks(w, r0, ROWS, words, scale, bias, stage, nxt, n0)
        else:
            k = words.shape[0] // ROWS
            _zero_rows(n, block_values if block_values else chunk_values(k), stage)
            chunks(w, r0, n, words, scale, bias, stage, nxt, n0)
    return decode


_tile_q8_0, _tile_q4_k, _tile_q6_k, _tile_q2_k, _tile_q2_0 = (
    _tile_decoder(codes, scales, block_values)
    for codes, scales, block_values in (
        (_codes_q8_0, _scales_q8_0, 0), (_codes_q4_k, _scales_q4_k, 256), (_codes_q6_k, _scales_q6_k, 256),
        (_codes_q2_k, _scales_q2_k, 256), (_codes_q2_0, _scales_q2_0, 0)))
_tile_iq2_xs = _tile_decoder(_codes_iq2_xs, _scales_iq2_xs, 256, _pair_codes_iq2_xs)
_tile_planes = _tile_decoder(_codes_planes, _scales_planes, 256)


@numba.njit(inline="always", nogil=True)
def _tile_q8_0_rows(w, r0, words, scale, bias, stage, nxt, n0):
    """Q8_0's tile of 16 whole rows without staging (simd_gemm.q8_0_tile64: 64 values of 16 rows a step); a
    tile past the matrix's end takes the generic decode. In cache on one core: 0.085 -> 0.050 ns per weight."""
    if w.shape[0] - r0 < ROWS:
        _tile_q8_0(w, r0, words, scale, bias, stage, nxt, n0)
        return
    k = words.shape[0] // ROWS
    ch = chunk_values(k)
    n_chunks = k // ch
    src, stride = w.reshape(-1), w.shape[1]
    for c in range(n_chunks):
        _prefetch_ahead(w, r0, nxt, n0, c, n_chunks)
        for v0 in range(c * ch, (c + 1) * ch, 64):
            q8_0_tile64(src, r0 * stride + 34 * (v0 // 32), stride, words, 4 * v0, scale, bias, ROWS * (v0 // 32))


@numba.njit(nogil=True, cache=True, fastmath=False)
def decode_tile(t, w, r0, words, scale, bias, stage, nxt, n0):
    """Rows r0 .. r0 + 15 of w (uint8 [rows, row bytes], type t) into a code tile: words uint8 [16 k] (codes
    interleaved), scale and bias float32 [k / sub_block(t) * 16]; stage: uint8 scratch [16 * chunk_values(k)].
    Rows past the end of w get zero codes, scales and biases. A chunk of every row is decoded into stage, then
    interleaved into the tile, so both stay in the first-level cache. Rows n0 .. n0 + 15 of nxt (uint8 [rows,
    row bytes], with as many chunks per row as w: the tile decoded next) are requested from RAM meanwhile."""
    if t == Q4_K:
        _tile_q4_k(w, r0, words, scale, bias, stage, nxt, n0)
    elif t == Q8_0:
        _tile_q8_0_rows(w, r0, words, scale, bias, stage, nxt, n0)
    elif t == Q6_K:
        _tile_q6_k(w, r0, words, scale, bias, stage, nxt, n0)
    elif t == Q2_K:
        _tile_q2_k(w, r0, words, scale, bias, stage, nxt, n0)
    elif t == IQ2_XS:
        _tile_iq2_xs(w, r0, words, scale, bias, stage, nxt, n0)
    elif t == IQ2_XS_PLANES:
        _tile_planes(w, r0, words, scale, bias, stage, nxt, n0)
    elif t == Q2_0:
        _tile_q2_0(w, r0, words, scale, bias, stage, nxt, n0)
