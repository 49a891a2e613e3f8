"""The best fraction of the memory roofline a decoded token can reach here: memory or the cores' compute, type by type.

    python bench/bench_bound.py MODEL.gguf [--threads 2] [--gbps 36 60] [--repeats 9] [--profile PROFILE.json]

The roofline (bench_decode.py) prices a decoded token at its file bytes over the RAM's read rate. Whether a
token can come near it depends on the cores too: each weight type's products take at least the longer of
- memory: the bytes the engine reads for them (IQ2_XS as it holds it: repacked into planes, 1.43x the bytes,
  where it repacks) over the read rate;
- compute: their weights times the kernel's time a weight with every thread busy and the weights in the cache
  (each thread its own L2-resident matrix, the compiled loop over the dispatch's row dots that bench_kernels
  times on one thread).
The products of one type run one after another, so the sum over types of the longer of the two is a floor on a
token's time that no scheduling or prefetching beats, and the roofline over it the highest fraction of the
roofline a token can reach. It is a generous floor: of the work outside the products it counts only the
gated-DeltaNet states' traffic (no attention, norms, activation rounding or Python; --profile adds a profiled
token's measured time for those), and it times the MoE blocks' short down rows (512 values) at the rate of rows
of the matrices measured here (--k values).

The floor is given at the read rate measured now (the faster of numpy's and Numba's, best of 5 passes) and at
each --gbps: a shared machine's decode runs meet very different moments (34-65 GB/s on the 2-core machine of
bench/results), and on few cores the fast ones are where compute binds. Float32 and int8 activations (the
integer dots, quantized_activations=True) each get their floor.
Results: bench/results/bound_<tag>.json and .md (tag: the file's name).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from collections import defaultdict
from pathlib import Path

import numba
import numpy as np
from bench_decode import token_tensors
from bench_kernels import _type_id, kernel_matrix, loop_inputs, ram_read_gbps
from bench_stream import timed
from gguf import GGMLQuantizationType as Q
from strata_async.io import open_gguf
from strata_async.kernels import quant  # first: the format modules import each other through it
from strata_async.kernels.quant_dispatch import _FASTMATH, float_dots, int_dots
from strata_async.kernels.quant_iq import IQ2_XS
from strata_async.runtime.archs import qwen3next
from strata_async.runtime.weights import IQ2_XS_GROWTH, ROW_TABLES, repacks_iq2_xs

RESULTS = Path(__file__).resolve().parent / "results"
STATE = "DeltaNet state"
_MATRIX_BYTES = 256 << 10  # each thread's matrix: well inside its core's L2 (1-2 MiB on current x86 cores)


@numba.njit(parallel=True, nogil=True, fastmath=_FASTMATH)
def _int_loops(t, ws, xq, xd, xs16, outs, reps):
    for i in numba.prange(ws.shape[0]):  # one matrix per thread
        for _ in range(reps):
            int_dots(t, ws[i], 0, ws.shape[1], xq, xd, xs16, outs[i], 0)


@numba.njit(parallel=True, nogil=True, fastmath=_FASTMATH)
def _float_loops(t, ws, x, xsum32, scratches, outs, reps):
    for i in numba.prange(ws.shape[0]):
        for _ in range(reps):
            float_dots(t, ws[i], 0, ws.shape[1], x, xsum32, scratches[i], outs[i], 0)


def cached_ns_per_weight(name: str, threads: int, k: int, act_quant: bool, repeats: int,
                         rng: np.random.Generator) -> float:
    """ns a weight of type `name` with `threads` threads each multiplying its own cached matrix by a vector of k
    values, the fastest of `repeats` runs of 20 products each (other jobs on a shared machine only ever slow a run,
    and a floor must not be set by them): the rate of the whole machine, not of one core."""
    t = _type_id(name)
    block_elems, block_bytes = quant.block_size(t)
    rows = max(16, min(256, _MATRIX_BYTES // (k // block_elems * block_bytes) // 16 * 16))
    ws = np.stack([kernel_matrix(name, rows, k, rng) for _ in range(threads)])
    outs = np.empty((threads, rows), np.float32)
    integer, args = loop_inputs(t, rng.standard_normal(k).astype(np.float32), act_quant)
    if integer:
        def run():
            _int_loops(t, ws, *args, outs, 20)
    else:
        x, xsum32, _ = args
        scratches = np.empty((threads, x.shape[0]), np.float32)

        def run():
            _float_loops(t, ws, x, xsum32, scratches, outs, 20)
    return timed(run, repeats, min) / (20 * threads * rows * k) * 1e9


def token_reads(path: str) -> tuple[dict[str, dict[str, float]], bool]:
    """Per weight type as the engine holds it: file bytes, bytes read and weights of a decoded token's products
    (bench_decode.token_tensors; the token embedding is a row look-up, left out), and whether IQ2_XS is repacked
    (--repack auto, this machine)."""
    reads: dict[str, dict[str, float]] = defaultdict(lambda: {"file_bytes": 0, "held_bytes": 0, "weights": 0})
    with open_gguf(path) as f:
        repacked = repacks_iq2_xs(f, "auto")
        for name, t, read, of in token_tensors(f):
            if name in ROW_TABLES:
                continue
            kind = Q(t.ggml_type).name if t.ggml_type != IQ2_XS or not repacked else "IQ2_XS_PLANES"
            r = reads[kind]
            r["file_bytes"] += t.data.nbytes * read / of
            r["held_bytes"] += t.data.nbytes * read / of * (IQ2_XS_GROWTH if kind == "IQ2_XS_PLANES" else 1)
            r["weights"] += int(np.prod(t.shape)) * read / of
        state = recurrent_state_bytes(f)
    if state:
        reads[STATE] = {"file_bytes": 0, "held_bytes": 2 * state, "weights": 0}  # read, then written
    return dict(reads), repacked


def recurrent_state_bytes(f) -> int:
    """Bytes of the gated-DeltaNet recurrent states (runtime.state.DeltaNetState: float32 [v heads, k dim, v dim]
    a layer) of the layers a token runs, from the open GGUF f's qwen3next config (0 for other architectures): a
    token reads and rewrites them all, memory traffic the file-byte roofline does not count (the cache cannot hold
    them while the weights stream through it)."""
    if f.metadata["general.architecture"] != qwen3next.ARCH:
        return 0
    c = qwen3next.Qwen3NextConfig.from_gguf(f)
    return sum(c.recurrent) * c.deltanet.n_v_heads * c.deltanet.k_dim * c.deltanet.v_dim * 4


def floor(reads: dict[str, dict[str, float]], ns: dict[str, float], gbps: float) -> dict:
    """The floor of a token's time at gbps: per type the longer of memory and compute (ms), and the ceiling it puts
    on the roofline fraction."""
    parts = {}
    for kind, r in reads.items():
        memory, compute = r["held_bytes"] / gbps / 1e6, r["weights"] * ns[kind] / 1e6
        parts[kind] = {"memory_ms": memory, "compute_ms": compute, "bound": "compute" if compute > memory else "memory"}
    floor_ms = sum(max(p["memory_ms"], p["compute_ms"]) for p in parts.values())
    roofline_ms = sum(r["file_bytes"] for r in reads.values()) / gbps / 1e6
    return {"gbps": gbps, "roofline_ms": roofline_ms, "floor_ms": floor_ms, "ceiling": roofline_ms / floor_ms,
            "types": parts}


def measured_extra_ms(profile: str) -> float:
    """ms of a profiled token (profile_decode.py's json) that the floor leaves out: the time outside the kernels,
    and the attention and DeltaNet kernels' (which take the place of the floor's DeltaNet state row: their time
    includes that traffic)."""
    p = json.loads(Path(profile).read_text())
    mixers = sum(ms for k, ms in p["kernels_ms"].items() if k.startswith(("deltanet.", "attention.")))
    return p["outside_kernels_ms"] + mixers


def markdown(r: dict) -> str:
    lines = [f"# How near the roofline a decoded token of {Path(r['model']).name} can come", "",
             f"{r['date']}, commit {r['commit'][:12]}, {r['machine']}, {r['threads']} threads"
             f"{'; IQ2_XS repacked into planes' if r['iq2_xs_repacked'] else ''}. Each type's kernel timed with "
             f"every thread on its own cached matrix ({r['k']} values a row; the fastest of {r['repeats']} x 20 "
             "products).", "",
             "| type | MB read a token (file) | weights a token (M) | ns / weight, float32 | ns / weight, int8 |",
             "|---|---:|---:|---:|---:|"]
    for kind, t in r["reads"].items():
        rates = [f"{r['ns_per_weight'][act][kind]:.4f}" if t["weights"] else "-" for act in ("float32", "int8")]
        lines.append(f"| {kind} | {t['held_bytes'] / 1e6:.1f} ({t['file_bytes'] / 1e6:.1f}) | {t['weights'] / 1e6:.1f} "
                     f"| {rates[0]} | {rates[1]} |")
    measured = r["measured_extra_ms"] is not None
    lines += ["", "| read rate | activations | roofline ms | floor ms | ceiling (% of roofline) | compute-bound types |"
              + (" ceiling with the profile's measured extra |" if measured else ""),
              "|---|---|---:|---:|---:|---|" + ("---:|" if measured else "")]
    for f in r["floors"]:
        bound = ", ".join(k for k, p in f["types"].items() if p["bound"] == "compute") or "none"
        lines.append(f"| {f['gbps']:.1f} GB/s{' (now)' if f['now'] else ''} | {f['activations']} | "
                     f"{f['roofline_ms']:.2f} | {f['floor_ms']:.2f} | {100 * f['ceiling']:.1f}% | {bound} |"
                     + (f" {100 * f['ceiling_with_measured']:.1f}% |" if measured else ""))
    if measured:
        lines += ["", f"Measured extra ({r['profile']}): {r['measured_extra_ms']:.2f} ms a token outside the kernels "
                  "and in the attention and DeltaNet kernels, in place of the floor's DeltaNet state row."]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description="the floor of a decoded token's time from memory and the cores' compute, "
                                             "and the highest fraction of the memory roofline it allows")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--gbps", type=float, nargs="*", default=[36.0, 60.0],
                    help="read rates to give the floor at besides the one measured now (default: 36 60)")
    ap.add_argument("--k", type=int, default=2048, help="values a row of the timed matrices (default 2048)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--profile", default=None,
                    help="a profile_decode.py result: its measured time outside the kernels and in the DeltaNet and "
                         "attention kernels is added to each floor in a second ceiling")
    ap.add_argument("--tag", default=None)
    a = ap.parse_args()
    reads, repacked = token_reads(a.model)
    now = ram_read_gbps(a.threads)["best"]
    numba.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    ns = {act: {kind: cached_ns_per_weight(kind, a.threads, a.k, act == "int8", a.repeats, rng) if r["weights"]
                else 0.0 for kind, r in reads.items()} for act in ("float32", "int8")}
    floors = [{**floor(reads, ns[act], gbps), "activations": act, "now": gbps == now}
              for gbps in [now, *a.gbps] for act in ("float32", "int8")]
    extra_ms = measured_extra_ms(a.profile) if a.profile else None
    if extra_ms is not None:
        for f in floors:
            state = f["types"].get(STATE, {"memory_ms": 0.0})["memory_ms"]
            f["ceiling_with_measured"] = f["roofline_ms"] / (f["floor_ms"] - state + extra_ms)
    result = {"model": a.model, "threads": a.threads, "k": a.k, "repeats": a.repeats,
              "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                                       cwd=Path(__file__).parent).stdout.strip(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "iq2_xs_repacked": repacked, "read_gbps_now": now, "reads": reads, "ns_per_weight": ns,
              "profile": a.profile, "measured_extra_ms": extra_ms, "floors": floors}
    tag = a.tag or Path(a.model).stem
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"bound_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (RESULTS / f"bound_{tag}.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
