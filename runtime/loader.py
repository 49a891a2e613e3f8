"""Open a GGUF model and run it: ``load_runtime`` and ``Runtime``."""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from strata_async.io import GGUFFile, open_gguf

from .archs import ArchModel, model_class, no_hook
from .config import LoadOptions, ModelConfig
from .device import Device, HostDevice
from .host_memory import keep_freed_buffers
from .state import SequenceState
from .weights import WeightStore

UserDebugHook = Callable[[str, int, np.ndarray], None]


class Runtime:
    """A loaded model: feed it tokens, get logits; each sequence's memory lives in its own state."""

    def __init__(self, gguf: GGUFFile, model: ArchModel, device: Device, prefill_chunk: int, max_context: int,
                 debug_hook: UserDebugHook | None = None):
        self.gguf = gguf
        self.config: ModelConfig = model.config
        self.device = device
        self.prefill_chunk = prefill_chunk
        self.max_context = max_context
        self._model = model
        self.debug_hook = debug_hook

    def new_state(self) -> SequenceState:
        return self._model.new_state(self.max_context)

    @property
    def debug_hook(self) -> UserDebugHook | None:
        """The debug hook (see load_runtime), or None. While one is set, every step of a forward runs as its own
        call so that the hook sees each intermediate tensor; without one, a decoded layer may run as one compiled
        call (qwen3next's DeltaNet layers with quantized activations: the same bits)."""
        return self._user_hook

    @debug_hook.setter
    def debug_hook(self, hook: UserDebugHook | None) -> None:
        self._user_hook = hook
        self._hook = _passthrough(hook)

    @property
    def model(self) -> ArchModel:
        """The architecture's model object (its config, weights and tiers, e.g. a PLE table's counters)."""
        return self._model

    def close(self) -> None:
        """Stop background readers and release the file mappings."""
        close = getattr(self._model, "close", None)
        if close is not None:
            close()
        self.gguf.close()

    def forward(self, state: SequenceState, token_ids: np.ndarray, all_logits: bool = True) -> np.ndarray:
        """Logits float32 [n, vocab] for every token (all_logits) or [1, vocab] for the last one.

        The tokens continue the sequence held by ``state``, which advances past them. A prompt runs in chunks
        of ``prefill_chunk`` tokens (matrix-matrix products); a single token is a decode step.
        """
        tokens = self._check_tokens(state, token_ids)
        self.device.activate()
        logits = []
        for start in range(0, len(tokens), self.prefill_chunk):
            chunk = tokens[start: start + self.prefill_chunk]
            hidden = self._model.forward(state, chunk, self._hook)
            state.position += len(chunk)
            if all_logits:
                logits.append(self._model.logits(hidden))
            elif start + len(chunk) == len(tokens):
                logits.append(self._model.logits(hidden[-1:]))
        return np.concatenate(logits) if len(logits) > 1 else logits[0]

    def _check_tokens(self, state: SequenceState, token_ids: np.ndarray) -> np.ndarray:
        if type(token_ids) is np.ndarray and token_ids.shape == (1,) and token_ids.dtype == np.int64:
            # a decode step's one id, checked in plain Python (numpy's reductions cost ~30 us with cold caches)
            token = int(token_ids[0])
            if 0 <= token < self.config.vocab_size and state.position < state.max_context:
                return token_ids.copy()  # as astype below: the caller may reuse its array
        tokens = np.asarray(token_ids)
        if tokens.ndim != 1 or not (tokens.dtype.kind in "iu" or tokens.size == 0):  # signed or unsigned ints
            raise ValueError(f"token_ids must be a 1-D array of integer token ids, got {tokens.dtype} {tokens.shape}")
        if tokens.size == 0:
            raise ValueError("token_ids is empty: give at least one token")
        listed = tokens.tolist()  # a decode step's one id: cheaper as a list than through numpy's reductions
        if min(listed) < 0 or max(listed) >= self.config.vocab_size:
            bad = np.flatnonzero((tokens < 0) | (tokens >= self.config.vocab_size))
            raise ValueError(f"token id {int(tokens[bad[0]])} at index {int(bad[0])} is outside the vocabulary "
                             f"[0, {self.config.vocab_size})")
        if state.position + tokens.size > state.max_context:
            raise ValueError(f"{tokens.size} tokens at position {state.position} exceed the context of "
                             f"{state.max_context} tokens; shorten the prompt or start a new sequence")
        return tokens.astype(np.int64)


def _passthrough(debug_hook: UserDebugHook | None) -> Callable[[str, int, np.ndarray], np.ndarray]:
    if debug_hook is None:
        return no_hook

    def hook(name: str, layer: int, tensor: np.ndarray) -> np.ndarray:
        debug_hook(name, layer, tensor)
        return tensor

    return hook


# Prompt tokens per forward step (llama.cpp's micro-batch too): each weight tile of a prompt is decoded once per
# chunk, so longer chunks decode less per token (512 measured 2.1-2.4 s for a 512-token prompt of the synthetic
# 80B Q4_K file, 256 2.5-2.6 s); the activations of a chunk take ~25 MB per 512 tokens at its widest projection.
PREFILL_CHUNK = 512


def load_runtime(path: str | os.PathLike[str], *, threads: int | None = None, quantized_activations: bool = False,
                 prefill_chunk: int = PREFILL_CHUNK, max_context: int | None = None,
                 debug_hook: UserDebugHook | None = None, options: LoadOptions | None = None) -> Runtime:
    """Open the GGUF model at ``path`` (any shard of a split model) for CPU inference.

    threads: CPU threads for the kernels (default: Numba's); quantized_activations: round activations as
    ggml does before quantized dot products; prefill_chunk: prompt tokens per forward step; max_context:
    positions a sequence may hold (default and upper bound: the model's context length); debug_hook:
    called as debug_hook(name, layer, tensor) with named intermediate activations; options: how the
    model's other tiers are served (the n-gram PLE table's I/O mode and row cache), see LoadOptions.
    """
    if prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be at least 1, got {prefill_chunk}")
    gguf = open_gguf(path)
    try:
        arch = gguf.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError(f"{gguf.path}: GGUF metadata has no general.architecture; not a model file")
        device = HostDevice(threads=threads, quantized_activations=quantized_activations)
        options = options or LoadOptions()
        if options.keep_freed_buffers:
            keep_freed_buffers()
        store = WeightStore(gguf, options.repack, options.huge_pages, options.prefault)
        model = model_class(arch)(store, device, options)
        store.load_pages(options.prefault, options.progress)
        limit = model.config.context_length
        if max_context is None:
            max_context = limit
    except BaseException:
        gguf.close()
        raise
    runtime = Runtime(gguf, model, device, prefill_chunk, max_context, debug_hook)
    if not 1 <= max_context <= limit:
        runtime.close()
        raise ValueError(f"max_context must be between 1 and the model's context length {limit}, got {max_context}")
    return runtime
