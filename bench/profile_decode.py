"""Where one decoded token's time goes: compiled kernels against everything else, per layer.

    python bench/profile_decode.py MODEL.gguf [--threads 2] [--tokens 8]

Two measurements on the same warmed-up sequence:
1. wall time per phase (each layer's mixer and MoE, the output head), from the runtime's debug hook
   timestamps, without a profiler;
2. time inside compiled (Numba) kernels per token, from cProfile: a kernel call's own time is the
   compiled code's, which the profiler does not slow down. Outside-kernel time = the wall time of those
   same profiled tokens minus their kernel time: Python, numpy glue and dispatch, an upper bound (the
   profiler slows the Python side). (Taking it against the unprofiled run of (1) instead mixes two runs,
   whose difference on a shared machine was larger than the quantity: -14% to +18%.)
Writes bench/results/profile_<tag>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import cProfile
import importlib
import json
import pstats
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from bench_decode import RESULTS, touch_pages
from numba.core.registry import CPUDispatcher
from strata_async.runtime import load_runtime


def is_kernel(filename: str, name: str) -> bool:
    """A profiled function is a compiled kernel if it is a Numba dispatcher of a strata_async.kernels module."""
    path = Path(filename)
    if path.parent.name != "kernels":
        return False
    module = importlib.import_module(f"strata_async.kernels.{path.stem}")
    return isinstance(getattr(module, name, None), CPUDispatcher)


def main() -> int:
    ap = argparse.ArgumentParser(description="kernel vs outside-kernel time of decoded tokens")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--tag", default=None)
    ap.add_argument("--int8", action="store_true", help="quantized activations (the integer dots)")
    a = ap.parse_args()

    marks: list[tuple[str, int, float]] = []
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

    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for _ in range(a.tokens):
        logits = rt.forward(state, np.array([int(logits[-1].argmax())]), all_logits=False)
    profiler.disable()
    profiled_wall = (time.perf_counter() - t0) / a.tokens
    kernel_s: dict[str, float] = defaultdict(float)
    for (filename, _, name), (_, _, tottime, _, _) in pstats.Stats(profiler).stats.items():
        if is_kernel(filename, name):
            kernel_s[f"{Path(filename).stem}.{name}"] += tottime / a.tokens

    wall = float(np.median(walls))
    kernels = sum(kernel_s.values())
    result = {"model": a.model, "threads": a.threads, "tokens": a.tokens, "wall_ms": 1e3 * wall,
              "profiled_wall_ms": 1e3 * profiled_wall, "kernel_ms": 1e3 * kernels,
              "outside_kernels_ms": 1e3 * (profiled_wall - kernels),
              "outside_fraction": (profiled_wall - kernels) / profiled_wall,
              "outside_estimate_ms": 1e3 * (wall - kernels),  # unprofiled wall minus kernels: two runs, noisy
              "kernels_ms": {k: 1e3 * v for k, v in sorted(kernel_s.items(), key=lambda kv: -kv[1])},
              "phases_ms": {k: 1e3 * float(np.median(v)) for k, v in phases.items()}}
    tag = a.tag or Path(a.model).stem
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"profile_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"one decoded token: {result['wall_ms']:.1f} ms wall; profiled: {result['profiled_wall_ms']:.1f} ms, "
          f"{result['kernel_ms']:.1f} ms in kernels, {result['outside_kernels_ms']:.1f} ms outside "
          f"({100 * result['outside_fraction']:.1f}%; unprofiled wall minus kernel time: "
          f"{result['outside_estimate_ms']:.1f} ms)\n")
    print("| phase | ms |\n|---|---|")
    for k, v in result["phases_ms"].items():
        print(f"| {k} | {v:.2f} |")
    print("\n| kernel | ms per token |\n|---|---|")
    for k, v in result["kernels_ms"].items():
        print(f"| {k} | {v:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
