"""Load test of `strata-async serve` on loopback: concurrent clients, throughput, latency, prompt-cache gain.

    python bench/bench_server.py [MODEL] [--clients 8] [--requests 2] [--max-tokens 32] [--parallel 4]

Starts a server process on 127.0.0.1 (the default model unless MODEL is given), then:

1. load: --clients connections at once, each sending --requests generate requests one after another
   (distinct prompts, greedy, --max-tokens each, prompt cache off so every prompt is computed). Reports the
   aggregate tokens/s over the phase, and p50/p99 of the time to first token and of the gap between tokens,
   both measured by the clients (a frame carrying k tokens counts as k gaps of 1/k of its interval).
2. follow-up turns: --turns conversations of a --first-tokens-token prompt and a reply, then a follow-up
   (prompt + reply + new text) sent with the prompt cache and without it. Reports the median prefill time
   of the follow-up (server timings) and the time to first token, both ways, and the tokens reused.

Bounded: every phase has a count and the whole run a --max-seconds deadline. Results go to
bench/results/server_<tag>.json and .md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from strata_async.client import Client, TokenEvent

RESULTS = Path(__file__).resolve().parent / "results"


def start_server(args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, int]:
    command = [sys.executable, "-m", "strata_async.cli", "serve", "--port", "0", "--parallel", str(args.parallel),
               "--max-queue", str(max(64, args.clients * args.requests)), "--max-requests-per-connection", "64"]
    if args.model:
        command.insert(4, args.model)
    if args.threads:
        command += ["--threads", str(args.threads)]
    with open(log, "wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                   env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start:\n{log.read_text()}")
        found = re.search(r"listening on ws://127\.0\.0\.1:(\d+)", log.read_text())
        if found:
            port = int(found.group(1))
            break
        time.sleep(0.1)
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return process, port
        except urllib.error.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not load the model:\n{log.read_text()}")
        time.sleep(0.2)


async def timed_request(client: Client, prompt, **params) -> dict:
    """One streamed request, timed at the client: ttft, per-token gaps, and the server's done event."""
    sent = time.perf_counter()
    first, last, gaps, done = None, None, [], None
    async for event in client.generate(prompt, **params):
        now = time.perf_counter()
        if isinstance(event, TokenEvent):
            n = len(event.token_ids)
            if first is None:
                first = now
                n -= 1  # the first token has no gap before it
            elif n:
                gaps += [(now - last) / n] * n
            last = now
        else:
            done = event
    return {"ttft_s": (first or time.perf_counter()) - sent, "gaps_s": gaps, "tokens": done.usage["completion_tokens"],
            "usage": done.usage, "timings": done.timings, "finish_reason": done.finish_reason}


async def load_phase(url: str, args: argparse.Namespace, deadline: float) -> dict:
    async def one_client(i: int) -> list[dict]:
        out = []
        async with await Client.connect(url) as client:
            for r in range(args.requests):
                if time.monotonic() > deadline:
                    break
                out.append(await timed_request(client, f"Client {i}, request {r}: write a function that",
                                               max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                                               cache=False))
        return out

    started = time.perf_counter()
    results = [r for rs in await asyncio.gather(*(one_client(i) for i in range(args.clients))) for r in rs]
    wall = time.perf_counter() - started
    ttft = np.array([r["ttft_s"] for r in results])
    gaps = np.array([g for r in results for g in r["gaps_s"]])
    tokens = sum(r["tokens"] for r in results)
    return {"clients": args.clients, "requests": len(results), "max_tokens": args.max_tokens, "wall_s": wall,
            "completion_tokens": tokens, "aggregate_tok_s": tokens / wall,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "gap_p50_s": float(np.percentile(gaps, 50)) if gaps.size else None,
            "gap_p99_s": float(np.percentile(gaps, 99)) if gaps.size else None,
            "finish_reasons": sorted({r["finish_reason"] for r in results})}


