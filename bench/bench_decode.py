"""Decode and prefill speed of the CPU engine on a GGUF file, against this machine's memory roofline.

    python bench/bench_decode.py MODEL.gguf [--threads 2] [--decode-tokens 8] [--prompt 512] [--repeats 3]

Measures, all with the same thread count:
- read bandwidth: the faster of numpy sums over a 1 GiB array split over --threads threads and Numba vector loads
  (bench_kernels.ram_read_gbps; one-thread numpy sum recorded next to it), best of several passes, before
  and after the runs;
- bytes that must be read per decoded token: every tensor a token touches (mixers, routers, norms,
  shared experts, output head) in full, the routed experts at top-k / n_experts of their size, one
  embedding row; the multi-token-prediction block is not run by plain decoding and is not counted;
- roofline: bandwidth / bytes per token, and the fraction of it the engine reaches; also against the bandwidth
  probed between the decode runs (their median), since on a shared machine the best probe comes from the
  quietest moment and the decode runs may not; and step by step, each decode step against a read of as many
  bytes right after it (PairedRead; runs of their own), the median of the steps' fractions;
- strata-async decode tokens/s (median over single-token steps after a short prompt) and prefill
  tokens/s on a --prompt-token prompt (median of --prefill-repeats), twice: with float32 activations (the
  reference numerics, the default) and with activations rounded to int8 blocks as ggml does
  (quantized_activations=True: integer dots for every quantized type);
- IQ2_XS files run as the engine loads them by default: repacked into IQ2_XS_PLANES where the CPU has AVX-512 VBMI
  (--repack never: as they lie); the bytes a token reads as the engine holds them are recorded next to the file's;
- llama.cpp (llama-cpp-python) on the same file and threads when it is installed, alternating with
  strata-async repeat by repeat, and the ratio.
Results: bench/results/decode_<tag>.json and .md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from strata_async.io import open_gguf
from strata_async.kernels import quant  # noqa: F401 - first: the format modules import each other through it
from strata_async.kernels.quant_iq import IQ2_XS
from strata_async.runtime import LoadOptions, load_runtime
from strata_async.runtime.weights import IQ2_XS_GROWTH, REPACK_MODES, repacks_iq2_xs

from bench_kernels import READ_AHEADS, _read_vectors, ram_read_gbps

RESULTS = Path(__file__).resolve().parent / "results"


def read_bandwidth(threads: int) -> dict[str, float]:
    """GB/s this machine reads from RAM (bench_kernels.ram_read_gbps, best pass) on `threads` threads and on one:
    "parallel_gbps", the roofline's, is the faster of numpy's and Numba's on `threads` threads."""
    many, one = ram_read_gbps(threads), ram_read_gbps(1)
    return {"parallel_gbps": many["best"], "numpy_gbps": many["numpy"], "numba_gbps": many["numba"],
            "numpy_1thread_gbps": one["numpy"]}


def token_tensors(f) -> Iterator[tuple[str, object, int, int]]:
    """(name, tensor, read, of) for every tensor of the open GGUF f that a decoded token reads: read/of of it is
    read (the routed experts: top-k of n_experts; 1/1 otherwise). The multi-token-prediction block is not run by
    plain decoding and is left out; the token embedding is listed whole (a token reads one row of it)."""
    md = f.metadata
    arch = md["general.architecture"]
    n_layers = int(md[f"{arch}.block_count"]) - int(md.get(f"{arch}.nextn_predict_layers", 0))
    used, n_experts = int(md[f"{arch}.expert_used_count"]), int(md[f"{arch}.expert_count"])
    for name, t in f.tensors.items():
        if name.startswith("blk.") and int(name.split(".")[1]) >= n_layers:
            continue
        yield (name, t, used, n_experts) if "_exps." in name else (name, t, 1, 1)


def bytes_per_token(path: str, iq2_xs_growth: float = 1.0) -> dict[str, int]:
    """Bytes a decoded token must read from the file, by kind of tensor; with iq2_xs_growth, those of IQ2_XS
    tensors times it (as the engine holds them repacked)."""
    parts = {"routed_experts": 0, "output_head": 0, "embedding_row": 0, "other": 0}
    with open_gguf(path) as f:
        for name, t, read, of in token_tensors(f):
            size = round(t.data.nbytes * iq2_xs_growth) if t.ggml_type == IQ2_XS else t.data.nbytes
            if "_exps." in name:
                parts["routed_experts"] += size * read // of
            elif name == "token_embd.weight":
                parts["embedding_row"] += t.row_bytes  # looked up as it lies
            elif name == "output.weight":
                parts["output_head"] += size
            else:
                parts["other"] += size
    parts["total"] = sum(parts.values())
    return parts


