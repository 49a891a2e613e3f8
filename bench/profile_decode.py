"""Where one decoded token's time goes: compiled kernels against everything else, per layer.

    python bench/profile_decode.py MODEL.gguf [--threads 2] [--tokens 8] [--int8]

Two measurements on the same warmed-up sequence:
1. wall time per phase (each layer's mixer and MoE, the output head), from the runtime's debug hook
   timestamps (with a hook set, every step runs as its own call: the layered path);
2. with the hook taken off again (the path a decode takes: qwen3next's DeltaNet layers as one compiled call
   each with --int8), time inside compiled (Numba) kernels: every kernel of strata_async.kernels that Python
   calls is wrapped,
   for the timed tokens only, in a timer (two perf_counter reads, ~0.2 us a call), and the tokens' wall time
   minus the kernels' is the time outside them: Python, numpy glue, argument checks (median over tokens).
   A kernel's time includes Numba's entry into it (typing its arguments: ~1 us a call, measured here with an
   empty kernel and reported as an estimate). An earlier version took kernel times from cProfile, which slows
   every Python call and made the outside share look 1.5x larger than it is.
Writes bench/results/profile_<tag>.json (tag: the file name, with -int8 for --int8) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, defaultdict
from contextlib import contextmanager
from pathlib import Path

import numba
import numpy as np
from bench_decode import RESULTS, reread_from_disk, touch_pages
from numba.core.registry import CPUDispatcher
from strata_async.runtime import load_runtime


@contextmanager
def patched_kernels(wrap):
    """Within the block, every kernel dispatcher that a strata_async module holds as an attribute is replaced by
    wrap(name, kernel) (name: "module.function"); restored on exit. Kernels that compiled code calls are not
    seen: they are part of their caller."""
    patched = []
    for module in [m for name, m in sys.modules.items() if name.startswith("strata_async")]:
        for attr, obj in list(vars(module).items()):
            if isinstance(obj, CPUDispatcher) and obj.__module__.startswith("strata_async.kernels"):
                patched.append((module, attr, obj))
                setattr(module, attr, wrap(f"{obj.__module__.rsplit('.', 1)[-1]}.{obj.__name__}", obj))
    try:
        yield
    finally:
        for module, attr, obj in patched:
            setattr(module, attr, obj)


def kernel_timers(seconds: Counter, calls: Counter):
    """patched_kernels with a wrapper that adds each kernel's wall time to seconds[name] and counts calls[name]."""
    clock = time.perf_counter

    def timed(name: str, kernel):
        def call(*args):
            t = clock()
            try:
                return kernel(*args)
            finally:
                seconds[name] += clock() - t
                calls[name] += 1
        return call

    return patched_kernels(timed)


def kernel_entry_seconds(repeats: int = 20000) -> float:
    """Cost of calling a compiled kernel from Python with six array arguments and an int (no work inside)."""
    @numba.njit(nogil=True)
    def empty(t, a, b, c, d, e, f):
        return t

    args = (1, *(np.zeros(8, dt) for dt in (np.uint8, np.int8, np.float32, np.int32, np.float32, np.float32)))
    empty(*args)
    t0 = time.perf_counter()
    for _ in range(repeats):
        empty(*args)
    return (time.perf_counter() - t0) / repeats


