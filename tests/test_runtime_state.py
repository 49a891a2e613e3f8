"""Per-sequence state: the KV cache grows past its first allocation without losing rows, and copies are
independent snapshots; and the host device's default worker count."""

import os
import subprocess

import numba
import numpy as np
import pytest

from strata_async.runtime.device import HostDevice, physical_cores
from strata_async.runtime.state import DeltaNetState, KVCache, SequenceState


def test_kv_cache_grows_and_keeps_every_row():
    rng = np.random.default_rng()
    cache = KVCache(n_kv_heads=2, head_dim=8, max_context=1000)
    ks, vs = [], []
    for n in (1, 200, 1, 130, 300, 7):  # crosses the first allocation and several doublings
        k, v = (rng.standard_normal((n, 2, 8)).astype(np.float32) for _ in range(2))
        cache.append(k, v)
        ks.append(k)
        vs.append(v)
    assert cache.length == sum(len(k) for k in ks)
    np.testing.assert_array_equal(cache.k[: cache.length], np.concatenate(ks))
    np.testing.assert_array_equal(cache.v[: cache.length], np.concatenate(vs))
    assert cache.k.shape[0] <= cache.max_context
    with pytest.raises(ValueError, match="at most 1000 positions"):
        cache.append(*(rng.standard_normal((1000 - cache.length + 1, 2, 8)).astype(np.float32) for _ in range(2)))


def test_state_copy_is_independent():
    rng = np.random.default_rng()
    cache = KVCache(n_kv_heads=1, head_dim=4, max_context=64)
    cache.append(rng.standard_normal((3, 1, 4)).astype(np.float32), rng.standard_normal((3, 1, 4)).astype(np.float32))
    delta = DeltaNetState.zeros(conv_kernel=4, conv_channels=6, n_v_heads=2, k_dim=3, v_dim=5)
    delta.recurrent[...] = rng.standard_normal(delta.recurrent.shape)
    state = SequenceState([cache, delta], max_context=64, position=3)

    snap = state.copy()
    recurrent_before = delta.recurrent.copy()
    state.layers[0].append(np.ones((1, 1, 4), np.float32), np.ones((1, 1, 4), np.float32))
    state.layers[1].recurrent += 1.0
    state.layers[1].conv += 1.0
    state.position += 1

    assert (snap.position, snap.layers[0].length) == (3, 3)
    np.testing.assert_array_equal(snap.layers[0].k[:3], cache.k[:3])
    np.testing.assert_array_equal(snap.layers[1].recurrent, recurrent_before)
    assert not snap.layers[1].conv.any()


def test_workers_default_to_physical_cores():
    """One worker per physical core: counted against lscpu's view of the topology (SMT siblings share a core)."""
    listing = subprocess.run(["lscpu", "-p=CPU,CORE,SOCKET"], capture_output=True, text=True, check=True).stdout
    allowed = os.sched_getaffinity(0)
    cores = {(socket, core) for cpu, core, socket in
             (line.split(",") for line in listing.splitlines() if line and not line.startswith("#"))
             if int(cpu) in allowed}
    assert physical_cores() == len(cores)
    assert HostDevice().threads == min(len(cores), numba.config.NUMBA_NUM_THREADS)
    assert HostDevice(threads=1).threads == 1
