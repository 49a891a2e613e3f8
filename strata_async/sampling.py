"""Token sampling: turn one row of logits into the next token id.

The chain follows llama.cpp's default sampler order (common/common.h, `samplers`; the steps themselves in
src/llama-sampler.cpp), limited to the steps exposed here:

    repetition penalty -> top-k -> top-p -> min-p -> temperature -> draw

- repetition penalty: each of the last `penalty_last_n` tokens seen (prompt and generated) has its logit
  divided by the penalty when positive, multiplied by it when negative (the usual fix so that a penalty
  always makes a token less likely).
- top-k keeps the k highest logits (ties broken towards the lower token id).
- top-p keeps the shortest run of the most likely tokens whose probabilities (softmax of the logits as they
  are at this point, i.e. *before* temperature) add up to at least p.
- min-p keeps tokens whose probability is at least min_p times the most likely one's, again before
  temperature: logit >= max_logit + log(min_p).
- temperature divides the surviving logits; the draw is from their softmax.
- temperature 0 is greedy: the highest (penalised) logit, no randomness.

Every filter keeps at least one token. Probabilities are computed in float64.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

__all__ = ["SamplingParams", "Sampler", "filtered_probs"]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens. The defaults are llama.cpp's (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05)."""

    temperature: float = 0.8  # 0 = greedy
    top_k: int = 40  # 0 = off
    top_p: float = 0.95  # 1.0 = off
    min_p: float = 0.05  # 0.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off
    penalty_last_n: int = 64  # how many of the most recent tokens the repetition penalty looks at
    seed: int | None = None  # None = fresh entropy from the OS; an int makes the draws reproducible

    def __post_init__(self) -> None:
        problems = []
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            problems.append(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            problems.append(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not (0.0 < self.top_p <= 1.0):
            problems.append(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not (0.0 <= self.min_p <= 1.0):
            problems.append(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            problems.append(f"repetition_penalty must be a finite number > 0 (1 = off), got {self.repetition_penalty}")
        if not isinstance(self.penalty_last_n, int) or self.penalty_last_n < 0:
            problems.append(f"penalty_last_n must be an integer >= 0, got {self.penalty_last_n!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0):
            problems.append(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if problems:
            raise ValueError("invalid sampling parameters: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _penalised(logits: np.ndarray, params: SamplingParams, recent: Iterable[int]) -> np.ndarray:
    """float64 copy of `logits` with the repetition penalty applied to each distinct recent token once."""
    out = np.array(logits, dtype=np.float64).reshape(-1)
    if params.repetition_penalty != 1.0:
        ids = np.unique(np.fromiter(recent, dtype=np.int64))
        if ids.size:
            vals = out[ids]
            out[ids] = np.where(vals <= 0, vals * params.repetition_penalty, vals / params.repetition_penalty)
    return out


def _candidates(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Token ids that survive top-k, top-p and min-p (most likely first) and their tempered probabilities."""
    n = logits.size
    if 0 < params.top_k < n:
        # argpartition finds the k largest without sorting the whole vocabulary; ties at the boundary are
        # settled below by the stable sort, so only boundary ties could pick a different id than a full sort.
        ids = np.argpartition(-logits, params.top_k - 1)[: params.top_k]
        ids = np.sort(ids)
    else:
        ids = np.arange(n)
    ids = ids[np.argsort(-logits[ids], kind="stable")]
    vals = logits[ids]

    if params.top_p < 1.0:
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        keep = int(np.searchsorted(np.cumsum(probs), params.top_p, side="left")) + 1
        ids, vals = ids[:keep], vals[:keep]

    if params.min_p > 0.0:
        keep = max(1, int(np.count_nonzero(vals >= vals[0] + math.log(params.min_p))))
        ids, vals = ids[:keep], vals[:keep]

    probs = np.exp((vals - vals[0]) / params.temperature)
    probs /= probs.sum()
    return ids, probs


def filtered_probs(logits: np.ndarray, params: SamplingParams, recent: Iterable[int] = ()) -> np.ndarray:
    """The exact distribution `Sampler.sample` draws from: float64 [vocab], zero for filtered-out tokens.

    `recent` are the tokens the repetition penalty looks at (already cut to the last `penalty_last_n`).
    For temperature 0 it is one-hot on the greedy choice.
    """
    penalised = _penalised(logits, params, recent)
    out = np.zeros(penalised.size, dtype=np.float64)
    if params.greedy:
        out[int(np.argmax(penalised))] = 1.0
        return out
    ids, probs = _candidates(penalised, params)
    out[ids] = probs
    return out


class Sampler:
    """Draws tokens with `params`; remembers the recent tokens for the repetition penalty.

    One Sampler serves one sequence: feed it the prompt with `accept`, then call `sample` once per step
    (it accepts the token it returns). A seeded Sampler draws the same tokens from the same logits.
    """

    def __init__(self, params: SamplingParams | None = None):
        self.params = params or SamplingParams()
        self.rng = np.random.default_rng(self.params.seed)  # the only randomness; seeded -> reproducible
        self.recent: deque[int] = deque(maxlen=self.params.penalty_last_n)  # window of the penalty

    def accept(self, token_ids: Iterable[int]) -> None:
        """Record tokens that are now part of the sequence (the prompt, or tokens chosen elsewhere)."""
        self.recent.extend(int(t) for t in token_ids)

    def sample(self, logits: np.ndarray) -> int:
        """Pick the next token from one row of logits (float32 [vocab]) and accept it."""
        logits = np.asarray(logits).reshape(-1)
        if logits.size == 0:
            raise ValueError("cannot sample from an empty logits row")
        penalised = _penalised(logits, self.params, self.recent)
        if np.isnan(penalised).any():
            raise ValueError("logits contain NaN: the model produced invalid output")
        if self.params.greedy:
            token = int(np.argmax(penalised))
        else:
            ids, probs = _candidates(penalised, self.params)
            # Inverse-CDF draw, as llama.cpp's dist sampler does: the first token whose running sum reaches u.
            cdf = np.cumsum(probs)
            index = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="left"))
            token = int(ids[min(index, ids.size - 1)])
        self.recent.append(token)
        return token
