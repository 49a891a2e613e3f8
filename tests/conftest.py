"""Session-wide test assets (llama.cpp's converter and quantizer, tiny checkpoints, transformers references) and
the skipping of `gpu` tests on machines without a usable CUDA device."""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from pathlib import Path

# `python -m pytest` puts the working directory, the repository root, first on sys.path. The top-level source
# folders install as strata_async.runtime/io/kernels and are never meant to be importable by their bare names
# from there: `kernels/` would shadow the `kernels` distribution that transformers (>= 5.25) imports when it
# loads, and the tests would fail to collect. Drop the root before anything imports transformers.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]

import pytest

import assets


@functools.cache
def cuda_device_usable() -> bool:
    """Whether the CUDA driver loads, initialises and reports at least one device."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    count = ctypes.c_int(0)
    return driver.cuInit(0) == 0 and driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not cuda_device_usable():
        pytest.skip("needs a usable CUDA device (none found by the CUDA driver)")


@pytest.fixture(scope="session")
def llama_cpp() -> Path:
    """llama.cpp's source tree from the llama-cpp-python sdist (converter, gguf-py, vocabulary fixtures)."""
    return assets.llama_cpp_dir()


@pytest.fixture(scope="session")
def qwen3next_dir() -> Path:
    return assets.tiny_qwen3next_dir()


@pytest.fixture(scope="session")
def qwen3moe_dir() -> Path:
    return assets.tiny_qwen3moe_dir()


@pytest.fixture(scope="session")
def qwen4exp_dir() -> Path:
    return assets.tiny_qwen4exp_dir()


@pytest.fixture(scope="session")
def qwen4exp_f32_gguf(qwen4exp_dir: Path) -> Path:
    return assets.converted_gguf(qwen4exp_dir, "f32")


@pytest.fixture(scope="session")
def qwen3next_f32_gguf(qwen3next_dir: Path) -> Path:
    return assets.converted_gguf(qwen3next_dir, "f32")


@pytest.fixture(scope="session")
def qwen3moe_f32_gguf(qwen3moe_dir: Path) -> Path:
    return assets.converted_gguf(qwen3moe_dir, "f32")


@pytest.fixture(scope="session")
def converted() -> Callable[[str, str], Path]:
    """converted(model_key, outtype="f32"): the checkpoint `model_key` (see assets.CHECKPOINTS) converted by
    llama.cpp's converter with that --outtype (f32, f16, bf16, q8_0)."""
    def convert(model_key: str, outtype: str = "f32") -> Path:
        return assets.converted_gguf(assets.checkpoint_dir(model_key), outtype)
    return convert


@pytest.fixture(scope="session")
def quantized() -> Callable[[str, str], Path]:
    """quantized(model_key, qtype): the checkpoint's f32 conversion quantized by llama-quantize (e.g. "Q4_K_M";
    use a "*_kquant" key for K-quants so that no tensor falls back to another type)."""
    def quantize(model_key: str, qtype: str) -> Path:
        return assets.quantized_gguf(assets.checkpoint_dir(model_key), qtype)
    return quantize


@pytest.fixture(scope="session")
def hf_reference_logits() -> Callable:
    """hf_reference_logits(model_dir, token_ids) -> float32 [n, vocab] from transformers (see assets)."""
    return assets.hf_reference_logits


@pytest.fixture(scope="session")
def hf_greedy_logits() -> Callable:
    """hf_greedy_logits(model_dir, prompt_ids, n_new) -> (n_new greedy token ids from transformers, the logits each
    was the argmax of) (see assets)."""
    return assets.hf_greedy_logits


@pytest.fixture
def rng():
    """A generator with a fresh seed each run (printed, so a failure can be replayed)."""
    rng, seed = assets.fresh_rng()
    print(f"random seed: {seed}")
    return rng
