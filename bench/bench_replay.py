"""How near the roofline a decoded token's kernels come with nothing between them: the most that removing the
Python of a decode step (a compiled decode layer) could give.

    python bench/bench_replay.py MODEL.gguf [--threads 2] [--pairs 200] [--float] [--tag NAME]

One decoded token's kernel calls (every compiled kernel Python calls, profile_decode.patched_kernels) are
recorded with their arguments, on a sequence of their own. Then, alternating token by token (which goes first
alternates too), a real decode step of another sequence and a replay of the recorded calls back to back: the
same kernels on the same weights, the Python between them gone (the architecture's glue, the Device's
dispatch, the argument checks, the buffers made per step). Each is followed at once by a read of as many bytes
as a token must read (bench_decode.PairedRead), and its fraction of that moment's roofline is the read's time
over its own. Medians over the pairs; the per-pair difference forward - replay is the Python's whole cost,
including what it does to the kernels after it (cold caches, the memory stream stopping between calls).

What the replay leaves out, so that it is a bound and not an engine: the numpy glue between the kernels (the
residual adds, a gather of the fused projection's columns: a few KB each) and the KV cache's append. Each MoE
block's input is overwritten before each replay with one of 16 permutations of the recorded one, so that the
replays' experts change as a real sequence's do (with the same experts each time, some of their bytes stay in
the last-level cache from one replay to the next). The replayed sequence's states advance with each replay; the
real one's tokens are unaffected.

Writes bench/results/replay_<tag>.json and .md (tag: the file name, with -float for --float).
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
from bench_decode import RESULTS, PairedRead, bytes_per_token, reread_from_disk, touch_pages
from profile_decode import patched_kernels
from strata_async.runtime import load_runtime


MOE_X = 17  # moe_token._moe_token's argument x: the MoE block's input
VARIANTS = 16  # inputs per MoE block that the replays take in turn


def recorded_calls(rt, prompt: np.ndarray) -> list[tuple]:
    """(kernel, arguments) of every compiled kernel call of one decode step, on a new sequence of `prompt`."""
    state = rt.new_state()
    logits = rt.forward(state, prompt, all_logits=False)
    logits = rt.forward(state, np.array([int(logits[-1].argmax())]), all_logits=False)
    calls = []

    def recorder(_name, kernel):
        def call(*args):
            calls.append((kernel, args))
            return kernel(*args)
        return call

    with patched_kernels(recorder):
        rt.forward(state, np.array([int(logits[-1].argmax())]), all_logits=False)
    return calls


def main() -> int:
    ap = argparse.ArgumentParser(description="decode steps against their kernels replayed with no Python between")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pairs", type=int, default=200, help="forward/replay pairs (default 200)")
    ap.add_argument("--float", action="store_true", help="float activations (default: int8, the integer dots)")
    ap.add_argument("--tag", default=None)
    a = ap.parse_args()
    if a.pairs < 1:
        ap.error("--pairs must be at least 1")

    reread_from_disk(a.model)
    rt = load_runtime(a.model, threads=a.threads, max_context=a.pairs + 64, quantized_activations=not a.float)
    touch_pages(a.model)
    prompt = np.arange(1, 9)
    calls = recorded_calls(rt, prompt)

    # Each replay routes its tokens to other experts: before each MoE block, its input takes one of a few
    # permutations of the recorded one (the same values, so the router's scores keep their spread). With the same
    # experts every time, a part of their bytes was found still in the last-level cache.
    rng = np.random.default_rng(0)
    moe_inputs = [(args[MOE_X], [args[MOE_X][rng.permutation(args[MOE_X].size)] for _ in range(VARIANTS)])
                  for kernel, args in calls if kernel.__name__ == "_moe_token"]
    turn = [0]

    def replay() -> None:
        turn[0] += 1
        for x, variants in moe_inputs:
            x[:] = variants[turn[0] % VARIANTS]
        for kernel, args in calls:
            kernel(*args)

    state = rt.new_state()
    logits = rt.forward(state, prompt, all_logits=False)
    for _ in range(2):  # warm-up steps
        logits = rt.forward(state, np.array([int(logits[-1].argmax())]), all_logits=False)
    replay()
    reads = PairedRead(bytes_per_token(a.model)["total"])
    clock = time.perf_counter
    kinds, steps = [], []
    for i in range(a.pairs):
        for kind in ("forward", "replay") if i % 2 == 0 else ("replay", "forward"):
            if kind == "forward":
                token = np.array([int(logits[-1].argmax())])
                t = clock()
                logits = rt.forward(state, token, all_logits=False)
            else:
                t = clock()
                replay()
            steps.append(clock() - t)
            kinds.append(kind)
            reads()
    rt.close()
    seconds = {k: [s for s, kk in zip(steps, kinds) if kk == k] for k in ("forward", "replay")}
    fractions = {k: [f for f, kk in zip(reads.fractions(steps), kinds) if kk == k] for k in ("forward", "replay")}
    read_gbps = [reads.nbytes / s / 1e9 for s in reads.seconds]
    diff = np.subtract(seconds["forward"], seconds["replay"])
    result = {
        "model": a.model, "threads": a.threads, "pairs": a.pairs, "quantized_activations": not a.float,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                                 cwd=Path(__file__).parent).stdout.strip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "kernel_calls_per_token": len(calls), "token_bytes": reads.token_bytes,
        **{f"{k}_ms": 1e3 * float(np.median(v)) for k, v in seconds.items()},
        **{f"{k}_paired_fraction": float(np.median(v)) for k, v in fractions.items()},
        "forward_minus_replay_ms": 1e3 * float(np.median(diff)),
        "forward_minus_replay_quartiles_ms": [1e3 * float(q) for q in np.percentile(diff, [25, 75])],
        "last_read_gbps": read_gbps,
        "seconds": seconds, "fractions": fractions}
    tag = a.tag or Path(a.model).stem + ("-float" if a.float else "")
    md = [f"# Decode steps against their kernels replayed: {Path(a.model).name}", "",
          f"{result['date']}, commit {result['commit'][:12]}, {result['machine']}, {a.threads} threads, "
          f"{'float' if a.float else 'int8'} activations; {a.pairs} pairs, {len(calls)} kernel calls a token; "
          f"fractions against a read of the token's {reads.token_bytes / 1e6:.1f} MB right after each step.", "",
          "| | ms a token (median) | of the moment's roofline (median) |", "|---|---:|---:|"]
    for k in seconds:
        md.append(f"| {k} | {result[f'{k}_ms']:.2f} | {result[f'{k}_paired_fraction']:.1%} |")
    q25, q75 = result["forward_minus_replay_quartiles_ms"]
    md += ["", f"forward - replay, per pair: median {result['forward_minus_replay_ms']:.3f} ms (quartiles "
           f"{q25:.3f} to {q75:.3f}). Reads {np.percentile(read_gbps, 10):.1f}-{np.percentile(read_gbps, 90):.1f} GB/s "
           "(10th-90th percentile)."]
    print("\n".join(md))
    RESULTS.mkdir(exist_ok=True)
    for suffix, text in ((".json", json.dumps(result, indent=2)), (".md", "\n".join(md))):
        (RESULTS / f"replay_{tag}{suffix}").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