def reread_from_disk(path: str) -> None:
    """Drop the model's files from the page cache and read them back in one sequential pass, before any mapping
    of them is made: the cache then holds them as it does after a model's first read from disk. A file the bench
    has just written (synth_gguf.py) stays cached as written, in 4 KiB pages where the read path makes large
    folios that map as 2 MiB pages; decoding the 80B-shaped Q4_K file took 20.9-22.0 ms a token with the first
    and 18.0-18.1 with the second (its Q6_K head 10.9-11.7 -> 8.7 ms), so the state is made the same every run."""
    with open_gguf(path) as f:
        paths = list(f.shard_paths) or [f.path]
    buffer = bytearray(16 << 20)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # pages mapped elsewhere stay
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while f.readinto(buffer):
                pass


def touch_pages(path: str) -> None:
    """Read one byte of every 4 KiB page of the file's tensors through a mapping of our own, so the kernel's
    page cache holds the whole file (as after a while of serving) and first-touch disk reads stay out of
    the timings. (strata-async then maps its pages in at load, llama.cpp too: MAP_POPULATE.)"""
    with open_gguf(path) as f:
        for t in f.tensors.values():
            int(np.asarray(t.data).reshape(-1)[::4096].sum())


def strata_decode(rt, prompt: np.ndarray, n_tokens: int, after_step=None) -> list[float]:
    """Seconds per greedy decode step after prefilling `prompt`; after_step() (untimed) after each step."""
    state = rt.new_state()
    logits = rt.forward(state, prompt, all_logits=False)
    times = []
    for _ in range(n_tokens):
        token = np.array([int(logits[-1].argmax())])
        t = time.perf_counter()
        logits = rt.forward(state, token, all_logits=False)
        times.append(time.perf_counter() - t)
        if after_step is not None:
            after_step()
    return times


class PairedRead:
    """A read of one token's bytes from RAM after each decode step: the roofline of that moment.

    On a shared machine the memory's pace moves from minute to minute (best probes of 1 GiB between decode runs
    31-58 GB/s within an hour here), so a fraction of a roofline probed at another moment moves with it. Each
    decode step is followed at once by a read of as many bytes as the step must read (the bytes_per_token total),
    with the probe's Numba vector loads (bench_kernels._read_vectors; pages requested 32 KiB ahead and not, the
    faster of the two), from a buffer of its own that the step's weights have pushed out of the caches. A step's
    fraction is the read's time over the step's: how near the memory of that instant the step came."""

    def __init__(self, nbytes: int):
        self.token_bytes = nbytes
        self.buffer = np.ones(nbytes // 4, np.float32)
        self.nbytes = self.buffer.nbytes // (64 * 4096) * (64 * 4096)  # what _read_vectors reads: 64 whole-page parts
        for ahead in READ_AHEADS:
            _read_vectors(self.buffer, ahead)  # compiled, the pages faulted in
        self.seconds: list[float] = []

    def __call__(self) -> None:
        best = float("inf")
        for ahead in READ_AHEADS:
            t = time.perf_counter()
            _read_vectors(self.buffer, ahead)
            best = min(best, time.perf_counter() - t)
        self.seconds.append(best)

    def fractions(self, steps: list[float]) -> list[float]:
        """Each step's fraction of its moment's roofline (steps as strata_decode returned them with this as
        after_step)."""
        return [read * self.token_bytes / self.nbytes / step for read, step in zip(self.seconds, steps, strict=True)]


def strata_prefill(rt, prompt: np.ndarray) -> float:
    state = rt.new_state()
    t = time.perf_counter()
    rt.forward(state, prompt, all_logits=False)
    return time.perf_counter() - t


def _llama_model(path: str, threads: int, n_ctx: int, extra_buffers: bool):
    """A llama_cpp.Llama on the CPU; extra_buffers=False turns its extra weight buffer types off (the repacked
    and AMX layouts: use_extra_bufts, which llama-cpp-python does not take as an argument)."""
    import llama_cpp  # optional dependency: imported only when asked for
    import llama_cpp.llama as llama_module

    defaults = llama_module.llama_cpp.llama_model_default_params

    def params():
        p = defaults()
        p.use_extra_bufts = extra_buffers
        return p

    llama_module.llama_cpp.llama_model_default_params = params
    try:
        return llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=512,
                               n_gpu_layers=0, verbose=False)
    finally:
        llama_module.llama_cpp.llama_model_default_params = defaults


