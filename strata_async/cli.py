"""The `strata-async` command line: `run` a prompt through a model, `inspect` a model file.

User errors (a missing or malformed file, an unsupported architecture, a bad option) end the command with
one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson

from . import __version__

if TYPE_CHECKING:
    from .model_info import ModelInfo, RepackInfo

EXIT_USER_ERROR = 2
GIB = 1 << 30


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.command(args)
    except (OSError, ValueError) as e:  # GGUFError, TokenizerError, unsupported architecture... are ValueErrors
        print(f"strata-async: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata-async",
        description="Run huge sparse Mixture-of-Experts language models (GGUF files) on one PC.",
        epilog="Without MODEL, the embedded default model is used: a small qwen3next with random weights, "
               "built into $STRATA_ASYNC_HOME (default ~/.cache/strata-async) on first use. Its output is "
               "meaningless; it is there to try the engine out.",
    )
    parser.add_argument("--version", action="version", version=f"strata-async {__version__}")
    commands = parser.add_subparsers(title="commands", required=True, metavar="COMMAND")

    run = commands.add_parser(
        "run", help="generate text from a prompt",
        description="Generate a continuation of --prompt, streaming it to stdout; speeds go to stderr.")
    run.set_defaults(command=_run)
    run.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file (any shard of a split model)")
    run.add_argument("-p", "--prompt", required=True, help="prompt text (control tokens like <|im_start|> are parsed)")
    run.add_argument("-n", "--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    run.add_argument("--temperature", type=float, default=0.8, help="0 = greedy (default 0.8)")
    run.add_argument("--top-k", type=int, default=40, help="keep the k most likely tokens, 0 = off (default 40)")
    run.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling, 1 = off (default 0.95)")
    run.add_argument("--min-p", type=float, default=0.05,
                     help="drop tokens less likely than min-p x the most likely one, 0 = off (default 0.05)")
    run.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off (default 1.0)")
    run.add_argument("--seed", type=int, help="random seed for reproducible sampling")
    run.add_argument("--stop", nargs="+", default=[], metavar="STR",
                     help="stop before any of these strings (they are not printed)")
    run.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens")
    run.add_argument("--chat", action="store_true",
                     help="wrap the prompt as a user message in the model's chat template")
    run.add_argument("-t", "--threads", type=int, help="CPU threads (default: all)")
    run.add_argument("--max-context", type=int, help="most tokens (prompt + output) a sequence may hold "
                                                     "(default: the model's context length)")
    run.add_argument("--json", action="store_true",
                     help="print one JSON object (text, token_ids, finish_reason, timings) instead of streaming")
    add_load_options(run)

    inspect = commands.add_parser(
        "inspect", help="show a model's architecture, sizes and where each part would be placed",
        description="Show a model's architecture and sizes, and the placement table: the bytes of each part "
                    "and the tier that holds it on the CPU-only engine and in the GPU plan.")
    inspect.set_defaults(command=_inspect)
    inspect.add_argument("model", nargs="?", metavar="MODEL", help="GGUF file (any shard of a split model)")
    inspect.add_argument("--vram-gb", type=float, metavar="X",
                         help="VRAM budget in GiB for the GPU plan (a '24 GB' card holds 24 GiB)")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.add_argument("--ple-io", choices=PLE_IO_MODES, default="direct",
                         help="the n-gram table's tier to show: direct (NVMe, O_DIRECT), mmap or ram (default direct)")

    from .cli_serve import add_commands

    add_commands(commands)
    return parser


# strata_async.io.ple_rows.MODES, spelled out so --help does not import the I/O layer (tests check they agree)
PLE_IO_MODES = ("direct", "mmap", "ram")
REPACK_MODES = ("auto", "always", "never")  # runtime.weights.REPACK_MODES, without importing the runtime
HUGE_PAGE_MODES = ("auto", "always", "never")  # runtime.weights.HUGE_PAGE_MODES, likewise


def add_load_options(parser: argparse.ArgumentParser) -> None:
    """--int8-activations, --lazy-weights, and --ple-io / --ple-cache-rows: how a model's n-gram PLE table
    (qwen4exp) is read (other models ignore those two)."""
    parser.add_argument("--int8-activations", action="store_true",
                        help="round activations to int8 blocks before each quantized product, as llama.cpp does "
                             "(its numerics, not float32's): integer products, faster on most quantized files "
                             "(prompts 1.4-2x, decode up to 1.7x; see bench/README.md) (default: float32)")
    parser.add_argument("--lazy-weights", action="store_true",
                        help="map the weights without faulting their pages in at load: a faster start, but "
                             "the first use of each page (each expert's first tokens) pays a page fault, or a "
                             "drive read when the page cache lacks it (default: fault them all in at load)")
    parser.add_argument("--repack", choices=REPACK_MODES, default="auto",
                        help="IQ2_XS matrices repacked at load into a layout whose CPU products run 1.5-1.75x as fast, "
                             "at 1.43x their memory: 'auto' where the CPU has AVX-512 VBMI and the model, so "
                             "grown, fits in 80%% of the RAM; 'always' where the CPU has it; 'never' "
                             "(default: auto)")
    parser.add_argument("--huge-pages", choices=HUGE_PAGE_MODES, default="auto",
                        help="the matrices that are not repacked copied at load into memory on 2 MiB pages, "
                             "where reading them takes fewer TLB misses than the file's 4 KiB pages (decode "
                             "1.02-1.06x, see bench/README.md): 'auto' unless --lazy-weights, where the system has "
                             "transparent huge pages and the model fits in 80%% of the RAM; 'always'; 'never' "
                             "(compute from the file's mapping) (default: auto)")
    parser.add_argument("--ple-io", choices=PLE_IO_MODES, default="direct",
                        help="n-gram PLE table (qwen4exp): 'direct' reads its rows from the drive with O_DIRECT, "
                             "so the table never fills RAM or the page cache (buffered where the filesystem refuses "
                             "O_DIRECT); 'mmap' maps the file; 'ram' reads the whole table into memory at load "
                             "(default: direct)")
    parser.add_argument("--ple-cache-rows", type=int, default=4096, metavar="N",
                        help="PLE table rows kept in RAM after use, least recently used dropped first; rows "
                             "read ahead wait there too (default 4096)")


def load_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.ple_cache_rows < 1:
        raise ValueError(f"--ple-cache-rows must be at least 1, got {args.ple_cache_rows}")
    return {"ple_io": args.ple_io, "ple_cache_rows": args.ple_cache_rows, "prefault": not args.lazy_weights,
            "quantized_activations": args.int8_activations, "load_progress": _mapping_progress(),
            "repack": args.repack, "huge_pages": args.huge_pages}


def _mapping_progress() -> Callable[[int, int], None]:
    """A load_progress callback: a note at every tenth of the weights mapped in, for loads of 1 GiB or more."""
    shown = [0]

    def note(done: int, total: int) -> None:
        tenth = done * 10 // total if total >= 1 << 30 else 0
        if tenth > shown[0]:
            shown[0] = tenth
            _note(f"reading the weights in: {10 * tenth}% ({done / 1e9:.1f} of {total / 1e9:.1f} GB)")
    return note


# ---------------------------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------------------------


def _note_first_compile() -> None:
    from .kernels import compiled_kernels_cached

    if not compiled_kernels_cached():
        _note("first run of this version: compiling the CPU kernels (a few minutes; cached afterwards)")


def _run(args: argparse.Namespace) -> int:
    from .model import load  # the runtime's kernels load here, not for --help
    from .sampling import SamplingParams

    # Mistakes in the options are reported before a possibly long model load.
    if not args.prompt:
        raise ValueError("the prompt is empty: give some text with --prompt")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    options = load_options(args)
    path = _model_path(args.model)
    _note_first_compile()
    _note(f"loading {path} ({_size_of(path)}) ...")
    started = time.perf_counter()
    model = load(path, threads=args.threads, max_context=args.max_context, **options)
    with model:
        _note(f"loaded {model.name} in {time.perf_counter() - started:.1f} s")
        prompt = model.chat_prompt(args.prompt) if args.chat else args.prompt
        events = model.generate(prompt, max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos,
                                **asdict(sampling))
        texts, token_ids = [], []
        for event in events:
            if event.token_id is not None:
                token_ids.append(event.token_id)
            texts.append(event.text)
            if not args.json and event.text:
                sys.stdout.write(event.text)
                sys.stdout.flush()
        timings = event.timings
        if args.json:
            result = {"model": model.name, "text": "".join(texts), "token_ids": token_ids,
                      "finish_reason": event.finish_reason, "timings": asdict(timings)}
            sys.stdout.buffer.write(orjson.dumps(result) + b"\n")
            sys.stdout.flush()
        else:
            sys.stdout.write("\n")
            sys.stdout.flush()
            _note(f"prompt: {timings.prompt_tokens} tokens, {timings.prefill_tok_s:.1f} tok/s | "
                  f"decode: {timings.generated_tokens} tokens, {timings.decode_tok_s:.1f} tok/s | "
                  f"first token after {timings.ttft_s:.2f} s | finish: {event.finish_reason}")
            table = getattr(model.runtime.model, "ple_table", None)
            if table is not None:
                st = table.stats
                _note(f"n-gram table ({table.mode}): {st.rows_read} rows read ({st.bytes_read / 1024:.0f} KiB), "
                      f"{st.cache_hits} cache hits, wait per step mean {st.wait_mean_s * 1e3:.3f} ms, "
                      f"p99 {st.wait_p99_s * 1e3:.3f} ms")
    return 0


def _model_path(model: str | None) -> Path:
    """The model file to use; without one, the default model (said to be random weights on stderr)."""
    if model is not None:
        return Path(model)
    from .default_model import default_model_path

    _note("no MODEL given: using the embedded default model, a qwen3next with RANDOM WEIGHTS (not trained); "
          "its output is meaningless")
    return default_model_path()


def _size_of(path: Path) -> str:
    from .model_info import format_bytes

    return format_bytes(path.stat().st_size) if path.is_file() else "?"


def _note(message: str) -> None:
    print(f"strata-async: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    from .io import open_gguf
    from .model_info import describe

    if args.vram_gb is not None and args.vram_gb < 0:
        raise ValueError(f"--vram-gb must be >= 0, got {args.vram_gb}")
    vram = None if args.vram_gb is None else int(args.vram_gb * GIB)
    with open_gguf(_model_path(args.model)) as gguf:
        info = describe(gguf, vram, ple_io=args.ple_io)
    if args.json:
        sys.stdout.buffer.write(orjson.dumps(_info_json(info), option=orjson.OPT_INDENT_2) + b"\n")
    else:
        print(_info_text(info))
    return 0


def _info_json(info: ModelInfo) -> dict[str, Any]:
    table = info.placement
    out = asdict(info)
    out["placement"] = {
        "rows": [asdict(r) for r in table.rows],
        "total_bytes": table.total_bytes,
        "vram_budget": table.vram_budget,
        "vram_required": table.vram_required,
        "fits_vram": table.fits_vram,
        "expert_cache_bytes": table.expert_cache_bytes,
        "routed_expert_bytes": table.routed_expert_bytes,
    }
    return out


def _info_text(info: ModelInfo) -> str:
    from .model_info import format_bytes, format_count

    c, table = info.config, info.placement
    mtp = f" (+{info.n_mtp_layers} MTP)" if info.n_mtp_layers else ""
    lines = [info.name]
    if info.random_weights:
        lines.append("  RANDOM WEIGHTS, not trained: its output is meaningless")
    lines += [
        f"  file          {info.path} ({format_bytes(info.file_bytes)})",
        f"  architecture  {c.arch}",
        f"  layers        {c.n_layers}{mtp}, hidden {c.hidden}, vocab {c.vocab_size}, context {c.context_length}",
        f"  attention     {c.n_heads} heads, {c.n_kv_heads} KV heads, head dim {c.head_dim}",
        f"  experts       {c.n_experts} routed, {c.n_experts_used} active per token, expert FFN {c.expert_ffn}",
        f"  parameters    {format_count(info.total_params)} total, ~{format_count(info.active_params)} "
        f"active per token",
        "  tensor types  " + ", ".join(f"{t.ggml_type} x{t.n_tensors} ({format_bytes(t.nbytes)})"
                                      for t in info.tensor_types),
    ]
    if info.ngram_table is not None:
        t = info.ngram_table
        lines.append(f"  n-gram table  {format_bytes(t.nbytes)}: {t.rows} rows of {t.row_bytes} B ({t.ggml_type}), "
                     f"read by layer {t.layer} from {t.tier}")
    if info.repack is not None:
        lines.append(_repack_text(info.repack))
    lines += [
        "",
        f"  {'part':<16}{'tensors':>8}{'size':>12}  {'CPU engine':<17}GPU plan",
    ]
    for r in table.rows:
        lines.append(f"  {r.part:<16}{r.n_tensors:>8}{format_bytes(r.nbytes):>12}  {r.cpu_tier:<17}{r.gpu_tier}")
    lines.append(f"  {'total':<16}{sum(r.n_tensors for r in table.rows):>8}{format_bytes(table.total_bytes):>12}")
    lines.append("")
    lines.append(f"  GPU plan: {format_bytes(table.vram_required)} always in VRAM (plus KV cache and activations)")
    if table.vram_budget is not None:
        budget = format_bytes(table.vram_budget)
        if table.fits_vram:
            share = table.expert_cache_bytes / table.routed_expert_bytes if table.routed_expert_bytes else 1.0
            lines.append(f"  with {budget} of VRAM the expert cache holds {format_bytes(table.expert_cache_bytes)} "
                         f"of routed experts ({share:.0%})")
        else:
            lines.append(f"  does NOT fit {budget} of VRAM: the always-in-VRAM parts need "
                         f"{format_bytes(table.vram_required)}")
    return "\n".join(lines)


def _repack_text(r: RepackInfo) -> str:
    from .model_info import format_bytes
    from .runtime.weights import REPACK_RAM_SHARE

    planes = r.iq2_xs_bytes + r.held_bytes - r.file_tensor_bytes
    grown = (f"{format_bytes(r.iq2_xs_bytes)} of IQ2_XS matrices become {format_bytes(planes)} of planes: the CPU "
             f"engine holds {format_bytes(r.held_bytes)} for the file's {format_bytes(r.file_tensor_bytes)}")
    if r.auto:
        return f"  repack        {grown} (--repack auto does here)"
    if not r.cpu_can:
        why = "this CPU lacks AVX-512 VBMI"
    else:
        why = (f"the model so grown is over {REPACK_RAM_SHARE:.0%} of this machine's {format_bytes(r.ram_bytes)} "
               f"of RAM")
    return f"  repack        where repacked, {grown}; --repack auto keeps them as they lie here: {why}"


if __name__ == "__main__":
    sys.exit(main())
