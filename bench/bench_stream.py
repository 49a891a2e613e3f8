"""How close a decoded token's kernels come to the RAM's bandwidth when their weights stream from RAM.

    python bench/bench_stream.py [--types IQ2_XS_PLANES,IQ2_XS,Q4_K,Q8_0] [--threads 2] [--repeats 7]

bench_kernels.py measures each dot from the cache, one core; a decoded token reads its weights from RAM on every
core. Here, on --threads threads, the weights of each part of the 80B-shaped layer (Qwen3-Next's real per-layer
shapes, random valid blocks of each --types) stream through the engine's decode kernels, the set large enough
(several copies, or 512 experts) that no repeat finds it in the last-level cache:

- "projection": int8-activation matrix-vector products over 12288 x 2048 matrices (a DeltaNet layer's q/k/v and
  gate projections, as one matrix; quant.matvec);
- "moe block": one token's whole MoE block (moe_token.MoETokenCall: the float32 router, 10 of the 512 experts'
  gate/up/down, the shared expert), a new token's activations each call so the experts change;
- "output head": the 151936 x 2048 Q6_K head (the files' head type), once.

Reported: the weight bytes each part reads per second, as a fraction of the RAM read bandwidth measured right
before and after it (bench_kernels.ram_read_gbps, the median of the two). A part far below the RAM's rate while its
dots from the cache are faster than it (bench_kernels) loses its time between the dots: row and task overheads,
the regions' starts and ends, the cache misses that the prefetches do not hide.
Results: bench/results/stream.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numba
import numpy as np
from bench_kernels import MADE_FROM, RESULTS, _type_id, kernel_matrix, ram_read_gbps
from strata_async.kernels import quant, quant_planes
from strata_async.kernels.moe_token import MoETokenCall
from strata_async.kernels.quant_float import F32

HIDDEN, FFN, EXPERTS, TOP_K, VOCAB = 2048, 512, 512, 10, 151936
PROJECTION_ROWS = 12288  # a DeltaNet layer's q/k/v (8192) and gate (4096) rows
COPIES = 6  # projections cycled: 6 x 10-15 MB, past a 32 MiB last-level cache
LAYERS = 8  # MoE blocks cycled (routers and shared experts: 8 x 5 MB), over one set of 512 experts


def matrix(name: str, rows: int, k: int, rng: np.random.Generator, n: int = 1) -> np.ndarray:
    """n x rows x k weights of a type (or an engine layout made from its source type), as [n, rows, row bytes]."""
    return kernel_matrix(name, n * rows, k, rng).reshape(n, rows, -1)


def timed(call, repeats: int, pick=np.median) -> float:
    """Seconds of call() over `repeats` calls, after one unmeasured: their median, or what `pick` makes of them."""
    call()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return float(pick(times))


def measure(what: str, nbytes: int, call, threads: int, repeats: int) -> dict:
    """A part's bytes per second next to the RAM's, read just before and after it."""
    before = ram_read_gbps(threads, 1 << 29, 3)["best"]
    numba.set_num_threads(threads)
    s = timed(call, repeats)
    after = ram_read_gbps(threads, 1 << 29, 3)["best"]
    numba.set_num_threads(threads)
    ram = float(np.median([before, after]))
    r = {"part": what, "bytes": nbytes, "seconds": s, "gbps": nbytes / s / 1e9, "ram_gbps": [before, after]}
    r["fraction_of_ram"] = r["gbps"] / ram
    print(f"{what}: {r['gbps']:.1f} GB/s, {r['fraction_of_ram']:.0%} of the RAM's {before:.1f}/{after:.1f}",
          flush=True)
    return r


def projection(name: str, rng: np.random.Generator, threads: int, repeats: int) -> dict:
    ws = list(matrix(name, PROJECTION_ROWS, HIDDEN, rng, COPIES))
    t = _type_id(name)
    x = rng.standard_normal(HIDDEN).astype(np.float32)

    def call():
        for w in ws:
            quant.matvec(w, t, x, True)
    r = measure(f"{name} projection", sum(w.nbytes for w in ws), call, threads, repeats)
    r["seconds"] /= COPIES
    return r


def moe_block(name: str, rng: np.random.Generator, threads: int, repeats: int) -> dict:
    t = _type_id(name)
    gate, up = matrix(name, FFN, HIDDEN, rng, EXPERTS), matrix(name, FFN, HIDDEN, rng, EXPERTS)
    down = matrix(name, HIDDEN, FFN, rng, EXPERTS)
    calls = []
    for _ in range(LAYERS):
        router = (rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32) * 0.05).view(np.uint8)
        shared = tuple(matrix(name, rows, k, rng)[0] for rows, k in ((FFN, HIDDEN), (FFN, HIDDEN), (HIDDEN, FFN)))
        gate_inp = rng.standard_normal((1, HIDDEN)).astype(np.float32).view(np.uint8)
        calls.append(MoETokenCall((router, F32), TOP_K, True, ((gate, t), (up, t), (down, t)),
                                  tuple((s, t) for s in shared), (gate_inp, F32), quantized_activations=True))
    per_block = (router.nbytes + gate_inp.nbytes + sum(s.nbytes for s in shared)
                 + TOP_K * (gate[0].nbytes + up[0].nbytes + down[0].nbytes))
    xs = [rng.standard_normal(HIDDEN).astype(np.float32) for _ in range(4 * LAYERS)]
    turn = [0]

    def call():
        for c in calls:
            c(xs[turn[0] % len(xs)])
            turn[0] += 1
    r = measure(f"{name} moe block", per_block * LAYERS, call, threads, repeats)
    r["seconds"] /= LAYERS
    return r


def head(rng: np.random.Generator, threads: int, repeats: int) -> dict:
    w = matrix("Q6_K", VOCAB, HIDDEN, rng)[0]
    x = rng.standard_normal(HIDDEN).astype(np.float32)
    return measure("Q6_K output head", w.nbytes, lambda: quant.matvec(w, _type_id("Q6_K"), x, True), threads,
                   repeats)


def main() -> int:
    ap = argparse.ArgumentParser(description="decode kernels with their weights streaming from RAM, vs the RAM")
    ap.add_argument("--types", default="IQ2_XS_PLANES,IQ2_XS,Q4_K,Q8_0")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    rng = np.random.default_rng(0)
    parts = []
    for name in a.types.split(","):
        if name in MADE_FROM and not quant_planes.AVAILABLE:
            print(f"{name}: this CPU cannot run it (quant_planes.AVAILABLE is False); skipped")
            continue
        parts += [projection(name, rng, a.threads, a.repeats), moe_block(name, rng, a.threads, a.repeats)]
    parts.append(head(rng, a.threads, a.repeats))
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                                       cwd=Path(__file__).parent).stdout.strip(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "threads": a.threads, "load_average": os.getloadavg(), "parts": parts}
    md = ["# Decode kernels streaming from RAM", "",
          f"{result['date']}, commit {result['commit'][:12]}, {result['machine']}, {a.threads} threads; int8 "
          f"activations; median of {a.repeats} passes. RAM: read bandwidth right before and after each part.", "",
          "| part | weight MB a call | ms a call | GB/s | RAM GB/s (before / after) | of the RAM's rate |",
          "|---|---:|---:|---:|---|---:|"]
    for r in parts:
        calls = COPIES if "projection" in r["part"] else LAYERS if "moe" in r["part"] else 1
        md.append(f"| {r['part']} | {r['bytes'] / calls / 1e6:.2f} | {r['seconds'] * 1e3:.3f} | {r['gbps']:.1f} | "
                  f"{r['ram_gbps'][0]:.1f} / {r['ram_gbps'][1]:.1f} | {r['fraction_of_ram']:.0%} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "stream.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "stream.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
