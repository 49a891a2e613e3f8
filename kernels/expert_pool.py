"""The expert pool: every expert one token selected, computed in one parallel call (decode).

For one token x and its experts ids[j] with routing weights w[j]:

    out = sum_j w[j] * down[ids[j]] @ (silu(gate[ids[j]] @ x) * (up[ids[j]] @ x))

straight from the experts' ggml rows in the memory-mapped file (no copy, nothing repacked). Two
parallel phases in one compiled call: (expert, block of rows) tasks compute gate and up together and
the SwiGLU product, with w[j] folded in (down is linear); then (expert, block of down rows) tasks, so each
thread reads whole experts' rows in order (one stream each, as the prefetchers like it, rather than ten
interleaved), and the calling thread sums the experts' outputs. Calling matvec per projection instead
costs 3 parallel regions and Python dispatch per expert (30 per layer at top-10), which dominated decode
on small models.
The shared expert is the same call with one expert and its sigmoid gate as the weight.
"""

from __future__ import annotations

import numba
import numpy as np

from .activations import swiglu_block
from .grouped_codes import down_codes, gate_up_codes
from .int_matmul import TokenCodes, quantize_tokens, use_codes
from .quant import _check_weights, _format, activation_block, quantize_activations
from .quant_dispatch import (INT_DOT_TYPES, ROW_TASK, _FASTMATH, dequant_row, float_dots, float_ready, has_fused_dot,
                             has_int_dot, int_dots, int_ready)
from .quant_dot import block_sums32
from .quant_int import q8_activations, quantize_q8_sums
from .small_matmul import matmul_nt_regs
from .task_queue import claimed_runs, expert_unit, task_counter


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _add_experts(y, out):
    """out[r] += sum over j of y[j, r], in expert order (on the calling thread). The sum runs expert by expert
    along whole rows of y into a zeroed row, vector adds with each r's order unchanged: with the experts' loop
    inside the loop over r it strided through y (10 x 2048 from the cache: 9.5 -> 2.4 us, the same bits)."""
    acc = np.zeros(out.shape[0], np.float32)
    for j in range(y.shape[0]):
        for r in range(out.shape[0]):
            acc[r] += y[j, r]
    for r in range(out.shape[0]):
        out[r] += acc[r]


@numba.njit(nogil=True, cache=True, fastmath=False)
def _add_scaled_rows(out, rows, y, scale):
    for i in range(rows.shape[0]):
        o = out[rows[i]]
        s = scale[i]
        for c in range(o.shape[0]):
            o[c] += s * y[i, c]


