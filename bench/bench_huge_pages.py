"""Decoded tokens with the matrices copied onto huge pages at load, against the same model computing from the file's
mapping, side by side in one process.

    cd bench && python bench_huge_pages.py /tmp/synth/synth-80b-iq2_xs.gguf [--rounds 20] [--tokens 8] [--float]

Whether the file's mapping holds 2 MiB pages depends on its page cache: a sequential read of the whole file (as
bench_decode.py makes before it measures, and a first load from the drive) leaves large folios that map as 2 MiB
pages, while pages read one at a time (an eviction under memory pressure, then faults) come back as 4 KiB. So the
comparison runs twice, with the page cache put in each state first: read back 4 KiB at a time with readahead
off, then read back sequentially. Each time two runtimes are loaded from the file, `huge_pages="never"` and
`"always"`, and decode greedy tokens in turn, the order alternating round by round (each round: the median of
`--tokens` tokens). The ratio is mapped / copied time, paired by round. With each state, the share of the file's
mapping held as 2 MiB pages (FilePmdMapped in /proc/self/smaps) is reported. Writes results/huge_pages_<file>.md
and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np
from bench_decode import RESULTS, reread_from_disk

from strata_async.io import open_gguf
from strata_async.runtime import LoadOptions, load_runtime


def reread_in_small_pages(path: str) -> None:
    """Drop the file from the page cache and read it back 4 KiB at a time with readahead off, so the cache holds
    it in single pages (as after pages were evicted and faulted back one by one)."""
    with open_gguf(path) as f:
        paths = list(f.shard_paths) or [f.path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            size = os.fstat(fd).st_size
            for offset in range(0, size, 4096):
                os.pread(fd, 4096, offset)
        finally:
            os.close(fd)


def mapped_kib(path: str) -> dict[str, int]:
    """Resident and 2 MiB-mapped KiB of this process's mappings of `path` (/proc/self/smaps)."""
    totals = {"Rss": 0, "FilePmdMapped": 0}
    name = str(Path(path).resolve())
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and not fields[0].endswith(":"):
                inside = fields[-1] == name
            elif inside and fields[0][:-1] in totals:
                totals[fields[0][:-1]] += int(fields[1])
    return totals


def decode_rounds(runtimes: dict, rounds: int, tokens: int) -> dict[str, list[float]]:
    """Per round and runtime, the median seconds of `tokens` greedy decode steps, the order alternating."""
    states = {name: [rt.new_state(), None] for name, rt in runtimes.items()}
    prompt = np.arange(1, 9)
    times: dict[str, list[float]] = {name: [] for name in runtimes}
    for r in range(rounds):
        for name in (list(runtimes) if r % 2 == 0 else list(runtimes)[::-1]):
            rt, st = runtimes[name], states[name]
            if st[1] is None or st[0].position + tokens + 1 > rt.max_context:
                st[0] = rt.new_state()
                st[1] = rt.forward(st[0], prompt, all_logits=False)
            steps = []
            for _ in range(tokens):
                token = np.array([int(st[1][-1].argmax())])
                t = time.perf_counter()
                st[1] = rt.forward(st[0], token, all_logits=False)
                steps.append(time.perf_counter() - t)
            times[name].append(float(np.median(steps)))
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description="decode with the matrices on huge pages against the file's mapping")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--float", action="store_true", help="float32 activations (default: int8, ggml's)")
    a = ap.parse_args()

    runs = []
    for cache, prepare in (("4 KiB pages", reread_in_small_pages), ("large folios", reread_from_disk)):
        prepare(a.model)
        runtimes = {mode: load_runtime(a.model, threads=a.threads, max_context=512,
                                       quantized_activations=not a.float, options=LoadOptions(huge_pages=mode))
                    for mode in ("never", "always")}
        try:
            kib = mapped_kib(a.model)  # the "never" runtime's mapping; the other's file pages were released
            times = decode_rounds(runtimes, a.rounds, a.tokens)
        finally:
            for rt in runtimes.values():
                rt.close()
        pairs = np.array(times["never"]) / np.array(times["always"])
        run = {"page_cache": cache, "mapping_kib": kib, "ms_mapped": 1e3 * float(np.median(times["never"])),
               "ms_copied": 1e3 * float(np.median(times["always"])), "ratio": float(np.median(pairs)),
               "pairs_above_1": int((pairs > 1).sum()), "rounds": a.rounds, "times": times}
        print(f"{cache}: mapping {kib['FilePmdMapped'] / max(1, kib['Rss']):.0%} on 2 MiB pages; mapped "
              f"{run['ms_mapped']:.2f} ms, copied {run['ms_copied']:.2f} ms a token, ratio {run['ratio']:.3f} "
              f"({run['pairs_above_1']} of {a.rounds} rounds above 1)", flush=True)
        runs.append(run)

    stem = Path(a.model).stem
    result = {"model": a.model, "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                       cwd=Path(__file__).parent).stdout.strip(),
              "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
              "threads": a.threads, "tokens_per_round": a.tokens, "int8": not a.float,
              "load_average": os.getloadavg(), "runs": runs}
    md = [f"# Decode with the matrices on huge pages: {stem}", "",
          f"{result['date']}, commit {result['commit'][:12]}, {result['machine']}, {a.threads} threads, "
          f"{'float32' if a.float else 'int8'} activations; two runtimes in one process (`huge_pages` never / "
          f"always), {a.rounds} rounds of {a.tokens} tokens each, alternating.", "",
          "| page cache | file mapping on 2 MiB pages | ms a token, mapped | ms a token, copied | mapped / copied "
          "(median of rounds) | rounds above 1 |", "|---|---:|---:|---:|---:|---:|"]
    for r in runs:
        share = r["mapping_kib"]["FilePmdMapped"] / max(1, r["mapping_kib"]["Rss"])
        md.append(f"| {r['page_cache']} | {share:.0%} | {r['ms_mapped']:.2f} | {r['ms_copied']:.2f} | "
                  f"{r['ratio']:.3f} | {r['pairs_above_1']} of {r['rounds']} |")
    (RESULTS / f"huge_pages_{stem}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"huge_pages_{stem}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
