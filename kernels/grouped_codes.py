"""The grouped prompt experts on integer codes: expert_pool.swiglu_experts_grouped with quantized activations.

Same contract and task split as the float kernels in expert_pool (tasks are (expert, 16 rows); a task decodes
its gate and up rows once and multiplies them with the group's tokens), but the rows become code tiles and the
tokens int8 codes (kernels/int_matmul.py), as ggml's integer dots see them. In a 512-token chunk of a
512-expert top-10 model an expert sees ~10 tokens, where the float path spent ~45% of a task decoding rows to
float32 and ~55% in float products; the code tile is smaller to write and its products 4x denser.
"""

from __future__ import annotations

import numba
import numpy as np

from .activations import swiglu_block
from .code_tiles import decode_tile, sub_block
from .int_matmul import TokenCodes, tile_buffers, tile_times_tokens
from .simd_gemm import ROWS
from .task_queue import next_task, task_counter


@numba.njit(inline="always", nogil=True)
def _task_expert_row(group_experts, per_group, n_tasks, task):
    """(expert, first row) of task (the last task's for a task past the end): the rows a decode asks for next."""
    task = min(task, n_tasks - 1)
    return group_experts[task // per_group], (task % per_group) * ROWS


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _gate_up_codes(tg, gate, tu, up, xq, xd, xs, group_experts, group_starts, h, workers):
    """h[p, r] = silu(gate_e . x_p) * (up_e . x_p) for the pairs p of every group (expert e = group_experts[g],
    pairs group_starts[g] .. group_starts[g + 1]); x_p: row p of the pairs' codes (xq, xd, xs)."""
    ffn, hidden = gate.shape[1], xq.shape[1]
    per_group = (ffn + ROWS - 1) // ROWS
    sbg, sbu = sub_block(tg), sub_block(tu)
    n_tasks = group_experts.shape[0] * per_group
    most = max(1, np.max(group_starts[1:] - group_starts[:-1])) if group_experts.shape[0] else 1
    counter = task_counter()
    for worker in numba.prange(workers):  # a worker per thread, tasks from the counter (task_queue)
        gw, gs, gb, stage = tile_buffers(tg, hidden)
        uw, us, ub, _ = tile_buffers(tu, hidden)
        gv = np.empty((most, ROWS), np.float32)
        uv = np.empty((most, ROWS), np.float32)
        buf = np.empty(8 * ROWS, np.float32)
        task = next_task(counter)
        while task < n_tasks:
            following = next_task(counter)  # taken now, so the decodes can ask for its rows
            g, r0 = task // per_group, (task % per_group) * ROWS
            e, p0, p1 = group_experts[g], group_starts[g], group_starts[g + 1]
            ne, n0 = _task_expert_row(group_experts, per_group, n_tasks, following)
            decode_tile(tg, gate[e], r0, gw, gs, gb, stage, up[e], r0)
            decode_tile(tu, up[e], r0, uw, us, ub, stage, gate[ne], n0)
            tile_times_tokens(sbg, gw, gs, gb, xq, xd, xs, p0, p1, gv, 0, buf, -p0)
            tile_times_tokens(sbu, uw, us, ub, xq, xd, xs, p0, p1, uv, 0, buf, -p0)
            swiglu_block(gv, uv, h, p0, r0, p1 - p0, min(ROWS, ffn - r0))
            task = following


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=False)
def _down_codes(td, down, hq, hd, hs, group_experts, group_starts, y, workers):
    """y[p, r] = down_e . h_p for the pairs of every group (h_p: row p of the codes (hq, hd, hs))."""
    hidden, ffn = down.shape[1], hq.shape[1]
    per_group = (hidden + ROWS - 1) // ROWS
    sb = sub_block(td)
    n_tasks = group_experts.shape[0] * per_group
    counter = task_counter()
    for worker in numba.prange(workers):  # a worker per thread, tasks from the counter (task_queue)
        words, scale, bias, stage = tile_buffers(td, ffn)
        buf = np.empty(8 * ROWS, np.float32)
        task = next_task(counter)
        while task < n_tasks:
            following = next_task(counter)
            g, r0 = task // per_group, (task % per_group) * ROWS
            e, p0, p1 = group_experts[g], group_starts[g], group_starts[g + 1]
            ne, n0 = _task_expert_row(group_experts, per_group, n_tasks, following)
            decode_tile(td, down[e], r0, words, scale, bias, stage, down[ne], n0)
            tile_times_tokens(sb, words, scale, bias, hq, hd, hs, p0, p1, y, r0, buf, 0)
            task = following


def gate_up_codes(gate: np.ndarray, gate_type: int, up: np.ndarray, up_type: int, x: TokenCodes,
                  group_experts: np.ndarray, group_starts: np.ndarray) -> np.ndarray:
    """The SwiGLU outputs h [pairs, ffn] of every group's pairs (x: the pairs' codes, in pair order)."""
    h = np.empty((x.q.shape[0], gate.shape[1]), np.float32)
    _gate_up_codes(int(gate_type), gate, int(up_type), up, x.q, x.d, x.s, group_experts, group_starts, h,
                   numba.get_num_threads())
    return h


def down_codes(down: np.ndarray, down_type: int, h: TokenCodes, group_experts: np.ndarray,
               group_starts: np.ndarray) -> np.ndarray:
    """y [pairs, hidden] = each pair's expert's down rows times its SwiGLU output h (codes)."""
    y = np.empty((h.q.shape[0], down.shape[1]), np.float32)
    _down_codes(int(down_type), down, h.q, h.d, h.s, group_experts, group_starts, y, numba.get_num_threads())
    return y
