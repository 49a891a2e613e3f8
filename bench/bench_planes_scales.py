"""The planes integer dot's run-scale words, the current form against the earlier one, side by side in one process.

    cd bench && python bench_planes_scales.py [--rounds 31]

`simd._planes_blocks(scale_words=False)` builds each pair of steps' scale words as the dot did before
`_pair_scale_words` (the nibbles widened, shifted and spread by two vpermw); both forms are compiled here into the
same row loop and timed alternately, so the machine's drift falls on both alike:
- from the cache: one thread, a 512 x 2048 and a 2048 x 512 matrix (L2-resident), ns a weight;
- streaming from RAM: two threads, 16 planes matrices (8192 x 2048, and 32768 x 512 shaped like the experts' down
  rows) in turn, ms a matrix.
The results must be equal to the bit (the same integer sums); the ratio is earlier / current time.
Writes results/planes_scales.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from functools import partial

import numba
import numpy as np
from bench_kernels import RESULTS, kernel_matrix

from strata_async.kernels import simd
from strata_async.kernels.quant_int import q8_activations
from strata_async.kernels.quant_iq import _IQ2XS_TABLES
from strata_async.kernels.quant_planes import AVAILABLE
from strata_async.kernels.task_queue import claimed_runs, task_counter

CURRENT, _ = simd._iq2_dots(simd._planes_blocks, simd.PLANES_BYTES, "current")
EARLIER, _ = simd._iq2_dots(partial(simd._planes_blocks, scale_words=False), simd.PLANES_BYTES, "earlier")


def _product(dot):
    """A matrix-vector product in claims of 16 rows from a counter over `workers` threads (as matvec_int)."""
    @numba.njit(parallel=True, nogil=True)
    def product(w, xq, xd, out, workers):
        counter = task_counter()
        for worker in numba.prange(workers):
            for r0, r1 in claimed_runs(counter, w.shape[0], workers, 16):
                for r in range(r0, r1):
                    out[r] = dot(_IQ2XS_TABLES, w[r], xq, xd, xq.shape[0] // 256)
    return product


def _compare(forms, matrices, xq, xd, threads: int, rounds: int) -> dict:
    """Median seconds per matrix of each form, alternating their order round by round."""
    numba.set_num_threads(threads)
    outs = {name: np.empty(matrices[0].shape[0], np.float32) for name in forms}
    for name, f in forms.items():
        f(matrices[0], xq, xd, outs[name], threads)
    if not np.array_equal(outs["earlier"], outs["current"]):
        raise SystemExit("the two forms disagree: the scale words are wrong")
    times = {name: [] for name in forms}
    names = list(forms)
    for i in range(rounds):
        for name in names[i % 2:] + names[:i % 2]:
            t0 = time.perf_counter()
            for w in matrices:
                forms[name](w, xq, xd, outs[name], threads)
            times[name].append((time.perf_counter() - t0) / len(matrices))
    return {name: float(np.median(v)) for name, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description="the planes dot's scale words: current against earlier, one process")
    ap.add_argument("--rounds", type=int, default=31)
    a = ap.parse_args()
    if not AVAILABLE:
        raise SystemExit("the planes' dots need AVX-512 VBMI, which this CPU lacks")
    rng = np.random.default_rng(0)
    forms = {"earlier": _product(EARLIER), "current": _product(CURRENT)}
    rows = []
    for where, threads, copies, shapes in (("cache", 1, 1, ((512, 2048), (2048, 512))),
                                           ("RAM", 2, 16, ((8192, 2048), (32768, 512)))):
        for n_rows, k in shapes:
            matrices = [kernel_matrix("IQ2_XS_PLANES", n_rows, k, rng) for _ in range(copies)]
            xq, xd, _ = q8_activations(rng.standard_normal(k).astype(np.float32), 256)
            reps = 1 if where == "RAM" else 20  # from the cache, several products a timing
            s = _compare(forms, matrices * reps, xq, xd, threads, a.rounds)
            rows.append({"from": where, "threads": threads, "shape": [n_rows, k], "seconds": s,
                         "ns_per_weight": {f: v / (n_rows * k) * 1e9 for f, v in s.items()},
                         "ratio": s["earlier"] / s["current"]})
            print(rows[-1], flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                       check=False).stdout.strip(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "rounds": a.rounds, "load_average": os.getloadavg(), "rows": rows}
    md = ["# The planes dot's run-scale words: current against earlier, one process", "",
          f"{result['date']}, commit {result['commit'][:12]}, {result['machine']}; int8 activations; the two forms "
          f"alternating over {a.rounds} rounds, medians; equal results to the bit.", "",
          "| from | threads | matrix | earlier | current | earlier / current |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        unit, scale = ("ns / weight", None) if r["from"] == "cache" else ("ms / matrix", 1e3)
        e, c = ((r["ns_per_weight"]["earlier"], r["ns_per_weight"]["current"]) if scale is None
                else (r["seconds"]["earlier"] * scale, r["seconds"]["current"] * scale))
        md.append(f"| {r['from']} | {r['threads']} | {r['shape'][0]} x {r['shape'][1]} | {e:.4f} {unit} | "
                  f"{c:.4f} {unit} | {r['ratio']:.3f}x |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "planes_scales.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "planes_scales.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
