"""Full-attention kernels of Qwen3-Next / Qwen3-MoE: rotary position embedding and causal
softmax attention of one sequence over its KV cache (grouped-query heads).

attend() works on blocks: one work item takes the query heads that share a kv head together with
a few consecutive positions, so each key and value row is read once for the whole group, and
scores a block of keys with one small matrix product. The softmax is the streaming (online) form:
a running maximum per row, exp of scores minus that maximum in float32, sums in float64. When
there are too few work items to fill the threads (decode), the keys are also split into ranges
whose partial softmax results are merged at the end.
"""

from __future__ import annotations

import functools
import math

import numba
import numpy as np

from .activations import ELEMENTWISE_MATH, by_size, exp_nonpositive
from .checks import require_array, require_positive
from .small_matmul import FASTMATH, matmul_nn_at, matmul_nt

_ROWS_PER_ITEM = 32  # query rows (positions x heads of one group) per work item: accumulators stay in L1
_KEY_BLOCK = 64  # keys scored per matrix product
_MIN_KEYS_PER_SPLIT = 4 * _KEY_BLOCK  # below this a key range is not worth a thread


@numba.njit(nogil=True, cache=True, fastmath=ELEMENTWISE_MATH, error_model="numpy")
def _exp_shifted(row, n, m):
    """row[j] = exp(row[j] - m) for j < n (m: at least every row[j]), returning their sum in float64: a block's
    probabilities before normalization. Compiled on its own, with the flags under which exp_nonpositive runs in
    vector lanes; inside _attend (reassociating flags) the exp was libm's, a call per score (512 tokens, 16 query
    heads: 2.1 M a layer)."""
    for j in range(n):
        row[j] = exp_nonpositive(row[j] - m)
    total = 0.0
    for j in range(n):
        total += row[j]
    return total


