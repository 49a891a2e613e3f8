"""Compute kernels: Numba CPU kernels, each with a float64 reference in reference.py."""

import hashlib
import os
from pathlib import Path

# Numba's parallel kernels run on an OpenMP pool whose idle threads spin for a while (libgomp: 300,000 spins,
# a fraction of a millisecond) after each region before they sleep; a region that finds them asleep pays ~0.1 ms
# to wake them, ~3 us otherwise (measured here), and a decoded token runs dozens of regions a few tens of
# microseconds apart. So the pool keeps libgomp's default. Prompt processing once alternated a parallel tile
# decode with each BLAS product, and spinning workers fought OpenBLAS's threads (30 ns per weight instead of
# 1-5); its tiles are decoded on the calling thread now (quant.matmul). OMP_WAIT_POLICY=PASSIVE (sleep at
# once) or ACTIVE (spin without end) is honoured if set.
import numba  # noqa: E402


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
    """Whether the kernels at this location and version have been compiled before (Numba's cache holds them).

    Numba keys its cache by the source folder too, so each checkout or install compiles once; the main
    matvec kernel stands for the rest.
    """
    from . import quant_dispatch

    try:
        folder = quant_dispatch.matvec._cache.cache_path  # Numba's folder for this copy of the sources
    except AttributeError:  # a Numba without it: say nothing rather than something wrong
        return True
    return os.path.isdir(folder) and any(name.startswith("quant_dispatch.matvec-") and name.endswith(".nbi")
                                         for name in os.listdir(folder))


_key_numba_cache_by_source()
