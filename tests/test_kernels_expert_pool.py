"""The fused block dots (kernels/quant_dot.py, through quant.matvec) and the expert pool
(kernels/expert_pool.py) against float64 products of gguf.quants' dequantized weights.

Blocks: Q8_0 and Q4_0 from gguf.quants.quantize of random floats; k-quants as random bytes with random
finite fp16 super-scales (every other byte pattern is a valid block). Fresh inputs each run, seed printed.
Tolerances are relative to sum |w| |x| per output: float32 sums of up to 2048 products, reassociated.
"""

import gguf
import numpy as np
import pytest
from strata_async.kernels import quant
from strata_async.kernels.expert_pool import add_scaled_rows, swiglu_experts

Q = gguf.GGMLQuantizationType
SCALE_OFFSETS = {Q.Q4_1: (0, 2), Q.Q5_1: (0, 2), Q.Q5_0: (0,), Q.Q3_K: (108,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
                 Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.Q2_K: (80, 82), Q.IQ2_XS: (0,), Q.IQ2_XXS: (0,),
                 Q.IQ3_XXS: (0,), Q.IQ2_S: (0,), Q.IQ3_S: (0,), Q.IQ1_S: (0,)}
TOL = 1e-5


def random_rows(rng: np.random.Generator, t: Q, rows: int, k: int) -> np.ndarray:
    if t in (Q.Q8_0, Q.Q4_0, Q.MXFP4):
        values = rng.standard_normal((rows, k)).astype(np.float32)
        return np.ascontiguousarray(gguf.quants.quantize(values, t)).reshape(rows, -1)
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(rows, k // block_elems, block_bytes), dtype=np.uint8)
    for off in SCALE_OFFSETS[t]:
        scale = (rng.choice([-1, 1], raw.shape[:2]) * 2.0 ** rng.uniform(-12, -2, raw.shape[:2])).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def dequant64(w: np.ndarray, t: Q) -> np.ndarray:
    return gguf.quants.dequantize(w, t).astype(np.float64)


@pytest.mark.parametrize("t", [Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ2_XS])
@pytest.mark.parametrize("rows,k", [(1, 256), (37, 512), (131, 2048)])
def test_fused_matvec_matches_float64(rng, t, rows, k):
    w = random_rows(rng, t, rows, k)
    x = rng.standard_normal(k).astype(np.float32)
    wf = dequant64(w, t)
    expected = wf @ x.astype(np.float64)
    scale = np.abs(wf) @ np.abs(x.astype(np.float64))
    got = quant.matvec(w, int(t), x)
    assert np.all(np.abs(got - expected) <= TOL * scale)


def swiglu_ref(x, gate, up, down, ids, weights):
    out = np.zeros(down.shape[1])
    for e, wt in zip(ids, weights):
        g, u = gate[e] @ x, up[e] @ x
        out += wt * (down[e] @ (g / (1 + np.exp(-g)) * u))
    return out


@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0, Q.Q8_0), (Q.Q2_K, Q.Q4_0, Q.Q4_K),
                                   (Q.IQ2_XS, Q.IQ2_XS, Q.IQ2_XS), (Q.Q5_K, Q.Q5_K, Q.Q6_K), (Q.Q3_K, Q.Q3_K, Q.Q3_K),
                                   (Q.Q4_1, Q.Q5_1, Q.MXFP4)])
@pytest.mark.parametrize("n_experts,ffn,hidden,k", [(8, 256, 256, 3), (6, 512, 256, 5), (4, 256, 512, 1)])
def test_expert_pool_matches_float64(rng, types, n_experts, ffn, hidden, k):
    tg, tu, td = types
    gate = np.stack([random_rows(rng, tg, ffn, hidden) for _ in range(n_experts)])
    up = np.stack([random_rows(rng, tu, ffn, hidden) for _ in range(n_experts)])
    down = np.stack([random_rows(rng, td, hidden, ffn) for _ in range(n_experts)])
    g64 = np.stack([dequant64(m, tg) for m in gate])
    u64 = np.stack([dequant64(m, tu) for m in up])
    d64 = np.stack([dequant64(m, td) for m in down])
    # Scale x so the gate/up outputs are O(1) whatever the weights' scales: SwiGLU stays in its bent range.
    x = rng.standard_normal(hidden)
    x /= max(np.abs(g64).sum(axis=2).max(), np.abs(u64).sum(axis=2).max()) / 3
    x = x.astype(np.float32)
    ids = rng.choice(n_experts, k, replace=False)
    weights = rng.uniform(0.05, 1.0, k).astype(np.float32)
    base = rng.standard_normal(hidden).astype(np.float32)
    got = swiglu_experts(gate, int(tg), up, int(tu), down, int(td), x, ids, weights, base.copy())
    x64 = x.astype(np.float64)
    expected = base + swiglu_ref(x64, g64, u64, d64, ids, weights.astype(np.float64))
    # error bound: the hidden activations carry relative error ~TOL of their |.|-sums into the down products
    hid = [np.abs(g64[e]) @ np.abs(x64) * (np.abs(u64[e]) @ np.abs(x64)) + 1.0 for e in ids]
    scale = sum(w * (np.abs(d64[e]) @ h) for e, w, h in zip(ids, weights, hid)) + np.abs(base)
    assert np.all(np.abs(got - expected) <= TOL * scale)
    assert np.abs(got - base).max() > 0  # the experts contributed