async def follow_up_phase(url: str, args: argparse.Namespace, deadline: float) -> dict:
    rows = []
    async with await Client.connect(url) as client:
        base = await client.tokenize("The report below lists every step of the build, with its inputs and "
                                     "outputs, in the order the steps ran. ")
        for turn in range(args.turns):
            if time.monotonic() > deadline:
                break
            marker = await client.tokenize(f" Conversation {turn}.")
            prompt = (marker + base * (args.first_tokens // len(base) + 1))[: args.first_tokens]
            first = await client.complete(prompt, max_tokens=16, temperature=0, ignore_eos=True, session=f"b{turn}")
            follow = prompt + first.token_ids + await client.tokenize(" Now summarize the failures in one line.")
            row = {"prompt_tokens": len(follow)}
            for use_cache in (False, True):  # without first, so the cached run cannot warm anything for it
                r = await timed_request(client, follow, max_tokens=8, temperature=0, ignore_eos=True,
                                        cache=use_cache, session=f"b{turn}")
                key = "cached" if use_cache else "uncached"
                row[key] = {"prefill_s": r["timings"]["prefill_s"], "ttft_s": r["ttft_s"],
                            "cached_tokens": r["usage"]["cached_tokens"]}
            rows.append(row)
    if not rows:
        return {"turns": 0}

    def median(key: str, field: str) -> float:
        return float(np.median([row[key][field] for row in rows]))

    return {"turns": len(rows), "first_prompt_tokens": args.first_tokens,
            "follow_up_prompt_tokens": int(np.median([r["prompt_tokens"] for r in rows])),
            "cached_tokens": int(np.median([r["cached"]["cached_tokens"] for r in rows])),
            "prefill_s_uncached": median("uncached", "prefill_s"), "prefill_s_cached": median("cached", "prefill_s"),
            "ttft_s_uncached": median("uncached", "ttft_s"), "ttft_s_cached": median("cached", "ttft_s")}


def markdown(result: dict) -> str:
    load, follow = result["load"], result["follow_up"]

    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{1000 * x:.1f} ms"

    lines = [f"# strata-async server load test: {result['model']}", "",
             f"{result['date']}, commit {result['commit'][:12]}, {result['machine']}, --parallel {result['parallel']}, "
             f"load average before the run {result['loadavg_before']}", "",
             "## Concurrent clients", "",
             "| clients | requests | tokens each | aggregate tok/s | TTFT p50 | TTFT p99 | gap p50 | gap p99 |",
             "|---|---|---|---|---|---|---|---|",
             f"| {load['clients']} | {load['requests']} | {load['max_tokens']} | {load['aggregate_tok_s']:.1f} | "
             f"{ms(load['ttft_p50_s'])} | {ms(load['ttft_p99_s'])} | {ms(load['gap_p50_s'])} | "
             f"{ms(load['gap_p99_s'])} |", ""]
    if follow.get("turns"):
        lines += ["## Follow-up turn (prompt + reply + new text)", "",
                  f"{follow['turns']} conversations; first prompt {follow['first_prompt_tokens']} tokens, follow-up "
                  f"{follow['follow_up_prompt_tokens']} tokens of which {follow['cached_tokens']} reused (median).", "",
                  "| | prefill | time to first token |", "|---|---|---|",
                  f"| without the prompt cache | {ms(follow['prefill_s_uncached'])} | "
                  f"{ms(follow['ttft_s_uncached'])} |",
                  f"| with the prompt cache | {ms(follow['prefill_s_cached'])} | {ms(follow['ttft_s_cached'])} |", ""]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="GGUF file (default: the embedded default model)")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=2, help="requests per client, one after another")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--turns", type=int, default=3, help="follow-up conversations")
    parser.add_argument("--first-tokens", type=int, default=512, help="tokens of each conversation's first prompt")
    parser.add_argument("--threads", type=int)
    parser.add_argument("--max-seconds", type=float, default=300, help="deadline for the whole run")
    parser.add_argument("--tag", help="results file name: bench/results/server_<tag>.json (default from the model)")
    args = parser.parse_args()
    if min(args.clients, args.requests, args.max_tokens, args.parallel, args.turns, args.first_tokens) < 1:
        parser.error("counts must be at least 1")

    deadline = time.monotonic() + args.max_seconds
    loadavg = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        process, port = start_server(args, Path(tmp) / "server.log")
        try:
            url = f"ws://127.0.0.1:{port}"
            load = asyncio.run(load_phase(url, args, deadline))
            follow = asyncio.run(follow_up_phase(url, args, deadline))
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health") as response:
                model = json.loads(response.read())["model"]
        finally:
            process.terminate()
            process.wait(30)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "unknown"
    result = {"model": model, "parallel": args.parallel, "date": time.strftime("%Y-%m-%d %H:%M"),
              "commit": commit, "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python "
                                           f"{platform.python_version()}",
              "loadavg_before": [round(x, 2) for x in loadavg], "load": load, "follow_up": follow}
    tag = args.tag or (Path(args.model).stem if args.model else "default-model")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"server_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"server_{tag}.md").write_text(markdown(result) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