_LLAMA_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
from bench_decode import _llama_model
llm = _llama_model(sys.argv[2], int(sys.argv[3]), 256, sys.argv[4] == "1")
llm.eval(list(range(100, 164)))
llm.eval([7])
"""


def llama_extra_buffers(path: str, threads: int) -> bool | None:
    """Whether llama.cpp runs this file with its extra buffer types (its default), without them (they crashed:
    0.3.36 built for a CPU with AMX dies in its first prompt on a qwen3next file), or not at all (None): a
    64-token prompt and one decoded token in a child process each way, so a crash does not end the bench."""
    for extra in (True, False):
        probe = subprocess.run([sys.executable, "-c", _LLAMA_PROBE, str(Path(__file__).resolve().parent), path,
                                str(threads), "1" if extra else "0"], capture_output=True, check=False)
        if probe.returncode == 0:
            return extra
        print(f"llama.cpp {'with' if extra else 'without'} its extra buffer types failed on this file "
              f"(exit status {probe.returncode})", file=sys.stderr)
    return None


class LlamaCpp:
    """llama.cpp through llama-cpp-python, if installed (the comparison is skipped otherwise)."""

    def __init__(self, path: str, threads: int, n_ctx: int, extra_buffers: bool = True):
        self.llm = _llama_model(path, threads, n_ctx, extra_buffers)

    def decode(self, prompt: np.ndarray, n_tokens: int) -> list[float]:
        self.llm.reset()
        self.llm.eval(prompt.tolist())
        times = []
        for _ in range(n_tokens):
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            t = time.perf_counter()
            self.llm.eval([token])
            times.append(time.perf_counter() - t)
        return times

    def prefill(self, prompt: np.ndarray) -> float:
        self.llm.reset()
        t = time.perf_counter()
        self.llm.eval(prompt.tolist())
        return time.perf_counter() - t


def markdown(r: dict) -> str:
    ll = r.get("llama_cpp")
    rows = [f"# Decode/prefill: {Path(r['model']).name}", "",
            (f"{r['date']}, commit {r['commit'][:12]}, {r['machine']}, {r['threads']} threads, "
            f"load average before {r['loadavg_before']}"), "",
            "| | strata-async | llama.cpp | ratio | % of roofline |", "|---|---|---|---|---|"]

    def row(label: str, s: dict, key: str) -> str:
        mine = s[key]
        theirs = ll[key] if ll else None
        ratio = f"{mine / theirs:.2f}x" if theirs else "not run"
        roof = f"{100 * mine / r['roofline_tok_s']:.1f}%" if key == "decode_tok_s" else ""
        return f"| {label} | {mine:.2f} | {f'{theirs:.2f}' if theirs else 'not run'} | {ratio} | {roof} |"

    prefill = f"prefill tok/s ({r['prompt_tokens']} tokens)"
    for mode, key in (("float activations", "strata_async"), ("int8 activations", "strata_async_int8")):
        rows += [row(f"decode tok/s, {mode}", r[key], "decode_tok_s"),
                 row(f"{prefill}, {mode}", r[key], "prefill_tok_s")]
    bw = r["bandwidth"]
    rows += ["", (f"- read bandwidth: {bw['parallel_gbps']:.1f} GB/s ({r['threads']} threads, the faster of numpy "
             f"{bw.get('numpy_gbps', bw['parallel_gbps']):.1f} and Numba {bw.get('numba_gbps', 0):.1f}; numpy "
             f"1 thread {bw['numpy_1thread_gbps']:.1f} GB/s)"),
             (f"- bytes per decoded token: {r['bytes_per_token']['total'] / 1e6:.1f} MB "
             f"(routed experts {r['bytes_per_token']['routed_experts'] / 1e6:.1f}, output head "
             f"{r['bytes_per_token']['output_head'] / 1e6:.1f}, other {r['bytes_per_token']['other'] / 1e6:.1f})"),
             (f"- roofline: {r['roofline_tok_s']:.1f} tok/s; strata-async reaches "
             f"{100 * r['roofline_fraction']:.1f}% of it (float activations), "
             f"{100 * r['roofline_fraction_int8']:.1f}% (int8 activations)")]
    if r.get("iq2_xs_repacked"):
        rows.append(f"- IQ2_XS repacked at load to IQ2_XS_PLANES (kernels/quant_planes.py): a token reads "
                    f"{r['bytes_per_token_held']['total'] / 1e6:.1f} MB as the engine holds it; the roofline "
                    f"counts the file's bytes")
    if r.get("llama_cpp_extra_buffer_types") is False:
        rows.append("- llama.cpp ran without its extra weight buffer types (repacked and AMX layouts): with them it "
                    "crashed on this file")
    if "bandwidth_during_decode_gbps" in r:
        rows.append(f"- read bandwidth between the decode runs: "
                    f"{', '.join(f'{g:.1f}' for g in r['bandwidth_during_decode_gbps'])} GB/s (best of 2 passes "
                    f"each), roofline at their median {r['roofline_during_decode_tok_s']:.1f} tok/s: strata-async "
                    f"reaches {100 * r['roofline_during_decode_fraction']:.1f}% of it (float activations), "
                    f"{100 * r['roofline_during_decode_fraction_int8']:.1f}% (int8 activations)")
    if "paired_read" in r:
        parts = []
        for key, mode in (("strata_async", "float activations"), ("strata_async_int8", "int8 activations")):
            p = r["paired_read"][key]
            parts.append(f"{100 * p['fraction']:.1f}% ({mode}; reads {min(p['read_gbps']):.1f}-"
                         f"{max(p['read_gbps']):.1f} GB/s)")
        rows.append("- each decode step against a read of its bytes right after it (median of the steps' "
                    "fractions, runs of their own): " + ", ".join(parts))
    return "\n".join(rows) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description="decode/prefill tokens/s and the memory roofline")
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--decode-tokens", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=512, help="prefill prompt length")
    ap.add_argument("--repeats", type=int, default=3, help="decode runs (each --decode-tokens steps)")
    ap.add_argument("--prefill-repeats", type=int, default=5)
    ap.add_argument("--no-llama", action="store_true", help="skip llama.cpp even if it is installed")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--repack", choices=REPACK_MODES, default="auto",
                    help="IQ2_XS as IQ2_XS_PLANES (the default where the CPU can) or as it lies in the file")
    a = ap.parse_args()

    loadavg = [round(x, 2) for x in os.getloadavg()]
    bandwidth = read_bandwidth(a.threads)
    per_token = bytes_per_token(a.model)
    reread_from_disk(a.model)
    options = LoadOptions(repack=a.repack)
    rt = load_runtime(a.model, threads=a.threads, max_context=a.prompt + a.decode_tokens + 16, options=options)
    rt_int8 = load_runtime(a.model, threads=a.threads, max_context=a.prompt + a.decode_tokens + 16,
                           quantized_activations=True, options=options)
    with open_gguf(a.model) as f:
        repacked = repacks_iq2_xs(f, a.repack)
    held = bytes_per_token(a.model, IQ2_XS_GROWTH if repacked else 1.0)
    rng = np.random.default_rng(0)  # ids below 1000: real (unpadded) tokens of any vocabulary
    short_prompt = rng.integers(0, 1000, 8)
    long_prompt = rng.integers(0, 1000, a.prompt)
    llama, llama_extra = None, None
    if not a.no_llama and importlib.util.find_spec("llama_cpp") is not None:
        llama_extra = llama_extra_buffers(a.model, a.threads)
        if llama_extra is not None:
            llama = LlamaCpp(a.model, a.threads, a.prompt + a.decode_tokens + 16, llama_extra)

    touch_pages(a.model)
    # Warm up both engines on the paths they time: kernels compiled or loaded from Numba's cache, worker threads
    # started, llama.cpp's compute buffers allocated. A 128-token piece takes the prompt paths (tiles for BLAS,
    # grouped experts), which the first timed prefill had otherwise paid for.
    for r in (rt, rt_int8):
        strata_decode(r, short_prompt[:2], 1)
        strata_prefill(r, long_prompt[:128])
    if llama:
        llama.prefill(long_prompt[:128])
    mine = {"decode": [], "prefill": []}
    mine_int8 = {"decode": [], "prefill": []}
    theirs = {"decode": [], "prefill": []}
    during = []  # the read bandwidth between the decode runs: the memory as the decode steps found it
    for _ in range(a.repeats):  # alternate the engines so drift in machine load hits both alike
        mine["decode"] += strata_decode(rt, short_prompt, a.decode_tokens)
        mine_int8["decode"] += strata_decode(rt_int8, short_prompt, a.decode_tokens)
        during.append(ram_read_gbps(a.threads, passes=2)["best"])
        if llama:
            theirs["decode"] += llama.decode(short_prompt, a.decode_tokens)
    for _ in range(a.prefill_repeats):
        mine["prefill"].append(strata_prefill(rt, long_prompt))
        mine_int8["prefill"].append(strata_prefill(rt_int8, long_prompt))
        if llama:
            theirs["prefill"].append(llama.prefill(long_prompt))

    # Each decode step against a read of its bytes right after it (PairedRead), on runs of their own so the
    # decode runs above stay as every earlier result measured them.
    paired = {}
    for key, r in (("strata_async", rt), ("strata_async_int8", rt_int8)):
        reads = PairedRead(per_token["total"])
        steps = []
        for _ in range(a.repeats):
            steps += strata_decode(r, short_prompt, a.decode_tokens, after_step=reads)
        fractions = reads.fractions(steps)
        paired[key] = {"fraction": float(np.median(fractions)), "fractions": fractions, "decode_step_s": steps,
                       "read_gbps": [reads.nbytes / t / 1e9 for t in reads.seconds]}
        del reads

    after = read_bandwidth(a.threads)  # before and after the runs, the faster of each: the machine's, not its load
    bandwidth = {k: max(v, after[k]) for k, v in bandwidth.items()}

    def summary(times: dict[str, list[float]]) -> dict:
        return {"decode_tok_s": 1.0 / float(np.median(times["decode"])),
                "prefill_tok_s": a.prompt / float(np.median(times["prefill"])),
                "decode_step_s": times["decode"], "prefill_s": times["prefill"]}

    roofline = bandwidth["parallel_gbps"] * 1e9 / per_token["total"]
    result = {
        "model": str(a.model), "threads": a.threads, "prompt_tokens": a.prompt,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False,
                                 cwd=Path(__file__).parent).stdout.strip(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}",
        "loadavg_before": loadavg, "bandwidth": bandwidth, "bytes_per_token": per_token,
        "iq2_xs_repacked": repacked, "bytes_per_token_held": held,
        "roofline_tok_s": roofline,
        "strata_async": summary(mine),
        "strata_async_int8": summary(mine_int8),
        "llama_cpp": summary(theirs) if llama else None,
        "llama_cpp_extra_buffer_types": llama_extra,
    }
    result["roofline_fraction"] = result["strata_async"]["decode_tok_s"] / roofline
    result["roofline_fraction_int8"] = result["strata_async_int8"]["decode_tok_s"] / roofline
    # The roofline above takes the best probe of the quietest moment; on a shared machine the decode runs meet
    # other moments, so the same fraction against the bandwidth measured between them is reported next to it.
    result["bandwidth_during_decode_gbps"] = during
    result["roofline_during_decode_tok_s"] = float(np.median(during)) * 1e9 / per_token["total"]
    for key, suffix in (("strata_async", ""), ("strata_async_int8", "_int8")):
        result[f"roofline_during_decode_fraction{suffix}"] = (result[key]["decode_tok_s"]
                                                               / result["roofline_during_decode_tok_s"])
    result["paired_read"] = paired
    if llama:
        for key, suffix in (("strata_async", ""), ("strata_async_int8", "_int8")):
            for what in ("decode", "prefill"):
                result[f"{what}_ratio_vs_llama_cpp{suffix}"] = (result[key][f"{what}_tok_s"]
                                                                / result["llama_cpp"][f"{what}_tok_s"])
    tag = a.tag or Path(a.model).stem
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"decode_{tag}.json").write_text(json.dumps(result, indent=2) + "\n")
    (RESULTS / f"decode_{tag}.md").write_text(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