def test_expert_pool_rejects_bad_ids(rng):
    gate = np.stack([random_rows(rng, Q.Q8_0, 32, 64) for _ in range(2)])
    down = np.stack([random_rows(rng, Q.Q8_0, 64, 32) for _ in range(2)])
    x = rng.standard_normal(64).astype(np.float32)
    with pytest.raises(ValueError, match="expert numbers below 2"):
        swiglu_experts(gate, 8, gate, 8, down, 8, x, np.array([2]), np.ones(1, np.float32), np.zeros(64, np.float32))


def _rounded_expert_ref(x, g64, u64, d64, tg, td):
    """One expert's SwiGLU in float64 with ggml's roundings (x for gate/up, the SwiGLU output for down, both by
    quantize_activations, itself checked against ggml's rules), and the error bound: a rounding that falls the
    other way on a float32-vs-float64 tie is allowed one quantization step."""
    xr = quant.quantize_activations(x, int(tg)).astype(np.float64)
    g, u = g64 @ xr, u64 @ xr
    h = g / (1 + np.exp(-g)) * u
    hr = quant.quantize_activations(h.astype(np.float32), int(td)).astype(np.float64)
    block = quant._format(int(td)).act_block
    step = np.repeat(np.abs(h).reshape(-1, block).max(axis=1) / 127, block)
    return d64 @ hr, np.abs(d64) @ (step + TOL * (np.abs(hr) + 1))


@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0, Q.Q8_0), (Q.Q6_K, Q.Q6_K, Q.Q4_K),
                                   (Q.Q2_K, Q.Q2_K, Q.IQ2_XS), (Q.IQ2_XS, Q.IQ2_XS, Q.Q2_K),
                                   (Q.Q5_K, Q.Q5_K, Q.Q5_K), (Q.Q3_K, Q.Q3_K, Q.Q5_K),
                                   (Q.IQ4_XS, Q.IQ4_XS, Q.IQ4_XS), (Q.IQ4_XS, Q.IQ4_XS, Q.IQ4_NL),
                                   (Q.Q4_K, Q.Q4_K, Q.Q5_0), (Q.Q4_1, Q.Q4_1, Q.Q5_1),
                                   (Q.MXFP4, Q.MXFP4, Q.Q4_0), (Q.IQ2_XXS, Q.IQ2_XXS, Q.IQ3_XXS),
                                   (Q.IQ2_S, Q.IQ2_S, Q.IQ3_S),
                                   (Q.IQ1_S, Q.IQ1_S, Q.IQ1_S)])
def test_integer_expert_pool_matches_ggml_rounding(rng, types):
    """quantized_activations: x rounded to int8 blocks as ggml does for gate/up, each expert's SwiGLU output
    rounded again before its down rows, integer dots. Reference: float64 products of the same roundings
    (_rounded_expert_ref)."""
    tg, tu, td = types
    n_experts, ffn, hidden, k = 6, 512, 256, 4
    gate = np.stack([random_rows(rng, tg, ffn, hidden) for _ in range(n_experts)])
    up = np.stack([random_rows(rng, tu, ffn, hidden) for _ in range(n_experts)])
    down = np.stack([random_rows(rng, td, hidden, ffn) for _ in range(n_experts)])
    g64, u64, d64 = ([dequant64(m, t) for m in ms] for ms, t in ((gate, tg), (up, tu), (down, td)))
    x = rng.standard_normal(hidden)
    x /= max(max(np.abs(g).sum(axis=1).max() for g in g64), max(np.abs(u).sum(axis=1).max() for u in u64)) / 3
    x = x.astype(np.float32)
    ids = rng.choice(n_experts, k, replace=False)
    weights = rng.uniform(0.05, 1.0, k).astype(np.float32)
    base = rng.standard_normal(hidden).astype(np.float32)
    got = swiglu_experts(gate, int(tg), up, int(tu), down, int(td), x, ids, weights, base.copy(),
                         quantized_activations=True)
    expected, bound = base.astype(np.float64), np.abs(base).astype(np.float64) * TOL
    for e, w in zip(ids, weights.astype(np.float64)):
        y, b = _rounded_expert_ref(x, g64[e], u64[e], d64[e], tg, td)
        expected += w * y
        bound += w * b
    assert np.all(np.abs(got - expected) <= bound)
    assert np.abs(got - base).max() > 0
    float_pool = swiglu_experts(gate, int(tg), up, int(tu), down, int(td), x, ids, weights, base.copy())
    assert np.abs(got - float_pool).max() > 0  # the rounding happened