def main() -> int:
    ap = argparse.ArgumentParser(description="kernel vs outside-kernel time of decoded tokens")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--int8", action="store_true", help="quantized activations (the integer dots)")
    a = ap.parse_args()

    marks: list[tuple[str, int, float]] = []
    reread_from_disk(a.model)
    rt = load_runtime(a.model, threads=a.threads, max_context=64, quantized_activations=a.int8,
                      debug_hook=lambda name, layer, t: marks.append((name, layer, time.perf_counter())))
    touch_pages(a.model)
    state = rt.new_state()
    logits = rt.forward(state, np.arange(1, 9), all_logits=False)
    for _ in range(2):  # warm-up steps
        logits = rt.forward(state, np.array([int(logits[-1].argmax())]), all_logits=False)

    phases: dict[str, list[float]] = defaultdict(list)
    walls = []
    for _ in range(a.tokens):
        marks.clear()
        t0 = time.perf_counter()
        logits = rt.forward(state, np.array([int(logits[-1].argmax())]), all_logits=False)
        t1 = time.perf_counter()
        walls.append(t1 - t0)
        at = {(n, l): t for n, l, t in marks}
        layers = sorted({l for _, l, _ in marks if l >= 0})
        phases["embedding"].append(at[("attn_norm", layers[0])] - t0)
        for l in layers:
            phases[f"layer {l} mixer"].append(at[("ffn_inp", l)] - at[("attn_norm", l)])
            phases[f"layer {l} moe"].append(at[("layer_out", l)] - at[("ffn_inp", l)])
        phases["output head"].append(t1 - at[("output_norm", -1)])

    rt.debug_hook = None
    logits = rt.forward(state, np.array([int(logits[-1].argmax())]), all_logits=False)  # compiled layers warm
    kernel_s: Counter = Counter()
    kernel_calls: Counter = Counter()
    token_walls, token_kernels = [], []
    with kernel_timers(kernel_s, kernel_calls):
        for _ in range(a.tokens):
            k0 = sum(kernel_s.values())
            t0 = time.perf_counter()
            logits = rt.forward(state, np.array([int(logits[-1].argmax())]), all_logits=False)
            token_walls.append(time.perf_counter() - t0)
            token_kernels.append(sum(kernel_s.values()) - k0)
    # Medians over tokens: on a shared machine a token now and then loses the CPU for milliseconds, and in a
    # mean that stall would land on whichever side it happened to hit.
    timed_wall = float(np.median(token_walls))
    outside = float(np.median(np.subtract(token_walls, token_kernels)))
    kernels = timed_wall - outside
    calls = sum(kernel_calls.values()) / a.tokens
    entry = kernel_entry_seconds()
    result = {"model": a.model, "threads": a.threads, "tokens": a.tokens, "quantized_activations": a.int8,
              "wall_ms": 1e3 * float(np.median(walls)), "timed_wall_ms": 1e3 * timed_wall,
              "kernel_ms": 1e3 * kernels, "outside_kernels_ms": 1e3 * outside,
              "outside_fraction": outside / timed_wall,
              "kernel_calls_per_token": calls, "kernel_entry_us": 1e6 * entry,
              "kernel_entry_ms_estimate": 1e3 * entry * calls,
              "kernels_ms": {k: 1e3 * v / a.tokens for k, v in kernel_s.most_common()},
              "kernel_calls": {k: kernel_calls[k] / a.tokens for k, _ in kernel_s.most_common()},
              "phases_ms": {k: 1e3 * float(np.median(v)) for k, v in phases.items()}}
    tag = a.tag or Path(a.model).stem + ("-int8" if a.int8 else "")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"profile_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"one decoded token: {result['wall_ms']:.1f} ms wall; timed run {result['timed_wall_ms']:.1f} ms: "
          f"{result['kernel_ms']:.1f} ms in {calls:.0f} kernel calls, {result['outside_kernels_ms']:.2f} ms outside "
          f"({100 * result['outside_fraction']:.1f}%); entering the kernels ~{result['kernel_entry_ms_estimate']:.2f} "
          f"ms of the kernel time ({result['kernel_entry_us']:.2f} us a call)\n")
    print("| phase | ms |\n|---|---|")
    for k, v in result["phases_ms"].items():
        print(f"| {k} | {v:.2f} |")
    print("\n| kernel | ms per token | calls per token |\n|---|---|---|")
    for k, v in result["kernels_ms"].items():
        print(f"| {k} | {v:.3f} | {result['kernel_calls'][k]:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
