"""One token's whole MoE block in one compiled call (decode): router, top-k, shared expert and routed experts.

Done as separate calls, a decoded token's MoE block was five parallel regions and as many trips through Python:
the router's matrix-vector product, the softmax top-k, the expert pool's two phases, and the same two again for
the shared expert after its sigmoid gate. Here, in one call:

1. on the calling thread: the activations' block sums (and their int8 blocks), the shared expert's gate;
2. one parallel region whose workers take tasks from three queues in turn:
   a. the router's rows, then the shared expert's gate/up rows (neither waits for the routing); the worker that
      finishes the router's rows makes the softmax top-k (routing._softmax_topk), the one that finishes the
      shared expert's rounds its SwiGLU output for down;
   b. once the routing is made: the selected experts' gate/up rows; the worker that finishes an expert's rounds
      its output to int8 blocks (integer path) or sums it per 32;
   c. every down row, the routed experts' in expert order (each once its expert's output is rounded), then the
      shared expert's;
3. on the calling thread: out += the routed outputs in expert order, then + the shared expert's.

The hand-offs inside the region are counts published with acquire-release atomics (task_queue.publish,
wait_for): a worker goes on to the next queue without a barrier, and the serial steps run while the other
workers compute rows. Three regions with the serial steps between them had left one worker idle at each end.

Every product is the dot of the separate calls (quant_dispatch.float_dots / int_dots, expert_pool's gate/up and
down steps) and the sums keep their order, so the results are those of route + pool + pool. The router and
the shared expert's gate must be float tensors (F32, F16, BF16: llama.cpp never quantizes them), which take the
activations unrounded in both paths.
"""

from __future__ import annotations

import numba
import numpy as np

from .activations import _sigmoid
from .expert_pool import _add_experts, _task_rows, down_int, gate_up_float, gate_up_int
from .quant import _check_weights, _format
from .quant_dispatch import ROW_TASK, _FASTMATH, float_dots, float_ready, has_fused_dot, has_int_dot, int_ready
from .quant_dot import block_sums32
from .quant_float import BF16, F16, F32
from .quant_int import q8_activations, quantize_q8_sums
from .routing import _softmax_topk
from .task_queue import claimed_runs, expert_unit, publish, task_counter, wait_for, worker_count

FLOAT_TYPES = frozenset({F32, F16, BF16})


@numba.njit(inline="always", nogil=True)
def _q8(x, block, quantized):
    """x's int8 blocks, scales and 16-sums (empty where not quantized)."""
    if quantized:
        return q8_activations(x, block)
    return np.empty(0, np.int8), np.empty(0, np.float32), np.empty(0, np.int32)


