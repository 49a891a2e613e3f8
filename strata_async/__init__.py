"""strata-async: run huge sparse Mixture-of-Experts language models on one PC.

    import strata_async
    model = strata_async.load("model.gguf")          # or load() for the embedded (random-weight) default
    for event in model.generate("Hello", max_tokens=32, seed=0):
        print(event.text, end="", flush=True)

The public names below are imported on first use, so that `import strata_async.io` (or any other leaf
package) does not pull in the runtime and its compiled kernels.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "load": "model",
    "Model": "model",
    "GenerationEvent": "generate",
    "Timings": "generate",
    "SamplingParams": "sampling",
    "Sampler": "sampling",
    "Tokenizer": "tokenizer",
}
__all__ = ["__version__", *_PUBLIC]

if TYPE_CHECKING:
    from .generate import GenerationEvent, Timings
    from .model import Model, load
    from .sampling import Sampler, SamplingParams
    from .tokenizer import Tokenizer


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        value = getattr(importlib.import_module(f".{_PUBLIC[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'strata_async' has no attribute {name!r}")
