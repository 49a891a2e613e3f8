"""Tasks handed out from a shared counter (kernels/task_queue.py): each task goes to exactly one worker whatever
the number of workers, the counter's add is atomic, and the kernels that share their work this way give the
same bits with one worker, with one per thread, and with more workers than threads."""

import gguf
import numba
import numpy as np
import pytest

from strata_async.kernels import quant
from strata_async.kernels.deltanet import gated_delta_rule_chunked
from strata_async.kernels.grouped_codes import _down_codes, _gate_up_codes
from strata_async.kernels.int_matmul import _matmul_codes, quantize_tokens
from strata_async.kernels.quant_dispatch import matvec_int, matvec_int_serial
from strata_async.kernels.task_queue import (CLAIMS_PER_WORKER, EXPERT_CLAIMS_PER_WORKER, claim_size, claimed_runs,
                                             expert_unit, fetch_add, next_task, publish, task_counter,
                                             wait_for, worker_count)

from test_kernels_int_matmul import random_activations, random_rows

Q = gguf.GGMLQuantizationType


@numba.njit(parallel=True, cache=False)
def _hand_out(n_tasks, workers, counter, owner, taken):
    for worker in numba.prange(workers):
        task = next_task(counter)
        while task < n_tasks:
            owner[task] = worker
            taken[task] += 1
            task = next_task(counter)


@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_every_task_goes_to_one_worker(workers):
    n = 5000
    owner = np.full(n, -1, np.int64)
    taken = np.zeros(n, np.int64)
    counter = task_counter()
    _hand_out(n, workers, counter, owner, taken)
    assert np.all(taken == 1)
    assert np.all((owner >= 0) & (owner < workers))
    assert counter[0] == n + workers  # each worker asked once more and stopped


@numba.njit(parallel=True, cache=False)
def _hand_out_runs(n, workers, unit, counter, owner, taken):
    for worker in numba.prange(workers):
        for first, end in claimed_runs(counter, n, workers, unit):
            for i in range(first, end):
                owner[i] = worker
                taken[i] += 1


