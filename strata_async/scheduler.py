"""Who runs next: which waiting requests get the free slots, and which slot's step the model computes next.

Pure data in, data out: the engine describes its slots and queue with the views below and does what the
answer says. The rules:

- Admission is fair across clients: a free slot goes to the waiting request whose client holds the fewest
  slots (counting those just handed out), the earliest arrival among equals. One client queueing fifty
  requests does not keep another client's single request waiting behind them all.
- Steps go round-robin over the running slots, least recently served first (admission order breaks ties),
  skipping slots whose client has stopped reading. A long prompt is prefilled in chunks, one chunk per turn,
  so it never stalls the decoding of the other slots for longer than one chunk.
- A prefill chunk never crosses a multiple of ``snapshot_interval``: the sequence is then exactly at each
  such position once, where the prompt cache may snapshot it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class WaitingView:
    request: int  # the engine's number for the request
    client: int  # the connection it came from
    arrival: int  # order of arrival (smaller = earlier)


@dataclass(frozen=True)
class SlotView:
    request: int
    client: int
    admitted: int  # order of admission (smaller = earlier)
    last_served: int  # the step number at which it last ran (-1: never)
    position: int  # tokens already in its state
    prefill_remaining: int  # prompt tokens not yet in its state (0: decoding)
    paused: bool = False  # its client is not reading: computing more would only pile up output


@dataclass(frozen=True)
class Step:
    request: int
    kind: Literal["prefill", "decode"]
    n_tokens: int  # tokens to feed: a prefill chunk, or 1 for a decode step


def admit(waiting: Sequence[WaitingView], running: Sequence[SlotView], free_slots: int) -> list[int]:
    """The waiting requests to start now, in order, at most ``free_slots`` of them."""
    held = Counter(s.client for s in running)
    candidates = sorted(waiting, key=lambda w: w.arrival)
    chosen: list[int] = []
    while candidates and len(chosen) < free_slots:
        best = min(range(len(candidates)), key=lambda i: (held[candidates[i].client], candidates[i].arrival))
        pick = candidates.pop(best)
        held[pick.client] += 1
        chosen.append(pick.request)
    return chosen


def prefill_chunk(position: int, remaining: int, max_chunk: int, snapshot_interval: int) -> int:
    """Tokens of the next prefill chunk: at most ``max_chunk``, ending at the next snapshot boundary at the latest."""
    if remaining < 1 or max_chunk < 1 or snapshot_interval < 1:
        raise ValueError(f"prefill_chunk needs remaining, max_chunk, snapshot_interval >= 1, got "
                         f"{remaining}, {max_chunk}, {snapshot_interval}")
    to_boundary = snapshot_interval - position % snapshot_interval
    return min(remaining, max_chunk, to_boundary)


def next_step(running: Sequence[SlotView], max_chunk: int, snapshot_interval: int) -> Step | None:
    """The step to compute next, or None when every running slot is paused (or there are none)."""
    ready = [s for s in running if not s.paused]
    if not ready:
        return None
    slot = min(ready, key=lambda s: (s.last_served, s.admitted))
    if slot.prefill_remaining > 0:
        n = prefill_chunk(slot.position, slot.prefill_remaining, max_chunk, snapshot_interval)
        return Step(slot.request, "prefill", n)
    return Step(slot.request, "decode", 1)
