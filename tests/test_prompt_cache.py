"""The prompt cache: compact state copies, longest-prefix lookup, LRU eviction within the byte capacity,
session turns superseded; and, on the default model, that a restored snapshot continues exactly like the
sequence it was taken from."""

from __future__ import annotations

import numpy as np
import pytest

import strata_async
from strata_async.prompt_cache import PromptCache, compact_copy, state_nbytes
from strata_async.runtime.state import DeltaNetState, KVCache, SequenceState

RNG = np.random.default_rng()
VOCAB = 50


def fake_state(length: int) -> SequenceState:
    """A state of one DeltaNet and one attention layer, fed `length` tokens (random contents)."""
    delta = DeltaNetState(RNG.standard_normal((3, 8), dtype=np.float32),
                          RNG.standard_normal((2, 4, 4), dtype=np.float32))
    kv = KVCache(2, 4, 4096)
    kv.append(RNG.standard_normal((length, 2, 4), dtype=np.float32), RNG.standard_normal((length, 2, 4),
                                                                                           dtype=np.float32))
    return SequenceState([delta, kv], 4096, length)


def logits() -> np.ndarray:
    return RNG.standard_normal(VOCAB, dtype=np.float32)


def snapshot_bytes(length: int) -> int:
    return (3 * 8 + 2 * 4 * 4) * 4 + 2 * length * 2 * 4 * 4 + VOCAB * 4 + length * 4


def test_compact_copy_and_nbytes():
    state = fake_state(37)
    assert state.layers[1].k.shape[0] == 256  # spare capacity that a snapshot does not keep
    copy = compact_copy(state)
    assert copy.position == 37 and copy.layers[1].length == 37 and copy.layers[1].k.shape[0] == 37
    assert state_nbytes(state) == state_nbytes(copy) == (3 * 8 + 2 * 4 * 4) * 4 + 2 * 37 * 2 * 4 * 4
    np.testing.assert_array_equal(copy.layers[1].v, state.layers[1].v[:37])
    np.testing.assert_array_equal(copy.layers[0].recurrent, state.layers[0].recurrent)
    # independent: appending to / overwriting the copy leaves the original alone
    before = state.layers[1].k[:37].copy(), state.layers[0].conv.copy()
    copy.layers[1].append(np.ones((5, 2, 4), np.float32), np.ones((5, 2, 4), np.float32))
    copy.layers[0].conv[:] = 7
    np.testing.assert_array_equal(state.layers[1].k[:37], before[0])
    np.testing.assert_array_equal(state.layers[0].conv, before[1])
    assert state.layers[1].length == 37 and copy.layers[1].length == 42


def test_lookup_finds_the_longest_matching_prefix():
    cache = PromptCache(1 << 20)
    tokens = RNG.integers(0, VOCAB, 100)
    for n in (16, 32, 48):
        assert cache.store(tokens[:n], fake_state(n), logits())
    assert cache.lookup(tokens).length == 48
    assert cache.lookup(tokens[:40]).length == 32
    assert cache.lookup(tokens[:48]).length == 48  # the whole prompt: its logits come with it
    other = tokens.copy()
    other[20] = (other[20] + 1) % VOCAB  # diverges inside the second snapshot
    assert cache.lookup(other).length == 16
    other[3] = (other[3] + 1) % VOCAB
    assert cache.lookup(other) is None
    assert cache.lookup(tokens[:10]) is None
    assert (cache.stats.hits, cache.stats.misses, cache.stats.reused_tokens) == (4, 2, 48 + 32 + 48 + 16)


def test_store_checks_the_state_position_and_keeps_one_copy():
    cache = PromptCache(1 << 20)
    tokens = RNG.integers(0, VOCAB, 20)
    with pytest.raises(ValueError, match="tokens"):
        cache.store(tokens[:19], fake_state(20), logits())
    state, row = fake_state(20), logits()
    cache.store(tokens, state, row)
    cache.store(tokens, fake_state(20), logits())  # same tokens again: kept once
    assert len(cache) == 1 and cache.nbytes == snapshot_bytes(20)
    snap = cache.lookup(tokens)
    np.testing.assert_array_equal(snap.logits, row)
    state.layers[0].recurrent[:] = 0  # the live state goes on; the snapshot does not change
    assert np.any(snap.state.layers[0].recurrent != 0)
    restored = cache.restore(snap)
    restored.layers[0].recurrent[:] = 1
    assert not np.any(cache.lookup(tokens).state.layers[0].recurrent == 1)


