"""Per-Layer-Embedding rows from disk: O_DIRECT reads vs a memory mapping, prefetched a step ahead or not.

    python bench/bench_ple.py [--dir ~/.cache/strata-async/bench] [--size-gb 4] [--tokens 500] [--repeats 3]
                              [--compute-ms 2] [--rows-per-token 16] [--row-bytes 1440]

A synthetic table of --size-gb GiB (rows of 1440 bytes: 2560 IQ4_NL values, 18 bytes per block of 32, as in
qwen4exp's n-gram table) is written once into --dir and reused. Each run is a decode loop of --tokens steps:
the step's --rows-per-token random rows are fetched with `PLERowSource.rows`, then --compute-ms of simulated
compute (a sleep) follows; with prefetch the next step's rows are handed to `prefetch` before the compute, so
their reads overlap it. Before every run the file's pages are dropped from the page cache
(POSIX_FADV_DONTNEED), so mmap runs start cold; O_DIRECT never uses the page cache. Per run: rows/s over the
time spent waiting for rows, mean and p99 wait per token, and how much of the table the page cache holds
at the end (mincore). Reported: medians over --repeats runs.
Results: bench/results/ple_<size>gb.json and .md.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

from strata_async.io import PLERowSource

RESULTS = Path(__file__).resolve().parent / "results"
DATA_OFFSET = 96  # like a GGUF tensor: 32-byte aligned, not block aligned
CHUNK = 64 << 20


def table_file(directory: Path, size: int, row_bytes: int) -> tuple[Path, int]:
    """The synthetic table file (written once, reused while its size matches) and its row count."""
    n_rows = (size - DATA_OFFSET) // row_bytes
    path = directory / f"ple-table-{size >> 30}gib-{row_bytes}.bin"
    if path.exists() and path.stat().st_size == size:
        return path, n_rows
    directory.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(directory).free + (path.stat().st_size if path.exists() else 0)
    if free < size + (2 << 30):
        raise SystemExit(f"{directory} has {free / 2**30:.1f} GiB free; the table needs {size / 2**30:.1f} GiB plus "
                         "2 GiB to spare: pass --dir elsewhere or a smaller --size-gb")
    # Distinct bytes everywhere (no block repeats that a storage layer could deduplicate), made cheaply: one
    # random chunk, shifted by an odd constant for each chunk written.
    chunk = np.random.default_rng(0).integers(0, 1 << 63, size=CHUNK // 8, dtype=np.uint64)
    tmp = path.with_suffix(".partial")
    t = time.perf_counter()
    with open(tmp, "wb") as f:
        for start in range(0, size, CHUNK):
            chunk += np.uint64(0x9E3779B97F4A7C15)
            f.write(memoryview(chunk).cast("B")[:min(CHUNK, size - start)])
        f.flush()
        os.fsync(f.fileno())
    tmp.rename(path)
    print(f"wrote {path} ({size / 2**30:.1f} GiB) in {time.perf_counter() - t:.1f} s")
    return path, n_rows


def drop_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def cached_bytes(path: Path) -> int:
    """Bytes of the file the page cache holds now (mincore over a mapping of it)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        pages = np.frombuffer(m, np.uint8)
        resident = np.empty(-(-len(m) // mmap.PAGESIZE), np.uint8)
        rc = libc.mincore(pages.ctypes.data, len(m), resident.ctypes.data)
        del pages
    if rc != 0:
        raise OSError(ctypes.get_errno(), "mincore failed", str(path))
    return int(np.count_nonzero(resident & 1)) * mmap.PAGESIZE


def run_once(path: Path, n_rows: int, args: argparse.Namespace, mode: str, prefetch: bool, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    steps = rng.integers(0, n_rows, size=(args.tokens + 1, args.rows_per_token))
    drop_page_cache(path)
    with PLERowSource(path, DATA_OFFSET, args.row_bytes, n_rows, mode=mode, cache_rows=4 * args.rows_per_token) as src:
        t = time.perf_counter()
        if prefetch:
            src.prefetch(steps[0])
        for i in range(args.tokens):
            src.rows(steps[i])
            if prefetch:
                src.prefetch(steps[i + 1])
            time.sleep(args.compute_ms / 1e3)
        wall = time.perf_counter() - t
        s = src.stats
        return {"rows_per_s": s.rows_requested / s.wait_total_s, "wait_mean_ms": s.wait_mean_s * 1e3,
                "wait_p99_ms": s.wait_p99_s * 1e3, "wall_s": wall, "page_cache_mib": cached_bytes(path) / 2**20,
                "rows_read": s.rows_read, "cache_hits": s.cache_hits, "bytes_read": s.bytes_read}


def markdown(r: dict) -> str:
    lines = [f"# PLE rows from disk: {r['size_gib']} GiB table", "",
             f"{r['date']}, commit {r['commit'][:12]}, {r['machine']}, load average before {r['loadavg_before']}", "",
             f"Table file on {r['filesystem']} ({r['dir']}), {r['n_rows']} rows of {r['row_bytes']} bytes; "
             f"{r['tokens']} tokens per run, {r['rows_per_token']} random rows per token, "
             f"{r['compute_ms']} ms simulated compute per token; page cache dropped before each run; "
             f"medians of {r['repeats']} runs.", "",
             "| mode | prefetch | rows/s while waiting | wait/token mean (ms) | wait/token p99 (ms) | run wall (s) "
             "| table in page cache after (MiB) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for c in r["cases"]:
        m = c["median"]
        lines.append(f"| {c['mode']} | {'one step ahead' if c['prefetch'] else 'no'} | {m['rows_per_s']:,.0f} | "
                     f"{m['wait_mean_ms']:.3f} | {m['wait_p99_ms']:.3f} | {m['wall_s']:.2f} | "
                     f"{m['page_cache_mib']:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dir", type=Path, default=Path("~/.cache/strata-async/bench").expanduser())
    ap.add_argument("--size-gb", type=int, default=4, help="table file size in GiB")
    ap.add_argument("--tokens", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compute-ms", type=float, default=2.0)
    ap.add_argument("--rows-per-token", type=int, default=16)
    ap.add_argument("--row-bytes", type=int, default=1440)
    args = ap.parse_args()
    loadavg = [round(x, 2) for x in os.getloadavg()]
    path, n_rows = table_file(args.dir, args.size_gb << 30, args.row_bytes)
    cases = [(mode, prefetch) for mode in ("direct", "mmap") for prefetch in (False, True)]
    runs: dict[tuple[str, bool], list[dict]] = {c: [] for c in cases}
    for rep in range(args.repeats):  # interleaved, so drift in the machine's load hits every case alike
        for k, (mode, prefetch) in enumerate(cases):
            runs[mode, prefetch].append(run_once(path, n_rows, args, mode, prefetch, seed=1000 * rep + k))
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                 cwd=Path(__file__).parent).stdout.strip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "loadavg_before": loadavg, "dir": str(args.dir),
        "filesystem": " ".join(subprocess.run(["df", "--output=source,fstype", str(args.dir)], capture_output=True,
                                     text=True).stdout.split("\n")[1].split()),
        "size_gib": args.size_gb, "n_rows": n_rows, "row_bytes": args.row_bytes, "tokens": args.tokens,
        "rows_per_token": args.rows_per_token, "compute_ms": args.compute_ms, "repeats": args.repeats,
        "cases": [{"mode": mode, "prefetch": prefetch, "runs": runs[mode, prefetch],
                   "median": {k: float(np.median([r[k] for r in runs[mode, prefetch]]))
                              for k in ("rows_per_s", "wait_mean_ms", "wait_p99_ms", "wall_s", "page_cache_mib")}}
                  for mode, prefetch in cases],
    }
    RESULTS.mkdir(exist_ok=True)
    tag = f"ple_{args.size_gb}gb"
    (RESULTS / f"{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"{tag}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