@pytest.mark.parametrize("workers, unit", [(1, 1), (2, 1), (2, 16), (5, 16)])
def test_every_run_goes_to_one_worker(workers, unit):
    for n in (1, 17, 1000, 4099):
        owner = np.full(n, -1, np.int64)
        taken = np.zeros(n, np.int64)
        counter = task_counter()
        _hand_out_runs(n, workers, unit, counter, owner, taken)
        assert np.all(taken == 1)
        per = claim_size(n, workers, unit)
        for first in range(0, n, per):  # a run is one worker's
            assert np.all(owner[first:first + per] == owner[first])
        assert counter[0] == -(-n // per) + workers


@numba.njit(parallel=True, cache=False)
def _add_in_parallel(counter, adds, v):
    for i in numba.prange(adds):
        fetch_add(counter, 1, v)


@numba.njit(cache=False)
def _fetch_add(counter, i, v):
    return fetch_add(counter, i, v)


def test_fetch_add_is_atomic_and_returns_the_old_value():
    counter = np.array([7, 100, 9], np.int64)
    assert _fetch_add(counter, 0, 5) == 7 and counter[0] == 12
    _add_in_parallel(counter, 200_000, 3)  # lost updates between the threads would leave less
    assert counter.tolist() == [12, 100 + 600_000, 9]


@numba.njit(parallel=True, cache=False)
def _two_phases(n_groups, per_group, workers, values, sums, out, sync):
    """Phase 1 writes values in groups; the worker that finishes a group sums it and publishes it ready; phase 2's
    tasks each wait for their group and read its sum."""
    first_queue, second_queue = task_counter(), task_counter()
    for worker in numba.prange(workers):
        task = next_task(first_queue)
        while task < n_groups * per_group:
            values[task] = task * 3 + 1
            g = task // per_group
            if publish(sync, 2 * g, 1) + 1 == per_group:  # this worker finished group g: every value is written
                total = 0
                for i in range(g * per_group, (g + 1) * per_group):
                    total += values[i]
                sums[g] = total
                publish(sync, 2 * g + 1, 1)
            task = next_task(first_queue)
        task = next_task(second_queue)
        while task < n_groups:
            wait_for(sync, 2 * task + 1, 1)
            out[task] = sums[task]
            task = next_task(second_queue)


@pytest.mark.parametrize("workers", [1, 2, 3, 8])
def test_published_outputs_reach_waiting_workers(workers):
    """A count made complete with publish hands the writes before it to a worker that waits for it (wait_for),
    with any number of workers, two taking turns on a thread included (no wait is for an unclaimed task)."""
    n_groups, per_group = 300, 7
    expected = [sum(i * 3 + 1 for i in range(g * per_group, (g + 1) * per_group)) for g in range(n_groups)]
    for _ in range(20):
        values, sums = np.zeros(n_groups * per_group, np.int64), np.zeros(n_groups, np.int64)
        out, sync = np.full(n_groups, -1, np.int64), np.zeros(2 * n_groups, np.int64)
        _two_phases(n_groups, per_group, workers, values, sums, out, sync)
        assert out.tolist() == expected
        assert sync[0::2].tolist() == [per_group] * n_groups and sync[1::2].tolist() == [1] * n_groups


@pytest.mark.parametrize("unit", [1, 16])
@pytest.mark.parametrize("workers", [1, 2, 5])
def test_claim_size(unit, workers):
    for n in (1, 15, 16, 17, 100, 4096, 151936):
        per = claim_size(n, workers, unit)
        assert per >= unit and per % unit == 0
        assert -(-n // per) <= workers * CLAIMS_PER_WORKER  # no more claims than asked for
        if per > unit:  # claims no larger than needed for that many
            assert -(-n // (per - unit)) > workers * CLAIMS_PER_WORKER


@pytest.mark.parametrize("workers", [1, 2, 3, 16])
def test_expert_claims(workers):
    for k in (1, 4, 8, 10, 11, 64):
        for per_expert in (1, 32, 40, 128):
            n = k * per_expert
            unit = expert_unit(per_expert, k, workers)
            per = claim_size(n, workers, unit)
            if k >= EXPERT_CLAIMS_PER_WORKER * workers:  # whole experts: no claim splits one
                assert unit == per_expert and per % per_expert == 0
            else:  # shares of experts, enough claims for every worker
                assert 1 <= unit <= per_expert
                assert -(-n // per) >= min(n, EXPERT_CLAIMS_PER_WORKER * workers)


@pytest.fixture
def threads():  # restores Numba's thread count after the test
    before = numba.get_num_threads()
    yield
    numba.set_num_threads(before)


@numba.njit(cache=False)
def _workers(workers):
    return worker_count(workers)


def test_worker_count_reads_the_calling_threads_count(threads):
    for count in (1, 2):
        numba.set_num_threads(count)
        assert _workers(0) == count
        assert _workers(3) == 3


def test_products_equal_for_any_worker_count(rng):
    t, rows, k = int(Q.Q4_K), 150, 512
    w = random_rows(rng, t, rows, k)
    x = quantize_tokens(random_activations(rng, 21, k), t, quant.activation_block(t))
    results = []
    for workers in (1, 2, 5):
        out = np.empty((21, rows), np.float32)
        _matmul_codes(t, w, x.q, x.d, x.s, out, 2, workers)
        results.append(out)
    v = random_activations(rng, 1, k)[0]
    for workers in (2, 7):
        out = np.empty(rows, np.float32)
        matvec_int(t, w, v, 256, out, workers)
        serial = np.empty(rows, np.float32)
        matvec_int_serial(t, w, v, 256, serial)
        np.testing.assert_array_equal(out, serial)
    for r in results[1:]:
        np.testing.assert_array_equal(r, results[0])


def test_grouped_experts_equal_for_any_worker_count(rng):
    t, n_experts, ffn, hidden = int(Q.IQ2_XS), 6, 48, 256
    gate = np.stack([random_rows(rng, t, ffn, hidden) for _ in range(n_experts)])
    up = np.stack([random_rows(rng, t, ffn, hidden) for _ in range(n_experts)])
    down = np.stack([random_rows(rng, int(Q.Q4_K), hidden, 256) for _ in range(n_experts)])
    group_experts = np.array([0, 2, 3, 5], np.int64)
    group_starts = np.array([0, 3, 4, 11, 13], np.int64)
    x = quantize_tokens(random_activations(rng, 13, hidden), t, quant.activation_block(t))
    hx = quantize_tokens(random_activations(rng, 13, 256), int(Q.Q4_K), 256)
    hs, ys = [], []
    for workers in (1, 2, 3):
        h = np.empty((13, ffn), np.float32)
        _gate_up_codes(t, gate, t, up, x.q, x.d, x.s, group_experts, group_starts, h, workers)
        y = np.empty((13, hidden), np.float32)
        _down_codes(int(Q.Q4_K), down, hx.q, hx.d, hx.s, group_experts, group_starts, y, workers)
        hs.append(h)
        ys.append(y)
    for h, y in zip(hs[1:], ys[1:]):
        np.testing.assert_array_equal(h, hs[0])
        np.testing.assert_array_equal(y, ys[0])


def test_delta_rule_equal_on_one_and_two_threads(rng, threads):
    n, hk, hv, dk, dv = 70, 2, 6, 32, 16
    q = rng.standard_normal((n, hk, dk)).astype(np.float32) / 6
    k = rng.standard_normal((n, hk, dk)).astype(np.float32) / 6
    v = rng.standard_normal((n, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, (n, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (n, hv)).astype(np.float32)
    outs = []
    for count in (1, 2):
        numba.set_num_threads(count)
        state = np.zeros((hv, dk, dv), np.float32)
        outs.append((gated_delta_rule_chunked(q, k, v, g, beta, state, chunk=16), state))
    np.testing.assert_array_equal(outs[0][0], outs[1][0])
    np.testing.assert_array_equal(outs[0][1], outs[1][1])