@numba.njit(inline="always", nogil=True)
def _sums32(x):
    """x's sums per 32 (for the fused float dots), where x has whole blocks of 32."""
    s = np.empty(max(1, x.shape[0] // 32), np.float32)
    if x.shape[0] > 0 and x.shape[0] % 32 == 0:
        block_sums32(x, s)
    return s


# Slots of the MoE block's sync array, a cache line (8 int64) apart: tasks done and ready flags (task_queue.publish).
_ROUTER_DONE, _SHARED_DONE, _ROUTED, _SHARED_READY, _EXPERT_DONE = 0, 8, 16, 24, 32


@numba.njit(inline="always", nogil=True, fastmath=_FASTMATH)
def _round_expert(td, h, quantized, block, hq, hd, hs, hsum32, hr):
    """One expert's SwiGLU output h as its down rows take it: int8 blocks (codes in td's order) and 16-sums, or
    float sums per 32 and h in td's order."""
    if quantized:
        q = np.empty(h.shape[0], np.int8)
        quantize_q8_sums(h, block, q, hd, hs)
        hq[:] = int_ready(td, q)  # the planes' order goes by blocks: a row alone orders as within all
    else:
        if h.shape[0] % 32 == 0:
            block_sums32(h, hsum32)
        hr[:] = float_ready(td, h)


@numba.njit(parallel=True, nogil=True, cache=True, fastmath=_FASTMATH)
def _moe_token(rt, router, it, gate_inp, normalize, tg, gate, tu, up, td, down, stg, sgate, stu, sup, std, sdown,
               x, quantized, blocks, ids, weights, out, workers):
    """blocks: int8 block sizes of the activations of (gate/up, down, shared gate/up, shared down); a shared
    expert with no rows is none, a gate_inp with no rows an unscaled shared expert."""
    n_experts, k, hidden = router.shape[0], ids.shape[0], x.shape[0]
    ffn, sffn = gate.shape[1], sgate.shape[0]
    workers = worker_count(workers)
    xsum32 = _sums32(x)
    xq, xd, xs = _q8(x, blocks[0], quantized)
    if blocks[2] == blocks[0]:  # the shared expert's gate/up take the routed ones' int8 blocks (no second pass)
        sxq, sxd, sxs = xq, xd, xs
    else:
        sxq, sxd, sxs = _q8(x, blocks[2], quantized and sffn > 0)
    xg, xu = int_ready(tg, xq), int_ready(tu, xq)  # the codes in each type's order (empty: no blocks to order)
    sxg, sxu = int_ready(stg, sxq), int_ready(stu, sxq)
    # float x in each type's order, where the float path runs (x itself for every type but the planes)
    fg, fu = (x, x) if quantized else (float_ready(tg, x), float_ready(tu, x))
    sfg, sfu = (x, x) if quantized or sffn == 0 else (float_ready(stg, x), float_ready(stu, x))
    scale = np.ones(1, np.float32)
    if sffn > 0 and gate_inp.shape[0] == 1:
        dot = np.empty(1, np.float32)
        float_dots(it, gate_inp, 0, 1, x, xsum32, np.empty(hidden, np.float32), dot, 0)
        _sigmoid(dot, scale)

    logits = np.empty(n_experts, np.float32)
    n_router = (n_experts + ROW_TASK - 1) // ROW_TASK
    n_shared = (sffn + ROW_TASK - 1) // ROW_TASK
    sh = np.empty(sffn, np.float32)
    su = np.empty((n_shared, ROW_TASK), np.float32)
    h = np.empty((k, ffn), np.float32)
    per_gu = (ffn + ROW_TASK - 1) // ROW_TASK
    u = np.empty((k * per_gu, ROW_TASK), np.float32)
    # the down rows' activations, each expert's made by the worker that finishes its gate/up (_round_expert)
    nq, nf = (ffn, 0) if quantized else (0, ffn)
    hq, hd = np.empty((k, nq), np.int8), np.empty((k, nq // blocks[1]), np.float32)
    hs = np.empty((k, nq // 16), np.int32)
    hsum32, hr = np.empty((k, max(1, ffn // 32)), np.float32), np.empty((k, nf), np.float32)
    snq, snf = (sffn, 0) if quantized else (0, sffn)
    shq, shd, shs = np.empty(snq, np.int8), np.empty(snq // blocks[3], np.float32), np.empty(snq // 16, np.int32)
    shsum32, shr = np.empty(max(1, sffn // 32), np.float32), np.empty(snf, np.float32)
    per_down = (hidden + ROW_TASK - 1) // ROW_TASK
    n_shared_down = per_down if sffn > 0 else 0
    y = np.empty((k, hidden), np.float32)
    sy = np.empty(hidden, np.float32)

    # One region, three queues taken in turn: (a) the router's rows, then the shared expert's gate/up rows; (b) the
    # selected experts' gate/up rows, once the routing is made; (c) every down row, the routed experts' in expert
    # order (each once its expert's gate/up are done), then the shared expert's. The worker that finishes the
    # router's rows makes the top-k, the one that finishes an expert's (or the shared expert's) gate/up rounds its
    # output for down: no barrier between the phases, and the serial steps overlap the other workers' rows.
    sync = np.zeros(_EXPERT_DONE + 16 * k, np.int64)  # then per expert: gate/up tasks done, its output ready
    queue_a, queue_b, queue_c = task_counter(), task_counter(), task_counter()
    for worker in numba.prange(workers):
        for first, end in claimed_runs(queue_a, n_router + n_shared, workers, 1):
            router_end = min(end, n_router)
            for task in range(first, router_end):
                r0 = task * ROW_TASK
                scratch = xsum32 if has_fused_dot(rt) else np.empty(hidden, np.float32)
                float_dots(rt, router, r0, min(n_experts, r0 + ROW_TASK), x, xsum32, scratch, logits, r0)
            done = router_end - first
            if done > 0 and publish(sync, _ROUTER_DONE, done) + done == n_router:
                _softmax_topk(logits.reshape((1, n_experts)), normalize, np.empty(n_experts, np.float32),
                              ids.reshape((1, k)), weights.reshape((1, k)))
                publish(sync, _ROUTED, 1)
            shared_first = max(first, n_router)
            for task in range(shared_first, end):
                s = task - n_router
                r0 = s * ROW_TASK
                r1 = min(sffn, r0 + ROW_TASK)
                if quantized:
                    gate_up_int(stg, sgate, stu, sup, r0, r1, sxg, sxu, sxd, sxs, sh, su[s])
                else:
                    scratch = xsum32 if has_fused_dot(stg) and has_fused_dot(stu) else np.empty(hidden, np.float32)
                    gate_up_float(stg, sgate, stu, sup, r0, r1, sfg, sfu, xsum32, scratch, sh, su[s], scale[0])
            done = end - shared_first
            if done > 0 and publish(sync, _SHARED_DONE, done) + done == n_shared:
                _round_expert(std, sh, quantized, blocks[3], shq, shd, shs, shsum32, shr)
                publish(sync, _SHARED_READY, 1)

        wait_for(sync, _ROUTED, 1)
        for first, end in claimed_runs(queue_b, k * per_gu, workers, expert_unit(per_gu, k, workers)):
            task = first
            while task < end:  # the claim's tasks expert by expert
                j = task // per_gu
                stop = min(end, (j + 1) * per_gu)
                for t in range(task, stop):
                    _, r0, r1 = _task_rows(t, per_gu, ffn)
                    if quantized:
                        gate_up_int(tg, gate[ids[j]], tu, up[ids[j]], r0, r1, xg, xu, xd, xs, h[j], u[t])
                    else:
                        scratch = xsum32 if has_fused_dot(tg) and has_fused_dot(tu) else np.empty(hidden, np.float32)
                        gate_up_float(tg, gate[ids[j]], tu, up[ids[j]], r0, r1, fg, fu, xsum32, scratch, h[j], u[t],
                                      weights[j])
                if publish(sync, _EXPERT_DONE + 16 * j, stop - task) + stop - task == per_gu:
                    _round_expert(td, h[j], quantized, blocks[1], hq[j], hd[j], hs[j], hsum32[j], hr[j])
                    publish(sync, _EXPERT_DONE + 16 * j + 8, 1)
                task = stop

        for first, end in claimed_runs(queue_c, k * per_down + n_shared_down, workers,
                                       expert_unit(per_down, k + (n_shared_down > 0), workers)):
            for task in range(first, end):
                if task < k * per_down:
                    j, r0, r1 = _task_rows(task, per_down, hidden)
                    wait_for(sync, _EXPERT_DONE + 16 * j + 8, 1)
                    if quantized:
                        down_int(td, down[ids[j]], r0, r1, hq[j], hd[j], hs[j], y[j], weights[j])
                    else:
                        scratch = hsum32[j] if has_fused_dot(td) else np.empty(ffn, np.float32)
                        float_dots(td, down[ids[j]], r0, r1, hr[j], hsum32[j], scratch, y[j], r0)
                else:
                    wait_for(sync, _SHARED_READY, 1)
                    r0 = (task - k * per_down) * ROW_TASK
                    r1 = min(hidden, r0 + ROW_TASK)
                    if quantized:
                        down_int(std, sdown, r0, r1, shq, shd, shs, sy, scale[0])
                    else:
                        scratch = shsum32 if has_fused_dot(std) else np.empty(sffn, np.float32)
                        float_dots(std, sdown, r0, r1, shr, shsum32, scratch, sy, r0)
    _add_experts(y, out)
    if sffn > 0:
        _add_experts(sy.reshape((1, hidden)), out)


Projection = tuple[np.ndarray, int]  # a weight tensor's rows (uint8, ggml blocks) and its ggml type


def has_moe_token(router_type: int, gate_inp_type: int | None, types: tuple[int, ...], quantized: bool) -> bool:
    """Whether moe_token computes a block with this router and gate types and these expert projection types
    ((gate, up, down) of the routed experts, then of the shared expert if any). quantized: the integer path,
    which needs integer dots for every projection and gate and up of one type (they share the activations'
    int8 blocks)."""
    if router_type not in FLOAT_TYPES or (gate_inp_type is not None and gate_inp_type not in FLOAT_TYPES):
        return False
    return not quantized or (all(has_int_dot(t) for t in types)
                             and all(types[i] == types[i + 1] for i in range(0, len(types), 3)))


class MoETokenCall:
    """One layer's MoE block for decoded tokens, its weights checked once: ``call(x)`` -> (out, ids, weights) as
    moe_token returns them. A decoded token's Python runs with cold caches (each layer streams tens of
    megabytes of weights through them), where the eight weight checks of every call had cost ~60 us a layer.

    router: [n_experts, hidden] rows of a float type. experts: (gate, up, down), 3-D [n_experts, rows, row bytes]
    (gate/up rows of length hidden, down rows of length ffn); shared: (gate, up, down) as 2-D matrices;
    gate_inp: [1, hidden]. quantized_activations: ggml's int8 activations and integer dots (see
    expert_pool.swiglu_experts); has_moe_token says which types this call takes.
    """

    def __init__(self, router: Projection, k: int, normalize: bool, experts: tuple[Projection, ...],
                 shared: tuple[Projection, ...] | None = None, gate_inp: Projection | None = None,
                 quantized_activations: bool = False):
        (gate, tg), (up, tu), (down, td) = experts
        if gate.ndim != 3 or up.shape[:2] != gate.shape[:2] or down.ndim != 3 or down.shape[0] != gate.shape[0]:
            raise ValueError(f"expert tensors must be [n_experts, rows, row bytes] with matching gate/up; got gate "
                             f"{gate.shape}, up {up.shape}, down {down.shape}")
        n_experts, ffn, hidden = gate.shape[0], gate.shape[1], down.shape[1]
        rw, rt = router
        if rw.ndim != 2 or rw.shape[0] != n_experts:
            raise ValueError(f"the router must be [{n_experts}, row bytes] (one row per expert), got {rw.shape}")
        if not 1 <= k <= n_experts:
            raise ValueError(f"k must be between 1 and the number of experts ({n_experts}), got {k}")
        projections = [(gate[0], tg, hidden), (up[0], tu, hidden), (down[0], td, ffn), (rw, rt, hidden)]
        if shared is None:
            (sg, stg), (su, stu), (sd, std) = ((np.empty((0, w.shape[-1]), np.uint8), t) for w, t in experts)
        else:
            (sg, stg), (su, stu), (sd, std) = shared
            if sg.ndim != 2 or su.shape != sg.shape or sd.ndim != 2 or sd.shape[0] != hidden:
                raise ValueError(f"the shared expert must be gate/up [ffn, row bytes] and down [{hidden}, row "
                                 f"bytes]; got {sg.shape}, {su.shape}, {sd.shape}")
            projections += [(sg, stg, hidden), (su, stu, hidden), (sd, std, sg.shape[0])]
        gi, it = gate_inp if gate_inp is not None else (np.empty((0, rw.shape[1]), np.uint8), rt)
        if gate_inp is not None:
            if gi.ndim != 2 or gi.shape[0] != 1:
                raise ValueError(f"the shared expert's gate must be one row [1, row bytes], got {gi.shape}")
            projections.append((gi, it, hidden))
        for w, t, length in projections:
            _check_weights(w, _format(t), length)
            if not w.flags.c_contiguous:
                raise ValueError("weight tensors must be C-contiguous (as they lie in the file)")
        types = (tg, tu, td) + ((stg, stu, std) if shared is not None else ())
        if not has_moe_token(rt, it if gate_inp is not None else None, types, quantized_activations):
            raise ValueError("moe_token needs a float router and shared-expert gate (F32, F16, BF16) and, with "
                             "quantized activations, integer dots for every expert projection and gate and up of "
                             "one type (see has_moe_token)")
        blocks = np.array([max(1, _format(t).act_block) for t in (tg, td, stg, std)], np.int64)
        self.hidden, self.k = hidden, k
        self._weights = (int(rt), rw, int(it), gi, bool(normalize), int(tg), gate, int(tu), up, int(td), down,
                         int(stg), sg, int(stu), su, int(std), sd)
        self._quantized, self._blocks = bool(quantized_activations), blocks

    @property
    def quantized(self) -> bool:
        return self._quantized

    def kernel_weights(self) -> tuple[tuple, bool, np.ndarray, int]:
        """_moe_token's weight arguments (a tuple), then its quantized, blocks and k: for a compiled caller that
        runs the block inside a larger call (decode_layer)."""
        return self._weights, self._quantized, self._blocks, self.k

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(out, ids, weights) for x float32 [hidden]."""
        if not (isinstance(x, np.ndarray) and x.dtype == np.float32 and x.flags.c_contiguous):
            x = np.ascontiguousarray(x, np.float32)
        if x.shape != (self.hidden,):
            raise ValueError(f"x must be float32 [{self.hidden}], got {x.shape}")
        ids = np.empty(self.k, np.int64)
        weights = np.empty(self.k, np.float32)
        out = np.zeros(self.hidden, np.float32)
        _moe_token(*self._weights, x, self._quantized, self._blocks, ids, weights, out, 0)  # 0: Numba's threads
        return out, ids, weights


def moe_token(x: np.ndarray, router: Projection, k: int, normalize: bool, experts: tuple[Projection, ...],
              shared: tuple[Projection, ...] | None = None, gate_inp: Projection | None = None,
              quantized_activations: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One token's MoE block: returns (out, ids, weights), out [hidden] = sum_j weights[j] * SwiGLU expert ids[j]
    of x + the shared expert (scaled by sigmoid(gate_inp . x) where gate_inp is given), ids/weights the router's
    softmax top-k (renormalised to sum 1 where normalize), as route_softmax_topk gives them. x: float32 [hidden];
    the weights as MoETokenCall takes them (a layer decoding many tokens keeps one MoETokenCall instead)."""
    return MoETokenCall(router, k, normalize, experts, shared, gate_inp, quantized_activations)(x)
