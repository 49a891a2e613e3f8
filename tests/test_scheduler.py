"""The scheduler without a model: fair admission across clients, round-robin steps, prefill chunks that stop
at snapshot boundaries, paused slots skipped. A small simulation drives it like the engine does."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from strata_async.scheduler import SlotView, Step, WaitingView, admit, next_step, prefill_chunk


def slot(request, client=0, admitted=None, last_served=-1, position=0, prefill_remaining=0, paused=False):
    return SlotView(request, client, request if admitted is None else admitted, last_served, position,
                    prefill_remaining, paused)


def test_admit_is_fifo_for_one_client():
    waiting = [WaitingView(r, 1, r) for r in (5, 3, 9)]
    assert admit(waiting, [], 2) == [3, 5]
    assert admit(waiting, [], 10) == [3, 5, 9]
    assert admit(waiting, [], 0) == []


def test_admit_shares_slots_between_clients():
    # client 1 queued six requests before client 2's single one; client 2 still gets the second slot
    waiting = [WaitingView(r, 1, r) for r in range(6)] + [WaitingView(6, 2, 6)]
    assert admit(waiting, [], 2) == [0, 6]
    # client 1 already holds two slots, client 3 none: client 3 first, then round-robin
    running = [slot(100, client=1), slot(101, client=1)]
    waiting = [WaitingView(1, 1, 1), WaitingView(2, 1, 2), WaitingView(3, 3, 3), WaitingView(4, 3, 4)]
    assert admit(waiting, running, 3) == [3, 4, 1]


def test_prefill_chunk_stops_at_snapshot_boundaries():
    assert prefill_chunk(0, 1000, 256, 64) == 64
    assert prefill_chunk(10, 1000, 256, 64) == 54
    assert prefill_chunk(64, 5, 256, 64) == 5
    assert prefill_chunk(0, 1000, 16, 64) == 16
    assert prefill_chunk(100, 1000, 256, 1000) == 256
    with pytest.raises(ValueError):
        prefill_chunk(0, 0, 256, 64)


def test_chunks_cover_the_prompt_and_hit_every_boundary():
    rng = random.Random()
    for _ in range(200):
        start, remaining = rng.randrange(0, 500), rng.randrange(1, 2000)
        chunk, interval = rng.randrange(1, 300), rng.randrange(1, 300)
        pos, end, visited = start, start + remaining, set()
        while pos < end:
            n = prefill_chunk(pos, end - pos, chunk, interval)
            assert 1 <= n <= chunk
            pos += n
            visited.add(pos)
        boundaries = {b for b in range(start + 1, end + 1) if b % interval == 0}
        assert boundaries <= visited


def test_next_step_round_robin_and_pause():
    running = [slot(1, last_served=7), slot(2, last_served=3, position=10, prefill_remaining=300),
               slot(3, last_served=5)]
    assert next_step(running, 256, 64) == Step(2, "prefill", 54)  # least recently served, up to the boundary
    assert next_step([running[0], running[2]], 256, 64) == Step(3, "decode", 1)
    paused = [slot(1, paused=True), slot(2, last_served=9)]
    assert next_step(paused, 256, 64) == Step(2, "decode", 1)
    assert next_step([slot(1, paused=True)], 256, 64) is None
    assert next_step([], 256, 64) is None
    # ties (never served) go to the earliest admitted
    assert next_step([slot(4, admitted=2), slot(5, admitted=1)], 256, 64).request == 5


def test_simulation_is_fair_and_prefill_does_not_starve_decoding():
    """Two decoding slots and one long prompt: every decoder gets a step between any two prefill chunks, and
    over a long run all slots are served equally often."""
    state = {1: [0, 0], 2: [0, 0], 3: [0, 2000]}  # request -> [position, prefill_remaining]
    last = {r: -1 for r in state}
    served = Counter()
    kinds = []
    for step_no in range(300):
        views = [slot(r, last_served=last[r], position=pos, prefill_remaining=rem) for r, (pos, rem) in state.items()]
        step = next_step(views, 128, 512)
        served[step.request] += 1
        kinds.append((step.request, step.kind))
        last[step.request] = step_no
        pos, rem = state[step.request]
        state[step.request] = [pos + step.n_tokens, rem - step.n_tokens if step.kind == "prefill" else 0]
    assert max(served.values()) - min(served.values()) <= 1
    prefill_at = [i for i, (r, k) in enumerate(kinds) if k == "prefill"]
    for a, b in zip(prefill_at, prefill_at[1:]):
        between = {r for r, _ in kinds[a + 1:b]}
        assert {1, 2} <= between
    assert state[3][1] == 0  # the long prompt got through, then decoded
