"""The command line, run as a user runs it (a subprocess): run --json on the default model, inspect's table,
and one-line errors with exit status 2 for user mistakes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import orjson
import pytest

from strata_async.default_model import build_default_model
from strata_async.io import write_gguf


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    """A private STRATA_ASYNC_HOME holding the default model (built there as on first use)."""
    path = tmp_path_factory.mktemp("home")
    from strata_async.default_model import DEFAULT_MODEL_VERSION

    build_default_model(path / f"default-qwen3next-v{DEFAULT_MODEL_VERSION}.gguf")
    return path


def cli(home, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "STRATA_ASYNC_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "strata_async.cli", *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.slow
def test_int8_activations_option(home):
    """--int8-activations reaches the model (ggml-rounded activations): a greedy run works and says so in --help."""
    proc = cli(home, "run", "--prompt", "hi", "--max-tokens", "4", "--json", "--temperature", "0",
               "--int8-activations")
    assert proc.returncode == 0, proc.stderr
    assert 1 <= len(orjson.loads(proc.stdout)["token_ids"]) <= 4
    assert "--int8-activations" in cli(home, "run", "--help").stdout
    from strata_async.cli import _parser, load_options

    for argv, want in ((["run", "-p", "x"], False), (["run", "-p", "x", "--int8-activations"], True)):
        assert load_options(_parser().parse_args(argv))["quantized_activations"] is want


@pytest.mark.slow
def test_run_json_on_the_default_model(home):
    proc = cli(home, "run", "--prompt", "hi", "--max-tokens", "8", "--json", "--seed", "5")
    assert proc.returncode == 0, proc.stderr
    result = orjson.loads(proc.stdout)
    assert set(result) >= {"text", "token_ids", "finish_reason", "timings"}
    assert 1 <= len(result["token_ids"]) <= 8
    assert result["finish_reason"] in ("stop", "length")
    assert result["finish_reason"] == "stop" or len(result["token_ids"]) == 8
    timings = result["timings"]
    assert timings["prompt_tokens"] >= 1 and timings["prefill_tok_s"] > 0 and timings["ttft_s"] > 0
    assert timings["generated_tokens"] == len(result["token_ids"])
    assert {"decode_tok_s", "prefill_tok_s", "ttft_s", "prompt_tokens"} <= set(timings)
    assert "random weights" in proc.stderr.lower()
    assert "Traceback" not in proc.stderr


def test_inspect_shows_architecture_and_placement_table(home):
    proc = cli(home, "inspect", "--vram-gb", "24")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "random weights" in out.lower() and "random weights" in proc.stderr.lower()
    for needle in ("qwen3next", "layers        4 (+1 MTP)", "16 routed, 4 active", "Q8_0", "vocab 896"):
        assert needle in out, needle
    for part, cpu, gpu in (("dense", "host RAM", "VRAM"), ("routed experts", "host RAM", "pinned host RAM"),
                           ("embeddings", "host RAM", "host RAM"), ("MTP layer", "host RAM", "VRAM")):
        line = next(line for line in out.splitlines() if line.strip().startswith(part))
        assert cpu in line and line.rstrip().endswith(gpu), line
    assert "expert cache holds" in out and "(100%)" in out


def test_inspect_json(home):
    proc = cli(home, "inspect", "--json", "--vram-gb", "0.0001")
    assert proc.returncode == 0, proc.stderr
    info = orjson.loads(proc.stdout)
    assert info["config"]["arch"] == "qwen3next" and info["random_weights"] is True
    table = info["placement"]
    assert sum(r["nbytes"] for r in table["rows"]) == table["total_bytes"]
    assert table["fits_vram"] is False and table["vram_budget"] == int(0.0001 * (1 << 30))


def test_help_describes_commands(home):
    proc = cli(home, "--help")
    assert proc.returncode == 0 and "run" in proc.stdout and "inspect" in proc.stdout
    proc = cli(home, "run", "--help")
    assert proc.returncode == 0 and "--temperature" in proc.stdout and "--stop" in proc.stdout


def _assert_user_error(proc: subprocess.CompletedProcess, fragment: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("strata-async: error:") and fragment in last, last


def test_missing_file(home, tmp_path):
    _assert_user_error(cli(home, "inspect", str(tmp_path / "nope.gguf")), "No such file")
    _assert_user_error(cli(home, "run", str(tmp_path / "nope.gguf"), "--prompt", "x"), "No such file")


def test_not_a_gguf_file(home, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(np.random.default_rng().integers(0, 256, 4096, dtype=np.uint8).tobytes())
    _assert_user_error(cli(home, "inspect", str(bad)), "not a GGUF file")


def test_unknown_architecture(home, tmp_path):
    path = tmp_path / "other.gguf"
    write_gguf(path, {"general.architecture": "mamba9"}, [("token_embd.weight", 0, (4, 32), np.ones((4, 32), np.float32))])
    _assert_user_error(cli(home, "inspect", str(path)), "mamba9")
    _assert_user_error(cli(home, "run", str(path), "--prompt", "x"), "mamba9")


def test_bad_options(home):
    _assert_user_error(cli(home, "run", "--prompt", "", "--max-tokens", "2"), "prompt is empty")
    _assert_user_error(cli(home, "run", "--prompt", "hi", "--temperature", "-1"), "temperature")
    _assert_user_error(cli(home, "inspect", "--vram-gb", "-3"), "--vram-gb")
    proc = cli(home, "run")  # argparse: --prompt is required
    assert proc.returncode == 2 and "--prompt" in proc.stderr


@pytest.mark.slow
def test_ple_table_options_on_a_qwen4exp_file(home, qwen4exp_f32_gguf):
    """inspect names the n-gram table's size and tier for each --ple-io; run gives the same greedy tokens
    whichever tier serves the table (and with the weights mapped lazily), and reports the table's counters."""
    for mode, tier in (("direct", "NVMe (O_DIRECT)"), ("mmap", "NVMe (mmap)"), ("ram", "host RAM")):
        proc = cli(home, "inspect", str(qwen4exp_f32_gguf), "--ple-io", mode)
        assert proc.returncode == 0, proc.stderr
        line = next(line for line in proc.stdout.splitlines() if "n-gram table" in line and "rows of" in line)
        assert line.endswith(f"from {tier}") and "4096 rows of 64 B (F32)" in line
    info = orjson.loads(cli(home, "inspect", str(qwen4exp_f32_gguf), "--json").stdout)
    assert info["ngram_table"]["rows"] == 4096 and info["ngram_table"]["layer"] == 1
    runs = {}
    for mode in ("direct", "ram"):
        proc = cli(home, "run", str(qwen4exp_f32_gguf), "-p", "one two three", "-n", "6", "--temperature", "0",
                   "--ple-io", mode, "--ple-cache-rows", "8", *(["--lazy-weights"] if mode == "ram" else []))
        assert proc.returncode == 0, proc.stderr
        assert f"n-gram table ({mode}):" in proc.stderr
        runs[mode] = proc.stdout
    assert runs["direct"] == runs["ram"]
    _assert_user_error(cli(home, "run", str(qwen4exp_f32_gguf), "-p", "x", "--ple-cache-rows", "0"),
                       "--ple-cache-rows must be at least 1")


def test_ple_io_choices_are_the_row_source_modes():
    from strata_async.cli import PLE_IO_MODES
    from strata_async.io.ple_rows import MODES
    from strata_async.runtime.placement import NGRAM_TIERS

    assert PLE_IO_MODES == MODES == tuple(NGRAM_TIERS)


def test_repack_choices_are_the_weight_store_modes():
    from strata_async.cli import REPACK_MODES
    from strata_async.runtime.weights import REPACK_MODES as STORE_MODES

    assert REPACK_MODES == STORE_MODES


def test_mapping_progress_notes_each_tenth_of_large_loads(capsys):
    from strata_async.cli import _mapping_progress

    note, total = _mapping_progress(), 10 << 30
    for done in range(total // 40, total + 1, total // 40):
        note(done, total)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("in: ")[1].split("%")[0] for line in lines] == [str(10 * k) for k in range(1, 11)]
    small = _mapping_progress()
    for done in (1 << 20, 100 << 20):
        small(done, 100 << 20)
    assert capsys.readouterr().err == ""