@numba.njit(nogil=True, cache=True, parallel=True, fastmath=FASTMATH)
def _attend(q, k_cache, v_cache, start_pos, scale, q_block, n_splits, span, out, part_acc, part_m, part_l):
    n, hq, d = q.shape
    hkv = k_cache.shape[1]
    dv = v_cache.shape[2]
    group = hq // hkv
    n_qblocks = (n + q_block - 1) // q_block
    max_rows = q_block * group
    # Row r of a work item is query position i0 + r // group of head kvh * group + r % group.
    for item in numba.prange(hkv * n_qblocks * n_splits):
        split = item % n_splits
        qb = (item // n_splits) % n_qblocks
        kvh = item // (n_splits * n_qblocks)
        i0 = qb * q_block
        i1 = min(n, i0 + q_block)
        rows = (i1 - i0) * group
        qrows = np.empty((max_rows, d), np.float32)
        for r in range(rows):
            for x in range(d):
                qrows[r, x] = q[i0 + r // group, kvh * group + r % group, x] * scale
        row_max = np.full(max_rows, -np.inf, np.float32)
        row_sum = np.zeros(max_rows, np.float64)
        acc = np.zeros((max_rows, dv), np.float32)
        kblock = np.empty((_KEY_BLOCK, d), np.float32)
        scores = np.empty((max_rows, _KEY_BLOCK), np.float32)  # then probabilities
        k_lo = split * span
        k_hi = min(k_lo + span, start_pos + i1)  # the last query of the item sees keys < start_pos + i1
        for kb in range(k_lo, k_hi, _KEY_BLOCK):
            cnt = min(_KEY_BLOCK, k_hi - kb)
            for j in range(cnt):
                for x in range(d):
                    kblock[j, x] = k_cache[kb + j, kvh, x]
            matmul_nt(qrows, kblock, scores, rows, cnt, d, False)
            for r in range(rows):
                visible = min(cnt, start_pos + i0 + r // group + 1 - kb)  # causal: keys <= own position
                if visible <= 0:
                    for j in range(cnt):
                        scores[r, j] = 0.0
                    continue
                block_max = scores[r, 0]
                for j in range(1, visible):
                    block_max = max(block_max, scores[r, j])
                new_max = max(row_max[r], block_max)
                if new_max > row_max[r]:
                    rescale = np.float32(np.exp(row_max[r] - new_max))  # 0 on the first block
                    row_sum[r] *= rescale
                    for x in range(dv):
                        acc[r, x] *= rescale
                    row_max[r] = new_max
                row_sum[r] += _exp_shifted(scores[r], visible, new_max)
                for j in range(visible, cnt):
                    scores[r, j] = 0.0
            # acc += the probabilities times the block's value rows, read in place from the cache, in 4 x 64 register
            # blocks (a loop updating acc's rows key by key had loaded and stored them once per key: 512 tokens,
            # 16 query heads of 256, 2 threads, 28.6-37.8 -> 16.1-21.0 ms; one decoded token at 512 keys 124 ->
            # 102-109 us). The scores stay dot products: with 256-long rows their horizontal sums cost little, and
            # as outer products over transposed keys they were slower (44 ms).
            matmul_nn_at(scores, 0, _KEY_BLOCK, v_cache, (kb * hkv + kvh) * dv, hkv * dv, acc, 0, dv, rows, dv, cnt,
                         True)
        if n_splits == 1:
            for r in range(rows):
                inv = np.float32(1.0 / row_sum[r])
                for x in range(dv):
                    out[i0 + r // group, kvh * group + r % group, x] = acc[r, x] * inv
        else:
            for r in range(rows):
                part_m[item, r] = row_max[r]
                part_l[item, r] = row_sum[r]
                for x in range(dv):
                    part_acc[item, r, x] = acc[r, x]
    if n_splits > 1:
        # Merge the key ranges: rescale each partial to the overall maximum. A range that held no
        # key of a row left (-inf, 0, 0), which contributes nothing.
        for base in numba.prange(hkv * n_qblocks):
            qb = base % n_qblocks
            kvh = base // n_qblocks
            i0 = qb * q_block
            rows = (min(n, i0 + q_block) - i0) * group
            for r in range(rows):
                m = part_m[base * n_splits, r]
                for s in range(1, n_splits):
                    m = max(m, part_m[base * n_splits + s, r])
                total = 0.0
                for s in range(n_splits):
                    total += part_l[base * n_splits + s, r] * np.exp(np.float64(part_m[base * n_splits + s, r] - m))
                o = out[i0 + r // group, kvh * group + r % group]
                for x in range(dv):
                    o[x] = 0.0
                for s in range(n_splits):
                    w = np.float32(np.exp(np.float64(part_m[base * n_splits + s, r] - m)) / total)
                    for x in range(dv):
                        o[x] += w * part_acc[base * n_splits + s, r, x]


def attend(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, start_pos: int,
           scale: float | None = None, key_splits: int | None = None) -> np.ndarray:
    """Causal attention of n new queries over a KV cache that already holds their keys/values.

    q [n, hq, d] float32 (positions start_pos .. start_pos+n-1, rotary already applied);
    k_cache [T, hkv, d] and v_cache [T, hkv, dv] float32 with T >= start_pos + n (rows past that
    are ignored, so a preallocated cache can be passed whole). Query i attends cache rows
    0 .. start_pos+i; query head h uses kv head h // (hq // hkv) (HF's repeat_kv). scale defaults
    to d ** -0.5. key_splits fixes into how many ranges the keys are split for parallelism
    (default: chosen from the thread count). Returns [n, hq, dv] float32.
    """
    require_array("q", q, (None, None, None))
    n, hq, d = q.shape
    require_positive("query count", n)
    require_array("k_cache", k_cache, (None, None, d))
    hkv = k_cache.shape[1]
    require_array("v_cache", v_cache, (k_cache.shape[0], hkv, None))
    require_positive("kv heads", hkv)
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if start_pos < 0 or start_pos + n > k_cache.shape[0]:
        raise ValueError(f"the cache holds {k_cache.shape[0]} positions but queries need positions "
                         f"0..{start_pos + n - 1}; write the new keys/values into the cache first")
    group = hq // hkv
    q_block = max(1, _ROWS_PER_ITEM // group)
    n_keys = start_pos + n
    items = hkv * math.ceil(n / q_block)
    if key_splits is None:
        # At most one range where the keys are few (decode's short contexts): no thread count to ask for, which
        # costs ~50 us from Python with the caches cold after a token's weights streamed through them.
        most = math.ceil(n_keys / _MIN_KEYS_PER_SPLIT)
        key_splits = 1 if most <= 1 else min(math.ceil(numba.get_num_threads() / items), most)
    require_positive("key_splits", key_splits)
    span = math.ceil(math.ceil(n_keys / key_splits) / _KEY_BLOCK) * _KEY_BLOCK
    key_splits = math.ceil(n_keys / span)
    out = np.empty((n, hq, v_cache.shape[2]), np.float32)
    parts = items * key_splits if key_splits > 1 else 0
    rows = q_block * group
    part_acc = np.empty((parts, rows, v_cache.shape[2]), np.float32)
    part_m = np.empty((parts, rows), np.float32)
    part_l = np.empty((parts, rows), np.float64)
    _attend(q, k_cache, v_cache, int(start_pos), np.float32(d ** -0.5 if scale is None else scale),
            q_block, key_splits, span, out, part_acc, part_m, part_l)
    return out


@numba.njit(inline="always", nogil=True)
def _rope_token(x, position, inv_freq, out):
    """One token's heads x [h, d] rotated to out: the angles' cosines and sines once, then each head's halves as
    contiguous runs (a loop over the heads innermost had strided every access)."""
    h, d = x.shape
    half = inv_freq.shape[0]
    c = np.empty(half, np.float32)
    s = np.empty(half, np.float32)
    for i in range(half):
        angle = np.float64(position) * inv_freq[i]
        c[i] = np.float32(np.cos(angle))
        s[i] = np.float32(np.sin(angle))
    for head in range(h):
        xh, oh = x[head], out[head]
        for i in range(half):
            x1 = xh[i]
            x2 = xh[i + half]
            oh[i] = x1 * c[i] - x2 * s[i]
            oh[i + half] = x2 * c[i] + x1 * s[i]
        for i in range(2 * half, d):
            oh[i] = xh[i]


# A serial and a parallel loop over the tokens (the same bits; the parallel one for prompt chunks).
@numba.njit(nogil=True, cache=True, fastmath=False)
def _rope_neox(x, positions, inv_freq, out):
    for t in range(x.shape[0]):
        _rope_token(x[t], positions[t], inv_freq, out[t])


@numba.njit(nogil=True, cache=True, fastmath=False, parallel=True)
def _rope_neox_parallel(x, positions, inv_freq, out):
    for t in numba.prange(x.shape[0]):
        _rope_token(x[t], positions[t], inv_freq, out[t])


@functools.lru_cache(maxsize=16)
def _inv_freq(theta: float, rot_dim: int) -> np.ndarray:
    """theta ** (-2i / rot_dim) for i < rot_dim / 2 in float64, made once per model, not per call (a decoded
    token's attention layer spent ~40 us remaking it with the caches cold). Only the kernels read it."""
    return theta ** (-np.arange(rot_dim // 2, dtype=np.float64) * 2.0 / rot_dim)


def rope(x: np.ndarray, positions: np.ndarray, theta: float, rot_dim: int, style: str = "neox") -> np.ndarray:
    """Rotary position embedding of x [n, h, d] float32 at integer positions [n].

    NEOX style (llama.cpp's LLAMA_ROPE_TYPE_NEOX, HF's rotate_half): dims i and i + rot_dim/2 of
    the first rot_dim dims rotate by position * theta ** (-2i / rot_dim); dims past rot_dim (partial
    rotary) pass unchanged. Angles are computed in float64. Returns a new float32 array.
    """
    if style != "neox":
        raise ValueError(f"rope style {style!r} is not implemented; the supported style is 'neox'")
    require_array("x", x, (None, None, None))
    n, _, d = x.shape
    if not isinstance(positions, np.ndarray) or positions.shape != (n,) or positions.dtype.kind not in "iu":
        raise ValueError(f"positions must be an integer numpy array of shape [{n}]")
    if rot_dim % 2 or not 0 < rot_dim <= d:
        raise ValueError(f"rot_dim must be even and in 2..{d} (the head size), got {rot_dim}")
    inv_freq = _inv_freq(float(theta), int(rot_dim))
    out = np.empty_like(x)
    by_size(x.size, _rope_neox, _rope_neox_parallel)(x, positions.astype(np.int64), inv_freq, out)
    return out


def attend_selected(q: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, allowed: np.ndarray,
                    scale: float | None = None) -> np.ndarray:
    """Attention of n queries over only the cache rows each is allowed (sparse attention, e.g. QSA).

    q [n, hq, d]; k_cache [T, hkv, d], v_cache [T, hkv, dv]; allowed [n, L] bool with L <= T: query i sees
    row j iff allowed[i, j] (every query must see at least one row). Query head h uses kv head
    h // (hq // hkv). Softmax in float32 after subtracting the row maximum. Returns [n, hq, dv] float32.
    """
    require_array("q", q, (None, None, None))
    n, hq, d = q.shape
    require_array("k_cache", k_cache, (None, None, d))
    hkv = k_cache.shape[1]
    require_array("v_cache", v_cache, (k_cache.shape[0], hkv, None))
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if allowed.dtype != np.bool_ or allowed.ndim != 2 or allowed.shape[0] != n or allowed.shape[1] > len(k_cache):
        raise ValueError(f"allowed must be bool [{n}, <= {len(k_cache)}], got {allowed.dtype} {allowed.shape}")
    if not allowed.any(axis=1).all():
        raise ValueError("every query must be allowed at least one cache row")
    scale = np.float32(d ** -0.5 if scale is None else scale)
    qg = q.reshape(n, hkv, hq // hkv, d)
    if n == 1:  # decode: touch only the selected rows
        rows = np.flatnonzero(allowed[0])
        k, v = k_cache[rows], v_cache[rows]
        s = np.einsum("nkgd,lkd->nkgl", qg, k) * scale
    else:
        length = allowed.shape[1]
        k, v = k_cache[:length], v_cache[:length]
        s = np.einsum("nkgd,lkd->nkgl", qg, k) * scale
        s = np.where(allowed[:, None, None, :], s, np.float32(-np.inf))
    s = np.exp(s - s.max(axis=-1, keepdims=True))
    s /= s.sum(axis=-1, keepdims=True)
    out = np.einsum("nkgl,lkd->nkgd", s, v)
    return np.ascontiguousarray(out.reshape(n, hq, v_cache.shape[2]), dtype=np.float32)
