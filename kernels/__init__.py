"""Compute kernels: Numba CPU kernels, each with a float64 reference in reference.py."""

import hashlib
import os
from pathlib import Path

import numba


def _key_numba_cache_by_source() -> None:
    """Point Numba's disk cache at a folder named by a hash of every kernel source.

    Numba checks only the timestamp of the file holding a cached function, not of the functions it
    calls: after an edit to a format decoder, the cached dispatch kernels would run stale code. A new
    folder per source version makes any edit here recompile everything that depends on it.
    NUMBA_CACHE_DIR, when set, is respected as is.
    """
    if os.environ.get("NUMBA_CACHE_DIR"):
        return
    digest = hashlib.sha256()
    for src in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(src.read_bytes())
    home = os.environ.get("STRATA_ASYNC_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "strata-async")
    numba.config.CACHE_DIR = os.path.join(home, "numba", digest.hexdigest()[:16])


def compiled_kernels_cached() -> bool:
    """Whether this version of the kernels has been compiled before (Numba's cache holds it)."""
    cache = numba.config.CACHE_DIR  # Numba makes the folders when kernels are defined; the index files
    # (*.nbi) appear only once something has been compiled
    return bool(cache) and any(name.endswith(".nbi") for _, _, names in os.walk(cache) for name in names)


_key_numba_cache_by_source()
