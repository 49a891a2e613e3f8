"""How fast each decode kernel can go when memory is not the limit: weights per second from the cache.

    python bench/bench_kernels.py [--rows 256] [--k 2048] [--repeats 7]

For each weight type, a matrix of --rows x --k random valid blocks small enough to stay in the L2 cache is
multiplied by a vector again and again on one thread, with float32 activations (the fused float dots) and
with int8 activations rounded as ggml rounds them (the integer dots where the type has them). Reported: ns
per weight two ways (a compiled loop over the dispatch's row dots, and quant.matvec calls from Python), and
the weight bytes per second one core consumes in the loop, next to one core's read bandwidth from RAM
(the faster of numpy's sum and Numba's vector loads over 1 GiB, best of 5 passes). Where a kernel's in-cache rate is
below the RAM rate, decode cannot reach the memory roofline whatever the memory does: the kernel's compute
is the bound.
Results: bench/results/kernels.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numba
import numpy as np
from gguf import GGMLQuantizationType as Q
from synth_gguf import _quantized_pool, random_blocks

from strata_async.kernels import quant, quant_planes
from strata_async.kernels.quant_dispatch import _FASTMATH, float_dots, int_dots, int_ready
from strata_async.kernels.quant_dot import block_sums32
from strata_async.kernels.quant_int import q8_activations
from strata_async.kernels.quant_legacy import Q2_0
from strata_async.kernels.quant_planes import IQ2_XS_PLANES
from strata_async.kernels.simd import fdot_f32_64, prefetch_l2

RESULTS = Path(__file__).resolve().parent / "results"
TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "IQ1_S", "IQ2_XXS", "IQ2_XS",
         "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "MXFP4", "Q2_0", "IQ2_XS_PLANES")
# The engine's own load-time layouts: made from the file type's random blocks (kernels/quant_planes.py).
MADE_FROM = {"IQ2_XS_PLANES": ("IQ2_XS", quant_planes.repack)}


def _type_id(name: str) -> int:
    return {"Q2_0": Q2_0, "IQ2_XS_PLANES": IQ2_XS_PLANES}.get(name) or int(getattr(Q, name))


def kernel_matrix(name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """A rows x k matrix of type `name` as the engine holds it (uint8 rows): real quantizer output where there is
    one (synth_gguf._quantized_pool), else random valid blocks; float types from normal values; the engine's
    load-time layouts (MADE_FROM) made from their file type's blocks."""
    if name in ("F32", "F16", "BF16"):
        values = rng.standard_normal((rows, k)).astype(np.float32)
        if name == "BF16":
            return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return values.astype(np.float16 if name == "F16" else np.float32).view(np.uint8)
    source, make = MADE_FROM.get(name, (name, None))
    s_t = _type_id(source)
    pool = _quantized_pool(s_t, rng)
    w = random_blocks(s_t, rows * k // quant.block_size(s_t)[0], rng, pool=pool).reshape(rows, -1)
    return make(w) if make else w


@numba.njit(parallel=True, nogil=True, fastmath=True)
def _read_vectors(a, ahead):
    """Every byte of a float32 array read in 64-byte vector loads (simd.fdot_f32_64 of each 4 KiB page with
    itself: the loads, not the multiply-adds, are the work), in 64 parallel chunks; ahead > 0: each page
    requested `ahead` bytes early into L2, as the matrix-vector kernels request their rows. (A plain Numba sum
    of uint64 words, the earlier probe here, read 5-12 GB/s: its loop was bound by instructions, not memory.)"""
    chunks = 64
    per = a.shape[0] // chunks // 1024 * 1024
    b = a.view(np.uint8)
    parts = np.zeros(chunks, np.float32)
    for c in numba.prange(chunks):
        s = np.float32(0.0)
        for page in range(c * per, (c + 1) * per, 1024):  # 4 KiB of float32
            if ahead > 0 and 4 * page + ahead + 4096 <= 4 * (c + 1) * per:
                prefetch_l2(b, 4 * page + ahead, 4096)
            v = a[page:page + 1024]
            s += fdot_f32_64(v, v, 16)
        parts[c] = s
    return parts.sum()


def _best_rate(nbytes: int, read, passes: int) -> float:
    """Bytes/s of the fastest of `passes` calls of read() over nbytes: on a shared machine other jobs only ever
    slow a pass, so the best one is the closest to what the memory can do (and the strictest roofline)."""
    read()
    best = float("inf")
    for _ in range(passes):
        t = time.perf_counter()
        read()
        best = min(best, time.perf_counter() - t)
    return nbytes / best


# The probe's two page-request settings for _read_vectors: none, and each page 32 KiB ahead as the kernels ask.
READ_AHEADS = (0, 32768)


def ram_read_gbps(threads: int, nbytes: int = 1 << 30, passes: int = 5) -> dict[str, float]:
    """GB/s read from RAM on `threads` threads over nbytes: numpy sums of float32 parts (numpy releases the GIL),
    and Numba vector loads with and without requesting each page ahead (the hardware prefetchers stop at page
    boundaries; the kernels prefetch). "best": the faster, the roofline's bandwidth."""
    numba.set_num_threads(threads)
    a = np.ones(nbytes // 4, np.float32)
    numba_gbps = max(_best_rate(a.nbytes, lambda: _read_vectors(a, ahead), passes) for ahead in READ_AHEADS) / 1e9
    parts = np.array_split(a, threads)
    if threads == 1:
        numpy_gbps = _best_rate(a.nbytes, lambda: np.sum(parts[0]), passes) / 1e9
    else:
        with ThreadPoolExecutor(threads) as pool:
            numpy_gbps = _best_rate(a.nbytes, lambda: list(pool.map(np.sum, parts)), passes) / 1e9
    return {"best": max(numba_gbps, numpy_gbps), "numpy": numpy_gbps, "numba": numba_gbps}


@numba.njit(nogil=True, fastmath=_FASTMATH)
def _int_loop(t, w, xq, xd, xs16, out, reps):
    for _ in range(reps):
        int_dots(t, w, 0, w.shape[0], xq, xd, xs16, out, 0)


@numba.njit(nogil=True, fastmath=_FASTMATH)
def _float_loop(t, w, x, xsum32, scratch, out, reps):
    for _ in range(reps):
        float_dots(t, w, 0, w.shape[0], x, xsum32, scratch, out, 0)


def loop_inputs(ggml_type: int, x: np.ndarray, act_quant: bool) -> tuple[bool, tuple]:
    """(integer, arguments) of the row dots for x as the engine gives them to this type: int8 codes, their scales
    and 16-sums (matvec_int's) where act_quant and the type has an integer dot, else float activations (rounded as
    ggml rounds them where act_quant), their sums per 32 and a scratch row."""
    if act_quant and quant.quant_dispatch.has_int_dot(ggml_type):
        xq, xd, xs16 = q8_activations(x, quant._format(ggml_type).act_block)
        return True, (int_ready(ggml_type, xq), xd, xs16)  # the codes in the type's order, as the engine does
    xa = quant.quantize_activations(x, ggml_type) if act_quant else x
    xsum32 = np.empty(max(1, xa.shape[0] // 32), np.float32)
    block_sums32(xa, xsum32)
    return False, (xa, xsum32, np.empty(xa.shape[0], np.float32))


def loop_rate(w: np.ndarray, ggml_type: int, x: np.ndarray, act_quant: bool, repeats: int) -> float:
    """Median seconds of one product in a compiled loop of 20 over the dispatch's row dots (one thread): the
    kernel alone. quant.matvec's Python call (argument checks, the output array, the activations' rounding) costs
    microseconds, as much as a 256 x 2048 product's dots for the faster types; a decoded token's products run in
    compiled calls of whole matrices and layers."""
    out = np.empty(w.shape[0], np.float32)
    integer, args = loop_inputs(ggml_type, x, act_quant)
    run = partial(_int_loop if integer else _float_loop, ggml_type, w, *args, out, 20)
    run()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run()
        times.append((time.perf_counter() - t) / 20)
    return float(np.median(times))


def matvec_rate(w: np.ndarray, ggml_type: int, x: np.ndarray, act_quant: bool, repeats: int) -> float:
    """Median seconds of one quant.matvec call from Python (one thread)."""
    quant.matvec(w, ggml_type, x, act_quant)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(20):
            quant.matvec(w, ggml_type, x, act_quant)
        times.append((time.perf_counter() - t) / 20)
    return float(np.median(times))


def main() -> int:
    ap = argparse.ArgumentParser(description="in-cache speed of the decode kernels vs one core's RAM bandwidth")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--k", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    ram = {t: ram_read_gbps(t)["best"] for t in (1, numba.config.NUMBA_NUM_THREADS)}
    numba.set_num_threads(1)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(a.k).astype(np.float32)
    rows = []
    for name in TYPES:
        t = _type_id(name)
        if name in MADE_FROM and not quant_planes.AVAILABLE:
            continue
        w = kernel_matrix(name, a.rows, a.k, rng)
        n = a.rows * a.k
        for act_quant in (False, True):
            s = loop_rate(w, t, x, act_quant, a.repeats)
            call = matvec_rate(w, t, x, act_quant, a.repeats)
            rows.append({"type": name, "activations": "int8" if act_quant else "float32",
                         "integer_dot": bool(act_quant and quant.quant_dispatch.has_int_dot(t)),
                         "ns_per_weight": s / n * 1e9, "weight_gbps_per_core": w.nbytes / s / 1e9,
                         "matvec_call_ns_per_weight": call / n * 1e9, "bytes_per_weight": w.nbytes / n})
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                                       cwd=Path(__file__).parent).stdout.strip(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "matrix": [a.rows, a.k], "ram_read_gbps": ram, "kernels": rows}
    md = ["# Decode kernels from the cache vs RAM bandwidth", "",
          f"{result['date']}, commit {result['commit'][:12]}, {result['machine']}; a {a.rows} x {a.k} matrix "
          f"(L2-resident) times a vector, one thread, median of {a.repeats} x 20 products: in a compiled loop (the "
          "kernel alone), and as quant.matvec calls from Python (each call's checks and arrays included).", "",
          f"RAM read bandwidth: {ram[1]:.1f} GB/s on one thread, "
          f"{ram[numba.config.NUMBA_NUM_THREADS]:.1f} GB/s on {numba.config.NUMBA_NUM_THREADS}.", "",
          "| type | activations | kernel | ns / weight | weight GB/s per core | vs one core's RAM rate "
          "| ns / weight, matvec call |",
          "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        fused = bool(quant.quant_dispatch.has_fused_dot(_type_id(r["type"])))
        kind = "integer dot" if r["integer_dot"] else ("fused float dot" if fused else "decode row, float dot")
        md.append(f"| {r['type']} | {r['activations']} | {kind} | {r['ns_per_weight']:.3f} | "
                  f"{r['weight_gbps_per_core']:.2f} | {r['weight_gbps_per_core'] / ram[1]:.2f}x | "
                  f"{r['matvec_call_ns_per_weight']:.3f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / "kernels.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