def add_scaled_rows(out: np.ndarray, rows: np.ndarray, y: np.ndarray, scale: np.ndarray) -> None:
    """out[rows[i]] += scale[i] * y[i] for each i in order (rows may repeat): how prefill adds each expert's
    outputs into its tokens' rows, one pass instead of numpy's gather, multiply and scatter."""
    if out.dtype != np.float32 or y.dtype != np.float32 or out.ndim != 2 or y.ndim != 2 or y.shape[1] != out.shape[1]:
        raise ValueError(f"add_scaled_rows needs float32 out [n, d] and y [m, d]; got {out.dtype} {out.shape}, "
                         f"{y.dtype} {y.shape}")
    rows = np.asarray(rows, np.int64)
    if rows.shape != (y.shape[0],) or np.shape(scale) != (y.shape[0],):
        raise ValueError(f"add_scaled_rows needs one row index and one scale per row of y ({y.shape[0]}); got "
                         f"{rows.shape} and {np.shape(scale)}")
    if rows.size and (rows.min() < 0 or rows.max() >= out.shape[0]):
        raise ValueError(f"add_scaled_rows: row indices must lie in [0, {out.shape[0]})")
    _add_scaled_rows(out, rows, np.ascontiguousarray(y), np.ascontiguousarray(scale, np.float32))


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def gate_up_float(tg, gate, tu, up, r0, r1, xg, xu, xsum32, scratch, h, u, weight):
    """h[r] = weight * silu(gate row r . x) * (up row r . x) for r0 <= r < r1 of one expert (float dots; x as
    xg = float_ready(tg, x) and xu = float_ready(tu, x); u: the task's scratch for its up products, scratch: a
    row to decode into where a type has no fused dot). The weight goes in here: down is linear."""
    float_dots(tg, gate, r0, r1, xg, xsum32, scratch, h, r0)
    float_dots(tu, up, r0, r1, xu, xsum32, scratch, u, 0)
    for r in range(r0, r1):
        g = h[r]
        h[r] = g / (np.float32(1.0) + np.exp(-g)) * u[r - r0] * weight


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def gate_up_int(tg, gate, tu, up, r0, r1, xg, xu, xd, xs, h, u):
    """h[r] = silu(gate row r . x) * (up row r . x) for r0 <= r < r1 of one expert, x given as ggml's int8
    blocks (integer dots; codes xg = int_ready(tg, ...), xu = int_ready(tu, ...)); the weight comes after down,
    whose activations are these outputs rounded again."""
    int_dots(tg, gate, r0, r1, xg, xd, xs, h, r0)
    int_dots(tu, up, r0, r1, xu, xd, xs, u, 0)
    for r in range(r0, r1):
        g = h[r]
        h[r] = g / (np.float32(1.0) + np.exp(-g)) * u[r - r0]


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def down_int(td, down, r0, r1, hq, hd, hs, y, weight):
    """y[r] = weight * (down row r . h) for r0 <= r < r1, h given as int8 blocks."""
    int_dots(td, down, r0, r1, hq, hd, hs, y, r0)
    for r in range(r0, r1):
        y[r] *= weight


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
def _swiglu_experts(tg, gate, tu, up, td, down, x, ids, weights, out, workers):
    k = ids.shape[0]
    ffn = gate.shape[1]
    hidden = down.shape[1]
    xsum32 = np.empty(max(1, x.shape[0] // 32), np.float32)
    if x.shape[0] % 32 == 0:
        block_sums32(x, xsum32)
    h = np.empty((k, ffn), np.float32)
    per_expert = (ffn + ROW_TASK - 1) // ROW_TASK
    u = np.empty((k * per_expert, ROW_TASK), np.float32)  # each task's up products
    fused = has_fused_dot(tg) and has_fused_dot(tu)
    xg, xu = float_ready(tg, x), float_ready(tu, x)
    counter = task_counter()
    for worker in numba.prange(workers):  # runs of tasks from a counter (task_queue)
        for first, end in claimed_runs(counter, k * per_expert, workers, expert_unit(per_expert, k, workers)):
            for task in range(first, end):
                j, r0, r1 = _task_rows(task, per_expert, ffn)
                scratch = xsum32 if fused else np.empty(x.shape[0], np.float32)  # a row to decode into where not fused
                gate_up_float(tg, gate[ids[j]], tu, up[ids[j]], r0, r1, xg, xu, xsum32, scratch, h[j], u[task],
                              weights[j])
    hsum32 = np.empty((k, max(1, ffn // 32)), np.float32)
    if ffn % 32 == 0:
        for j in range(k):
            block_sums32(h[j], hsum32[j])
    per_expert = (hidden + ROW_TASK - 1) // ROW_TASK
    y = np.empty((k, hidden), np.float32)
    fused = has_fused_dot(td)
    hr = float_ready(td, h.reshape(-1)).reshape(k, ffn)  # planes order by blocks: each row's the same
    counter = task_counter()
    for worker in numba.prange(workers):  # runs of tasks from a counter (task_queue)
        for first, end in claimed_runs(counter, k * per_expert, workers, expert_unit(per_expert, k, workers)):
            for task in range(first, end):
                j, r0, r1 = _task_rows(task, per_expert, hidden)
                scratch = hsum32[j] if fused else np.empty(ffn, np.float32)
                float_dots(td, down[ids[j]], r0, r1, hr[j], hsum32[j], scratch, y[j], r0)
    _add_experts(y, out)


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
def _swiglu_experts_int(tg, gate, tu, up, td, down, x, x_block, h_block, ids, weights, out, workers):
    """The pool with ggml's numerics: x rounded to int8 blocks of x_block (gate/up's activation type), each
    expert's SwiGLU output rounded to blocks of h_block before its down rows; integer dots throughout."""
    k = ids.shape[0]
    ffn = gate.shape[1]
    hidden = down.shape[1]
    xq, xd, xs = q8_activations(x, x_block)
    xg, xu = int_ready(tg, xq), int_ready(tu, xq)
    h = np.empty((k, ffn), np.float32)
    per_expert = (ffn + ROW_TASK - 1) // ROW_TASK
    u = np.empty((k * per_expert, ROW_TASK), np.float32)  # each task's up products
    counter = task_counter()
    for worker in numba.prange(workers):  # runs of tasks from a counter (task_queue)
        for first, end in claimed_runs(counter, k * per_expert, workers, expert_unit(per_expert, k, workers)):
            for task in range(first, end):
                j, r0, r1 = _task_rows(task, per_expert, ffn)
                gate_up_int(tg, gate[ids[j]], tu, up[ids[j]], r0, r1, xg, xu, xd, xs, h[j], u[task])
    hq = np.empty((k, ffn), np.int8)
    hd = np.empty((k, ffn // h_block), np.float32)
    hs = np.empty((k, ffn // 16), np.int32)
    for j in range(k):  # ~1 us per expert: a parallel region here would cost ~100 us of waking the workers
        quantize_q8_sums(h[j], h_block, hq[j], hd[j], hs[j])
    hq = int_ready(td, hq.reshape(-1)).reshape(k, ffn)  # planes order by blocks: each row's the same
    per_expert = (hidden + ROW_TASK - 1) // ROW_TASK
    y = np.empty((k, hidden), np.float32)
    counter = task_counter()
    for worker in numba.prange(workers):  # runs of tasks from a counter (task_queue)
        for first, end in claimed_runs(counter, k * per_expert, workers, expert_unit(per_expert, k, workers)):
            for task in range(first, end):
                j, r0, r1 = _task_rows(task, per_expert, hidden)
                down_int(td, down[ids[j]], r0, r1, hq[j], hd[j], hs[j], y[j], weights[j])
    _add_experts(y, out)


@numba.njit(inline="always", nogil=True)
def _task_rows(task, per_group, n_rows):
    """(group, first row, end row) of a grouped call's task: tasks are (group, block of rows)."""
    r0 = (task % per_group) * ROW_TASK
    return task // per_group, r0, min(n_rows, r0 + ROW_TASK)


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
def _experts_gate_up_grouped(tg, gate, tu, up, xp, group_experts, group_starts, h, workers):
    """h[p] = silu(gate_e xp[p]) * (up_e xp[p]) for every pair p of every group (one expert e =
    group_experts[g], pairs group_starts[g]:group_starts[g + 1]; xp: each pair's token). Tasks are (group,
    block of rows): the block's gate and up rows are decoded once into tiles and multiplied with the group's
    tokens in 4 x 4 register blocks (matmul_nt_regs; 20-25% faster per expert than matmul_nt's 2 x 4 loops,
    which were twice as fast as a dot per (row, token)). Decoding the rows in 256-value chunks into a tile
    that stays in L1 was tried and was no faster: the rows come from RAM, and their decode is ~45% of a task."""
    ffn, hidden = gate.shape[1], xp.shape[1]
    per_group = (ffn + ROW_TASK - 1) // ROW_TASK
    counter = task_counter()
    for worker in numba.prange(workers):  # runs of tasks from a counter (task_queue)
        for first, end in claimed_runs(counter, group_experts.shape[0] * per_group, workers, 1):
            for task in range(first, end):
                g, r0, r1 = _task_rows(task, per_group, ffn)
                e, p0, p1 = group_experts[g], group_starts[g], group_starts[g + 1]
                rows, pairs = r1 - r0, p1 - p0
                gtile = np.empty((rows, hidden), np.float32)
                utile = np.empty((rows, hidden), np.float32)
                for r in range(rows):
                    dequant_row(tg, gate[e, r0 + r], gtile[r])
                    dequant_row(tu, up[e, r0 + r], utile[r])
                gv = np.empty((pairs, rows), np.float32)
                uv = np.empty((pairs, rows), np.float32)
                matmul_nt_regs(xp[p0:p1], gtile, gv, pairs, rows, hidden, False)
                matmul_nt_regs(xp[p0:p1], utile, uv, pairs, rows, hidden, False)
                swiglu_block(gv, uv, h, p0, r0, pairs, rows)


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
def _experts_down_grouped(td, down, h, group_experts, group_starts, y, workers):
    """y[p] = down_e h[p] for the pairs of every group: a block of down rows decoded once into a tile and
    multiplied with the group's SwiGLU outputs (matmul_nt_regs)."""
    hidden, ffn = down.shape[1], h.shape[1]
    per_group = (hidden + ROW_TASK - 1) // ROW_TASK
    counter = task_counter()
    for worker in numba.prange(workers):  # runs of tasks from a counter (task_queue)
        for first, end in claimed_runs(counter, group_experts.shape[0] * per_group, workers, 1):
            for task in range(first, end):
                g, r0, r1 = _task_rows(task, per_group, hidden)
                e, p0, p1 = group_experts[g], group_starts[g], group_starts[g + 1]
                rows, pairs = r1 - r0, p1 - p0
                tile = np.empty((rows, ffn), np.float32)
                for r in range(rows):
                    dequant_row(td, down[e, r0 + r], tile[r])
                yv = np.empty((pairs, rows), np.float32)
                matmul_nt_regs(h[p0:p1], tile, yv, pairs, rows, ffn, False)
                for p in range(pairs):
                    for r in range(rows):
                        y[p0 + p, r0 + r] = yv[p, r]


def swiglu_experts_grouped(gate: np.ndarray, gate_type: int, up: np.ndarray, up_type: int, down: np.ndarray,
                           down_type: int, x: np.ndarray, pair_tokens: np.ndarray, group_experts: np.ndarray,
                           group_starts: np.ndarray, quantized_activations: bool = False) -> np.ndarray:
    """Many experts over a prompt chunk, each seeing a few of its tokens, in two parallel calls (prefill).

    The (token, slot) pairs come sorted by expert: group g holds pairs group_starts[g]:group_starts[g + 1] of
    expert group_experts[g], and pair p is token pair_tokens[p] of x [n, hidden]. Returns y [pairs, hidden]
    float32, y[p] = SwiGLU expert of its token (unweighted). Each weight row is decoded once per group and
    dotted with the group's tokens: per expert and per projection, this replaces a Python call, a parallel
    region and a decode of the expert for BLAS (in a 512-token chunk of a 512-expert top-10 model an expert
    sees ~10 tokens). quantized_activations: x and the SwiGLU outputs rounded as ggml rounds them, as in matmul;
    where the CPU has VNNI and gate and up share a type, the products run on the integer codes (grouped_codes).
    """
    if gate.ndim != 3 or up.shape[:2] != gate.shape[:2] or down.ndim != 3 or down.shape[0] != gate.shape[0]:
        raise ValueError(f"expert tensors must be [n_experts, rows, row bytes] with matching gate/up; got gate "
                         f"{gate.shape}, up {up.shape}, down {down.shape}")
    ffn, hidden = gate.shape[1], down.shape[1]
    if x.ndim != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [n, {hidden}], got {x.shape}")
    for w, t, k in ((gate, gate_type, hidden), (up, up_type, hidden), (down, down_type, ffn)):
        _check_weights(w[0], _format(t), k)
    pair_tokens = np.ascontiguousarray(pair_tokens, np.int64)
    group_experts = np.ascontiguousarray(group_experts, np.int64)
    group_starts = np.ascontiguousarray(group_starts, np.int64)
    if (group_starts.shape != (group_experts.shape[0] + 1,) or group_starts[0] != 0
            or group_starts[-1] != pair_tokens.shape[0] or np.any(np.diff(group_starts) < 0)
            or (group_experts.size and (group_experts.min() < 0 or group_experts.max() >= gate.shape[0]))
            or (pair_tokens.size and (pair_tokens.min() < 0 or pair_tokens.max() >= x.shape[0]))):
        raise ValueError("groups must be expert numbers with starts 0 <= ... <= number of pairs, and pair "
                         "tokens rows of x")
    x = np.ascontiguousarray(x, np.float32)
    if quantized_activations and gate_type == up_type and use_codes(gate_type, hidden) and use_codes(down_type, ffn):
        xt = quantize_tokens(x, gate_type, activation_block(gate_type))
        xp = TokenCodes(xt.q[pair_tokens], xt.d[pair_tokens], xt.s[pair_tokens])
        h = gate_up_codes(gate, gate_type, up, up_type, xp, group_experts, group_starts)
        return down_codes(down, down_type, quantize_tokens(h, down_type, activation_block(down_type)), group_experts,
                          group_starts)
    h = np.empty((pair_tokens.shape[0], ffn), np.float32)
    y = np.empty((pair_tokens.shape[0], hidden), np.float32)
    # Without code tiles the float path multiplies the rounded values: integer dots per (row, token) re-read
    # each row for every token and were slower even where ggml's types have them (one thread, 48 experts x 11
    # tokens: Q4_K 1363 vs 1055 us per expert, Q6_K 1571 vs 1104, Q2_K 1224 vs 1182).
    xr = quantize_activations(x, gate_type) if quantized_activations else x
    workers = numba.get_num_threads()
    _experts_gate_up_grouped(int(gate_type), gate, int(up_type), up, xr[pair_tokens], group_experts, group_starts, h,
                             workers)
    hr = quantize_activations(h, down_type) if quantized_activations else h
    _experts_down_grouped(int(down_type), down, hr, group_experts, group_starts, y, workers)
    return y


def has_int_pool(gate_type: int, up_type: int, down_type: int) -> bool:
    """Whether swiglu_experts(..., quantized_activations=True) has its integer path for these types."""
    return gate_type == up_type and has_int_dot(gate_type) and has_int_dot(down_type)


def swiglu_experts(gate: np.ndarray, gate_type: int, up: np.ndarray, up_type: int, down: np.ndarray, down_type: int,
                   x: np.ndarray, ids: np.ndarray, weights: np.ndarray, out: np.ndarray,
                   quantized_activations: bool = False) -> np.ndarray:
    """out += sum_j weights[j] * SwiGLU expert ids[j] of x, one token; returns out.

    gate, up: uint8 [n_experts, ffn, row bytes] (ggml rows of length hidden); down: uint8
    [n_experts, hidden, row bytes] (rows of length ffn); x, out: float32 [hidden]; ids: int [k]
    (each < n_experts); weights: float32 [k]. quantized_activations: round x and each expert's SwiGLU output
    to int8 blocks as ggml does and use integer dots (needs has_int_pool of the three types).
    """
    if gate.ndim != 3 or up.shape[:2] != gate.shape[:2] or down.ndim != 3 or down.shape[0] != gate.shape[0]:
        raise ValueError(f"expert tensors must be [n_experts, rows, row bytes] with matching gate/up; got gate "
                         f"{gate.shape}, up {up.shape}, down {down.shape}")
    n_experts, ffn, hidden = gate.shape[0], gate.shape[1], down.shape[1]
    if x.shape != (hidden,) or out.shape != (hidden,) or x.dtype != np.float32 or out.dtype != np.float32:
        raise ValueError(f"x and out must be float32 [{hidden}], got {x.dtype} {x.shape} and {out.dtype} {out.shape}")
    for w, t, k in ((gate, gate_type, hidden), (up, up_type, hidden), (down, down_type, ffn)):
        _check_weights(w[0], _format(t), k)
        if not w.flags.c_contiguous:
            raise ValueError("expert tensors must be C-contiguous (as they lie in the file)")
    ids = np.ascontiguousarray(ids, np.int64).reshape(-1)
    weights = np.ascontiguousarray(weights, np.float32).reshape(-1)
    listed = ids.tolist()  # k numbers: a list's min and max cost a fraction of numpy's reductions
    if ids.shape != weights.shape or (listed and (min(listed) < 0 or max(listed) >= n_experts)):
        raise ValueError(f"ids must be {weights.shape[0]} expert numbers below {n_experts}, got {ids}")
    if quantized_activations:
        if not has_int_pool(gate_type, up_type, down_type):
            names = ", ".join(sorted(_format(t).name for t in INT_DOT_TYPES))
            raise ValueError(f"the integer expert pool needs gate and up of one type and integer dots for gate/up "
                             f"and down ({names})")
        _swiglu_experts_int(int(gate_type), gate, int(up_type), up, int(down_type), down, np.ascontiguousarray(x),
                            _format(gate_type).act_block, _format(down_type).act_block, ids, weights, out,
                            numba.get_num_threads())
        return out
    _swiglu_experts(int(gate_type), gate, int(up_type), up, int(down_type), down, np.ascontiguousarray(x), ids,
                    weights, out, numba.get_num_threads())
    return out
