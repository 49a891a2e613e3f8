"""Where matrix products run. ``HostDevice`` computes on the CPU with the Numba kernels, straight from
the quantized rows; a CUDA device will implement the same interface."""

from __future__ import annotations

import os
from typing import Protocol

import numba
import numpy as np

from strata_async.kernels import decode_layer, expert_pool, quant
from strata_async.kernels import moe_token as fused_moe
from strata_async.kernels.deltanet import DecodeStep

from .weights import QTensor


class Device(Protocol):
    name: str

    def activate(self) -> None:
        """Prepare the calling thread to compute on this device (called at the start of each forward)."""

    def linear(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        """x [n, k] float32 times the matrix w [rows, k] transposed -> float32 [n, rows]."""

    def linears(self, x: np.ndarray, ws: tuple[QTensor, ...]) -> list[np.ndarray]:
        """[linear(x, w) for w in ws]: several matrices on one input (a layer's projections, an expert's gate and
        up), so that whatever the device does to the input once (rounding it to int8 blocks) it does once."""

    def swiglu_experts(self, x: np.ndarray, gate: QTensor, up: QTensor, down: QTensor, ids: np.ndarray,
                       weights: np.ndarray, out: np.ndarray) -> bool:
        """out [hidden] += sum_j weights[j] * SwiGLU expert ids[j] of one token x [hidden], all experts in one
        call. gate/up/down: 3-D expert tensors. Returns False (out untouched) where the device has no such path."""

    def moe_token(self, x: np.ndarray, router: QTensor, k: int, normalize: bool, experts: tuple[QTensor, ...],
                  shared: tuple[QTensor, ...] | None, gate_inp: QTensor | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """One token's whole MoE block in one call: (out [hidden], ids [k], weights [k]) for x [hidden], the
        router's softmax top-k (renormalised where normalize) over the routed experts (gate, up, down: 3-D) plus the
        shared expert's (gate, up, down: 2-D) output, scaled by sigmoid(gate_inp . x) where gate_inp is given.
        None where the device has no such path for these tensors."""

    def deltanet_moe_layer(self, attn_norm: np.ndarray, ffn_norm: np.ndarray, eps: float,
                           proj: tuple[QTensor, ...], step: DecodeStep, out: QTensor, router: QTensor, k: int,
                           normalize: bool, experts: tuple[QTensor, ...], shared: tuple[QTensor, ...] | None,
                           gate_inp: QTensor | None) -> decode_layer.DeltaNetMoELayerCall | None:
        """A whole DeltaNet layer of one decoded token as one call, ``call(h, conv_state, state)``: h [hidden] +=
        the mixer (rmsnorm with attn_norm, the input projections proj = (q/k/v, z, fused beta/alpha), the step,
        the output projection out), then += the MoE block (as moe_token) of rmsnorm(h) with ffn_norm; in place.
        None where the device has no such path for these tensors."""

    def attention_moe_layer(self, attn_norm: np.ndarray, ffn_norm: np.ndarray, eps: float,
                            proj: tuple[QTensor, ...], q_norm: np.ndarray, k_norm: np.ndarray,
                            shape: decode_layer.AttentionShape, out: QTensor, router: QTensor, k: int, normalize: bool,
                            experts: tuple[QTensor, ...], shared: tuple[QTensor, ...] | None,
                            gate_inp: QTensor | None) -> decode_layer.AttentionMoELayerCall | None:
        """A whole attention layer of one decoded token as one call, ``call(h, k_cache, v_cache, start,
        position)``: h [hidden] += the attention (rmsnorm with attn_norm, the q, k, v projections proj, their
        per-head norms, RoPE, the new key and value into cache row start, attention over rows 0..start, the gate,
        the output projection out), then += the MoE block of rmsnorm(h) with ffn_norm; in place. None where the
        device has no such path for these tensors."""

    def swiglu_experts_grouped(self, x: np.ndarray, gate: QTensor, up: QTensor, down: QTensor,
                               pair_tokens: np.ndarray, group_experts: np.ndarray,
                               group_starts: np.ndarray) -> np.ndarray | None:
        """Prefill: many experts each over a few tokens of x [n, hidden] in one call. Pairs sorted by expert:
        group g is expert group_experts[g] over pairs group_starts[g]:group_starts[g + 1], pair p token
        pair_tokens[p]. Returns [pairs, hidden] (unweighted expert outputs), or None where there is no such path."""


def _pairs(ws: tuple[QTensor, ...]) -> tuple[tuple[np.ndarray, int], ...]:
    return tuple((w.data, w.ggml_type) for w in ws)


def physical_cores() -> int:
    """CPU cores this process may run on, SMT siblings counted once.

    The kernels stream weights from memory: a second hyper-thread on a core adds contention, not bandwidth,
    so one worker per physical core is the default. Where the topology cannot be read, every CPU counts.
    """
    cpus = os.sched_getaffinity(0)
    cores = set()
    for cpu in cpus:
        topology = f"/sys/devices/system/cpu/cpu{cpu}/topology"
        try:
            with open(f"{topology}/physical_package_id") as pkg, open(f"{topology}/core_id") as core:
                cores.add((pkg.read().strip(), core.read().strip()))
        except OSError:
            return len(cpus)
    return max(1, len(cores))


_NOT_MADE = object()  # a cache miss, where None is a cached "no fused path"
# MatvecsCalls kept at most (a model's layers hold one or two lists each; matrices handed out per call, as a
# routed expert's, make new keys each time and must not grow the cache without end).
_MATVECS_CALLS = 1024


class HostDevice:
    name = "host"

    def __init__(self, threads: int | None = None, quantized_activations: bool = False):
        if threads is not None and not 1 <= threads <= numba.config.NUMBA_NUM_THREADS:
            raise ValueError(f"threads must be between 1 and {numba.config.NUMBA_NUM_THREADS} "
                             f"(the CPU threads Numba may use), got {threads}")
        # Workers: one per physical core unless told otherwise.
        self.threads = threads if threads is not None else min(physical_cores(), numba.config.NUMBA_NUM_THREADS)
        # Round activations as ggml does before its integer dot products (to compare with llama.cpp).
        self.quantized_activations = quantized_activations
        self._moe_calls: dict[tuple, fused_moe.MoETokenCall | None] = {}
        self._matvecs_calls: dict[tuple, quant.MatvecsCall] = {}  # by the matrices' QTensors

    def activate(self) -> None:
        # Numba's thread count is per calling thread, so it is set by whichever thread runs the model.
        numba.set_num_threads(self.threads)

    @staticmethod
    def _check_linear(x: np.ndarray, w: QTensor) -> None:
        if w.data.ndim != 2:
            raise ValueError(f"linear needs a 2-D weight; '{w.name}' has shape {w.shape} (pick an expert first)")
        if x.ndim != 2 or x.shape[1] != w.row_len:
            raise ValueError(f"linear with '{w.name}' ({w.rows} x {w.row_len}) got input of shape {x.shape}")

    def linear(self, x: np.ndarray, w: QTensor) -> np.ndarray:
        self._check_linear(x, w)
        if x.shape[0] == 1:  # decode: one matrix-vector product, no tile decoding
            return quant.matvec(w.data, w.ggml_type, x[0], self.quantized_activations)[None, :]
        return quant.matmul(w.data, w.ggml_type, x, self.quantized_activations)

    def linears(self, x: np.ndarray, ws: tuple[QTensor, ...]) -> list[np.ndarray]:
        if x.shape[0] == 1:  # decode: the matrices of one type in one parallel region
            call = self._matvecs_calls.get(ws)
            if call is None:
                for w in ws:
                    self._check_linear(x, w)
                if len(self._matvecs_calls) >= _MATVECS_CALLS:  # lists made per call (an expert's matrices)
                    self._matvecs_calls.clear()
                call = self._matvecs_calls[ws] = quant.MatvecsCall([(w.data, w.ggml_type) for w in ws], x.shape[1],
                                                                   self.quantized_activations)
            return [o[None, :] for o in call(x[0])]
        if not self.quantized_activations:
            return [self.linear(x, w) for w in ws]
        for w in ws:
            self._check_linear(x, w)
        return quant.matmuls([(w.data, w.ggml_type) for w in ws], x, act_quant=True)

    def swiglu_experts(self, x: np.ndarray, gate: QTensor, up: QTensor, down: QTensor, ids: np.ndarray,
                       weights: np.ndarray, out: np.ndarray) -> bool:
        if self.quantized_activations and not expert_pool.has_int_pool(gate.ggml_type, up.ggml_type, down.ggml_type):
            return False  # ggml's rounding for these types goes through linear, one expert at a time
        expert_pool.swiglu_experts(gate.data, gate.ggml_type, up.data, up.ggml_type, down.data, down.ggml_type,
                                   x, ids, weights, out, self.quantized_activations)
        return True

    def moe_token(self, x: np.ndarray, router: QTensor, k: int, normalize: bool, experts: tuple[QTensor, ...],
                  shared: tuple[QTensor, ...] | None, gate_inp: QTensor | None
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        call = self._kept_moe_call(router, k, normalize, experts, shared, gate_inp)
        return None if call is None else call(x)

    def _kept_moe_call(self, router: QTensor, k: int, normalize: bool, experts: tuple[QTensor, ...],
                       shared: tuple[QTensor, ...] | None, gate_inp: QTensor | None) -> fused_moe.MoETokenCall | None:
        # Each layer's block is checked once and kept (weights are immutable views of the file).
        key = (router, k, normalize, experts, shared, gate_inp)
        call = self._moe_calls.get(key, _NOT_MADE)
        if call is _NOT_MADE:
            call = self._moe_calls[key] = self._moe_call(router, k, normalize, experts, shared, gate_inp)
        return call

    def _moe_call(self, router: QTensor, k: int, normalize: bool, experts: tuple[QTensor, ...],
                  shared: tuple[QTensor, ...] | None, gate_inp: QTensor | None) -> fused_moe.MoETokenCall | None:
        projections = experts + (shared or ())
        if not fused_moe.has_moe_token(router.ggml_type, gate_inp.ggml_type if gate_inp is not None else None,
                                       tuple(w.ggml_type for w in projections), self.quantized_activations):
            return None
        pairs = _pairs(projections)
        return fused_moe.MoETokenCall((router.data, router.ggml_type), k, normalize, tuple(pairs[:3]),
                                      tuple(pairs[3:]) if shared else None,
                                      (gate_inp.data, gate_inp.ggml_type) if gate_inp is not None else None,
                                      self.quantized_activations)

    def deltanet_moe_layer(self, attn_norm: np.ndarray, ffn_norm: np.ndarray, eps: float,
                           proj: tuple[QTensor, ...], step: DecodeStep, out: QTensor, router: QTensor, k: int,
                           normalize: bool, experts: tuple[QTensor, ...], shared: tuple[QTensor, ...] | None,
                           gate_inp: QTensor | None) -> decode_layer.DeltaNetMoELayerCall | None:
        moe = self._decode_layer_moe(proj, out, router, k, normalize, experts, shared, gate_inp)
        return moe and decode_layer.DeltaNetMoELayerCall.make(attn_norm, ffn_norm, eps, _pairs(proj), step,
                                                              (out.data, out.ggml_type), moe)

    def attention_moe_layer(self, attn_norm: np.ndarray, ffn_norm: np.ndarray, eps: float,
                            proj: tuple[QTensor, ...], q_norm: np.ndarray, k_norm: np.ndarray,
                            shape: decode_layer.AttentionShape, out: QTensor, router: QTensor, k: int, normalize: bool,
                            experts: tuple[QTensor, ...], shared: tuple[QTensor, ...] | None,
                            gate_inp: QTensor | None) -> decode_layer.AttentionMoELayerCall | None:
        moe = self._decode_layer_moe(proj, out, router, k, normalize, experts, shared, gate_inp)
        return moe and decode_layer.AttentionMoELayerCall.make(attn_norm, ffn_norm, eps, _pairs(proj), q_norm,
                                                               k_norm, shape, self.threads, (out.data, out.ggml_type),
                                                               moe)

    def _decode_layer_moe(self, proj: tuple[QTensor, ...], out: QTensor, router: QTensor, k: int, normalize: bool,
                          experts: tuple[QTensor, ...], shared: tuple[QTensor, ...] | None,
                          gate_inp: QTensor | None) -> fused_moe.MoETokenCall | None:
        """The MoE call a compiled decode layer takes (None: the float path keeps its layered calls), the layer's
        matrices checked."""
        if not self.quantized_activations:
            return None
        for w in (*proj, out):
            if w.data.ndim != 2:
                raise ValueError(f"'{w.name}' must be a 2-D matrix, got shape {w.shape}")
        return self._kept_moe_call(router, k, normalize, experts, shared, gate_inp)

    def swiglu_experts_grouped(self, x: np.ndarray, gate: QTensor, up: QTensor, down: QTensor,
                               pair_tokens: np.ndarray, group_experts: np.ndarray,
                               group_starts: np.ndarray) -> np.ndarray | None:
        return expert_pool.swiglu_experts_grouped(gate.data, gate.ggml_type, up.data, up.ggml_type, down.data,
                                                  down.ggml_type, x, pair_tokens, group_experts, group_starts,
                                                  self.quantized_activations)
