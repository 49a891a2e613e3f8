"""Sampling: the filtered distribution against a float64 reference written from llama.cpp's definitions,
draws against that distribution (chi-square), greedy, seeding and parameter validation."""

from __future__ import annotations

import math

import numpy as np
import pytest

from strata_async.sampling import Sampler, SamplingParams, filtered_probs

RNG = np.random.default_rng()  # fresh inputs every run


def reference_probs(logits: np.ndarray, p: SamplingParams, recent: list[int]) -> np.ndarray:
    """Plain float64 restatement of llama.cpp's chain: penalties, top-k, top-p, min-p, temperature, softmax."""
    x = logits.astype(np.float64).copy()
    for t in set(recent):
        x[t] = x[t] * p.repetition_penalty if x[t] <= 0 else x[t] / p.repetition_penalty
    if p.temperature == 0:
        out = np.zeros_like(x)
        out[np.argmax(x)] = 1.0
        return out
    order = sorted(range(x.size), key=lambda i: (-x[i], i))
    if p.top_k > 0:
        order = order[: p.top_k]
    if p.top_p < 1:
        w = np.array([math.exp(x[i] - x[order[0]]) for i in order])
        w /= w.sum()
        total, cut = 0.0, len(order)
        for j, q in enumerate(w):
            total += q
            if total >= p.top_p:
                cut = j + 1
                break
        order = order[:cut]
    if p.min_p > 0:
        top = x[order[0]]
        order = [i for i in order if x[i] >= top + math.log(p.min_p)] or order[:1]
    out = np.zeros_like(x)
    w = np.array([math.exp((x[i] - x[order[0]]) / p.temperature) for i in order])
    out[order] = w / w.sum()
    return out


PARAMS = [
    SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    SamplingParams(),  # llama.cpp defaults
    SamplingParams(temperature=0.5, top_k=7, top_p=1.0, min_p=0.0),
    SamplingParams(temperature=1.3, top_k=0, top_p=0.6, min_p=0.0),
    SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.2),
    SamplingParams(temperature=2.0, top_k=20, top_p=0.9, min_p=0.02, repetition_penalty=1.7),
]


@pytest.mark.parametrize("params", PARAMS)
def test_filtered_probs_match_reference(params):
    for _ in range(5):
        vocab = int(RNG.integers(50, 400))
        logits = (RNG.standard_normal(vocab) * RNG.uniform(0.5, 4.0)).astype(np.float32)
        recent = list(RNG.integers(0, vocab, size=12))
        got = filtered_probs(logits, params, recent)
        want = reference_probs(logits, params, recent)
        assert got.dtype == np.float64 and got.shape == (vocab,)
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
        assert math.isclose(got.sum(), 1.0, rel_tol=1e-12)


def chi_square_bound(df: int, z: float = 4.75) -> float:
    """Upper ~1e-6 quantile of chi-square(df) by the Wilson-Hilferty approximation."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.mark.parametrize("params", PARAMS[:5])
def test_draws_follow_filtered_distribution(params):
    vocab = 60
    logits = (RNG.standard_normal(vocab) * 1.5).astype(np.float32)
    probs = filtered_probs(logits, params)
    sampler = Sampler(SamplingParams(**{**params.__dict__, "seed": int(RNG.integers(2**31))}))
    n = 20000
    counts = np.bincount([sampler.sample(logits) for _ in range(n)], minlength=vocab)
    assert counts[probs == 0].sum() == 0, "a filtered-out token was drawn"
    support = probs > 0
    if support.sum() == 1:
        assert counts[support][0] == n
        return
    expected = probs[support] * n
    stat = float((((counts[support] - expected) ** 2) / expected).sum())
    assert stat < chi_square_bound(int(support.sum()) - 1), (stat, support.sum())


def test_greedy_is_argmax_and_ignores_seed():
    for seed in (None, 1, 2):
        sampler = Sampler(SamplingParams(temperature=0.0, seed=seed))
        for _ in range(20):
            logits = RNG.standard_normal(1000).astype(np.float32)
            assert sampler.sample(logits) == int(np.argmax(logits))


def test_greedy_sees_repetition_penalty():
    logits = np.array([0.5, 3.0, 2.9, -1.0], dtype=np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=1.5))
    sampler.accept([1])
    assert sampler.sample(logits) == 2  # 3.0 / 1.5 = 2.0 < 2.9


def test_seeded_sampler_is_reproducible():
    rows = RNG.standard_normal((200, 500)).astype(np.float32) * 3
    params = SamplingParams(temperature=1.0, top_k=100, top_p=0.98, min_p=0.0, seed=1234)
    first = [Sampler(params).sample(r) for r in rows[:1]]
    a, b = Sampler(params), Sampler(params)
    seq_a = [a.sample(r) for r in rows]
    seq_b = [b.sample(r) for r in rows]
    assert seq_a == seq_b and seq_a[:1] == first
    other = Sampler(SamplingParams(**{**params.__dict__, "seed": 4321}))
    assert [other.sample(r) for r in rows] != seq_a


def test_penalty_window_only_covers_last_n():
    sampler = Sampler(SamplingParams(temperature=0.0, repetition_penalty=10.0, penalty_last_n=2))
    sampler.accept([0, 1, 2])  # token 0 has left the window of 2
    logits = np.array([5.0, 4.0, 4.0, 1.0], dtype=np.float32)
    assert sampler.sample(logits) == 0


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_p": -0.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"penalty_last_n": -3}, "penalty_last_n"),
        ({"seed": -1}, "seed"),
    ],
)
def test_invalid_params_name_the_field(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        SamplingParams(**kwargs)


def test_nan_logits_are_rejected():
    with pytest.raises(ValueError, match="NaN"):
        Sampler(SamplingParams(seed=0)).sample(np.array([0.0, np.nan], dtype=np.float32))