def test_lru_eviction_stays_within_capacity():
    capacity = 5 * snapshot_bytes(30) + 10
    cache = PromptCache(capacity)
    prompts = [RNG.integers(0, VOCAB, 30) for _ in range(8)]
    for i, tokens in enumerate(prompts[:5]):
        cache.store(tokens, fake_state(30), logits())
    assert len(cache) == 5
    cache.lookup(prompts[0])  # the oldest becomes the most recently used
    for tokens in prompts[5:]:
        cache.store(tokens, fake_state(30), logits())
        assert cache.nbytes <= capacity
    assert len(cache) == 5 and cache.stats.evicted == 3
    present = [cache.lookup(t) is not None for t in prompts]
    assert present == [True, False, False, False, True, True, True, True]
    assert not PromptCache(snapshot_bytes(30) - 1).store(prompts[0], fake_state(30), logits())


def test_a_session_keeps_its_latest_turn_only():
    cache = PromptCache(1 << 20)
    turn1 = RNG.integers(0, VOCAB, 40)
    turn2 = np.concatenate([turn1, RNG.integers(0, VOCAB, 30)])
    cache.store(turn1[:32], fake_state(32), logits())  # an interval snapshot: no session
    cache.store(turn1, fake_state(40), logits(), session="s", request=1)  # end of prompt 1
    cache.store(turn2[:60], fake_state(60), logits(), session="s", request=1)  # end of reply 1
    cache.store(turn1[:20], fake_state(20), logits(), session="other", request=2)
    assert len(cache) == 4
    cache.store(turn2, fake_state(70), logits(), session="s", request=3)  # the next turn's prompt
    assert cache.lookup(turn2[:65]).length == 32  # request 1's turn snapshots are gone, the interval one stays
    assert cache.lookup(turn1[:25]).length == 20  # another session is untouched
    assert len(cache) == 3


@pytest.fixture(scope="module")
def model():
    m = strata_async.load()
    yield m
    m.close()


def test_a_restored_snapshot_continues_exactly(model):
    """A state restored from the cache computes the same logits as the sequence it was copied from."""
    rt = model.runtime
    tokens = RNG.integers(0, model.config.vocab_size, 48)
    cache = PromptCache(64 << 20)
    live = rt.new_state()
    first = rt.forward(live, tokens[:30], all_logits=False)[-1]
    cache.store(tokens[:30], live, first)
    expected = rt.forward(live, tokens[30:], all_logits=True)  # the original sequence goes on
    snap = cache.lookup(tokens)
    assert snap.length == 30
    np.testing.assert_array_equal(snap.logits, first)
    for _ in range(2):  # restored twice: the snapshot itself is never advanced
        got = rt.forward(cache.restore(snap), tokens[30:], all_logits=True)
        np.testing.assert_array_equal(got, expected)
    assert state_nbytes(snap.state) + first.nbytes + 30 * 4 == snap.nbytes


def test_a_session_request_keeps_the_snapshot_it_started_from():
    """Regenerating the last turn: the new request restores the previous prompt-end snapshot, then stores its
    own reply; the snapshot it started from stays for the next regeneration."""
    cache = PromptCache(1 << 20)
    prompt = RNG.integers(0, VOCAB, 40)
    cache.store(prompt, fake_state(40), logits(), session="s", request=1)
    reply1 = np.concatenate([prompt, RNG.integers(0, VOCAB, 5)])
    cache.store(reply1, fake_state(45), logits(), session="s", request=1)
    assert cache.lookup(prompt, session="s", request=2).length == 40  # request 2 regenerates from the prompt
    reply2 = np.concatenate([prompt, RNG.integers(0, VOCAB, 6)])
    cache.store(reply2, fake_state(46), logits(), session="s", request=2)
    assert cache.lookup(reply1).length == 40  # request 1's reply is superseded: only the prompt is left
    assert cache.lookup(prompt).length == 40 and cache.lookup(reply2).length == 46
    assert len(cache) == 2