@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0, Q.Q8_0), (Q.IQ2_XS, Q.IQ2_XS, Q.Q2_K)])
def test_grouped_experts_match_float64(rng, types):
    """Prefill's grouped call: pairs sorted by expert, groups of 1 to 7 tokens, every pair's unweighted output."""
    from strata_async.kernels.expert_pool import swiglu_experts_grouped

    tg, tu, td = types
    n_experts, ffn, hidden, n_tokens = 6, 256, 512, 9
    gate = np.stack([random_rows(rng, tg, ffn, hidden) for _ in range(n_experts)])
    up = np.stack([random_rows(rng, tu, ffn, hidden) for _ in range(n_experts)])
    down = np.stack([random_rows(rng, td, hidden, ffn) for _ in range(n_experts)])
    g64, u64, d64 = (np.stack([dequant64(m, t) for m in mats]) for mats, t in ((gate, tg), (up, tu), (down, td)))
    x = rng.standard_normal((n_tokens, hidden))
    x /= max(max(np.abs(m).sum(axis=1).max() for m in g64), max(np.abs(m).sum(axis=1).max() for m in u64)) / 3
    x = x.astype(np.float32)
    group_experts = np.array([4, 0, 5, 2])  # expert 1 and 3 unused
    sizes = [3, 1, 7, 2]
    pair_tokens = np.concatenate([rng.choice(n_tokens, s, replace=False) for s in sizes])
    group_starts = np.concatenate([[0], np.cumsum(sizes)])
    y = swiglu_experts_grouped(gate, int(tg), up, int(tu), down, int(td), x, pair_tokens, group_experts, group_starts)
    assert y.shape == (len(pair_tokens), hidden)
    for g, e in enumerate(group_experts):
        for p in range(group_starts[g], group_starts[g + 1]):
            x64 = x[pair_tokens[p]].astype(np.float64)
            expected = swiglu_ref(x64, g64, u64, d64, [e], [1.0])
            hid = np.abs(g64[e]) @ np.abs(x64) * (np.abs(u64[e]) @ np.abs(x64)) + 1.0
            assert np.all(np.abs(y[p] - expected) <= TOL * (np.abs(d64[e]) @ hid)), (g, p)
    with pytest.raises(ValueError, match="groups"):
        swiglu_experts_grouped(gate, int(tg), up, int(tu), down, int(td), x, pair_tokens, group_experts,
                               group_starts[:-1])
    # quantized_activations: each token rounded for gate/up, each pair's SwiGLU output for down, integer dots
    yq = swiglu_experts_grouped(gate, int(tg), up, int(tu), down, int(td), x, pair_tokens, group_experts,
                                group_starts, quantized_activations=True)
    for g, e in enumerate(group_experts):
        for p in range(group_starts[g], group_starts[g + 1]):
            expected, bound = _rounded_expert_ref(x[pair_tokens[p]], g64[e], u64[e], d64[e], tg, td)
            assert np.all(np.abs(yq[p] - expected) <= bound), (g, p)
    assert np.abs(yq - y).max() > 0  # the rounding happened


def test_add_scaled_rows_matches_float64_with_repeated_rows(rng):
    out = rng.standard_normal((7, 33)).astype(np.float32)
    y = rng.standard_normal((12, 33)).astype(np.float32)
    rows = rng.integers(0, 7, 12)
    rows[:3] = 4  # the same row three times
    scale = rng.standard_normal(12).astype(np.float32)
    want = out.astype(np.float64)
    np.add.at(want, rows, y.astype(np.float64) * scale[:, None])
    add_scaled_rows(out, rows, y, scale)
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="row indices"):
        add_scaled_rows(out, np.full(12, 7), y, scale)
    with pytest.raises(ValueError, match="one row index and one scale"):
        add_scaled_rows(out, rows[:5], y, scale)
    with pytest.raises(ValueError, match="float32"):
        add_scaled_rows(out, rows, y.astype(np.float64), scale)
