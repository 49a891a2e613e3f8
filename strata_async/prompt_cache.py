"""Prompt cache: snapshots of sequence states, so a prompt that starts with earlier work skips recomputing it.

A DeltaNet layer's convolution and recurrent state cannot be rewound to an earlier position, so a
sequence can only resume from a position where its whole state was copied. The engine stores such
snapshots every ``snapshot_interval`` prompt tokens and at turn boundaries (the end of a prompt, the end
of a generation); a new request restores the longest snapshot whose tokens are a prefix of its prompt and
computes only the rest. Each snapshot also keeps the next-token logits at its position, so a prompt that
is entirely cached needs no computation at all.

Memory is bounded: snapshots are counted in bytes and the least recently used ones are evicted past the
capacity. A ``session`` (one conversation, one agent loop) keeps the turn-boundary snapshots of its
latest request only, and the one that request started from: each turn extends the previous one, whose
other snapshots the next turn no longer needs.

The cache belongs to the engine's worker thread (no locking); other threads only read its counters.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from .runtime.state import SequenceState

__all__ = ["PromptCache", "Snapshot", "compact_copy", "state_nbytes"]


def state_nbytes(state: SequenceState) -> int:
    """Bytes a compact copy of `state` holds: KV caches up to their length, every other layer array whole."""
    return state.nbytes


def compact_copy(state: SequenceState) -> SequenceState:
    """An independent copy of `state` whose KV caches hold only their filled rows.

    SequenceState.copy() also copies the KV caches' spare capacity; a snapshot does not need it, and a
    restored sequence regrows it on its next append.
    """
    return state.compact()


@dataclass(frozen=True)
class Snapshot:
    tokens: np.ndarray  # int32 [n]: the tokens fed into the state, in order (read-only)
    state: SequenceState  # compact; never fed again (restore() hands out copies)
    logits: np.ndarray  # float32 [vocab]: the next-token logits after the last of `tokens` (read-only)
    nbytes: int
    session: str | None = None
    request: int | None = None  # the engine's number of the request that stored it (turn boundaries only)

    @property
    def length(self) -> int:
        return int(self.tokens.size)


@dataclass
class CacheStats:
    hits: int = 0  # lookups that reused a snapshot
    misses: int = 0
    reused_tokens: int = 0  # prompt tokens restored instead of computed, summed over hits
    stored: int = 0
    evicted: int = 0


def _key(tokens: np.ndarray) -> tuple[int, int]:
    return tokens.size, hash(tokens.tobytes())


@dataclass
class _SessionTurns:
    request: int
    keys: list[tuple[int, int]] = field(default_factory=list)


class PromptCache:
    """Snapshots of sequence states keyed by their token prefix, least recently used evicted first."""

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"prompt cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self.nbytes = 0  # bytes of every snapshot held
        self.stats = CacheStats()
        self._entries: OrderedDict[tuple[int, int], Snapshot] = OrderedDict()  # least recently used first
        self._lengths: Counter[int] = Counter()  # snapshot lengths present, to know which prefixes to look up
        self._sessions: dict[str, _SessionTurns] = {}  # each session's latest turn-boundary snapshots

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int] | np.ndarray, *, session: str | None = None,
               request: int | None = None) -> Snapshot | None:
        """The longest snapshot whose tokens are a prefix of `prompt` (possibly all of it), or None.

        With `session` and `request`, a turn-boundary snapshot of that session found here passes to the
        request: it survives the request's own turns superseding the session's older ones.
        """
        tokens = np.asarray(prompt, dtype=np.int32).reshape(-1)
        for length in sorted((n for n in self._lengths if n <= tokens.size), reverse=True):
            key = _key(tokens[:length])
            snap = self._entries.get(key)
            if snap is not None and np.array_equal(snap.tokens, tokens[:length]):
                self._entries.move_to_end(key)
                self.stats.hits += 1
                self.stats.reused_tokens += length
                if session is not None and request is not None and snap.session == session:
                    snap = self._supersede(session, request, keep=key) or snap
                return snap
        self.stats.misses += 1
        return None

    def store(self, tokens: Sequence[int] | np.ndarray, state: SequenceState, logits: np.ndarray, *,
              session: str | None = None, request: int | None = None) -> bool:
        """Keep a snapshot of `state`, which has been fed exactly `tokens`; `logits` are its next-token logits.

        With `session` and `request` it is a turn boundary of that session: storing one for a newer request
        of the session drops the session's older turn-boundary snapshots. Returns False when the snapshot
        alone exceeds the capacity (nothing is stored then).
        """
        tokens = np.array(tokens, dtype=np.int32).reshape(-1)
        if tokens.size != state.position or tokens.size == 0:
            raise ValueError(f"a snapshot needs the {state.position} tokens its state was fed, got {tokens.size}")
        key = _key(tokens)
        if session is not None and request is not None:
            self._supersede(session, request)
        existing = self._entries.get(key)
        if existing is not None and np.array_equal(existing.tokens, tokens):
            self._entries.move_to_end(key)
            return True
        logits = np.array(logits, dtype=np.float32).reshape(-1)
        nbytes = state_nbytes(state) + logits.nbytes + tokens.nbytes
        if nbytes > self.capacity_bytes:
            return False
        if existing is not None:  # a hash collision with other tokens: the newer snapshot wins
            self._drop(key)
        while self.nbytes + nbytes > self.capacity_bytes:
            self._drop(next(iter(self._entries)))
            self.stats.evicted += 1
        tokens.flags.writeable = False
        logits.flags.writeable = False
        self._entries[key] = Snapshot(tokens, compact_copy(state), logits, nbytes, session, request)
        self._lengths[tokens.size] += 1
        self.nbytes += nbytes
        self.stats.stored += 1
        if session is not None and request is not None:
            self._sessions.setdefault(session, _SessionTurns(request)).keys.append(key)
        return True

    @staticmethod
    def restore(snapshot: Snapshot) -> SequenceState:
        """A fresh state at the snapshot's position, to be fed from there (the snapshot stays untouched)."""
        return compact_copy(snapshot.state)

    def _supersede(self, session: str, request: int, keep: tuple[int, int] | None = None) -> Snapshot | None:
        """Drop the session's turn-boundary snapshots of older requests, except `keep`, which passes to `request`
        (and is returned)."""
        turns = self._sessions.get(session)
        if turns is None or turns.request == request:
            return None
        for key in list(turns.keys):
            if key != keep:
                self._drop(key)
        if keep is None or keep not in self._entries:
            return None
        kept = self._entries[keep] = replace(self._entries[keep], request=request)
        self._sessions[session] = _SessionTurns(request, [keep])
        return kept

    def _drop(self, key: tuple[int, int]) -> None:
        snap = self._entries.pop(key)
        self.nbytes -= snap.nbytes
        self._lengths[snap.length] -= 1
        if not self._lengths[snap.length]:
            del self._lengths[snap.length]
        turns = self._sessions.get(snap.session) if snap.session is not None else None
        if turns is not None and turns.request == snap.request and key in turns.keys:
            turns.keys.remove(key)
            if not turns.keys:
                del self._sessions[snap.session]
