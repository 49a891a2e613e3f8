"""A decoded token's fused MoE block (kernels/moe_token.py) against float64: the router's softmax top-k, the
selected experts' SwiGLU outputs and the shared expert's, as numpy computes them from gguf.quants' dequantized
weights (and, for the integer path, ggml's rounding of the activations, as test_kernels_expert_pool does).
"""

import gguf
import numpy as np
import pytest
from strata_async.kernels import quant
from strata_async.kernels.activations import sigmoid
from strata_async.kernels.expert_pool import swiglu_experts
from strata_async.kernels.moe_token import MoETokenCall, _moe_token, has_moe_token, moe_token
from strata_async.kernels.routing import softmax_topk
from test_kernels_expert_pool import _rounded_expert_ref, dequant64, random_rows, swiglu_ref

Q = gguf.GGMLQuantizationType


def _router(rng, n_experts, hidden, x, k, dtype):
    """A router whose float64 top-k is clear of ties (a margin far above float32 rounding), as rows of dtype; its
    logits are O(1) (softmax neither flat nor one-hot)."""
    for _ in range(100):
        r = (rng.standard_normal((n_experts, hidden)) / np.linalg.norm(x)).astype(dtype)
        logits = r.astype(np.float64) @ x.astype(np.float64)
        top = np.sort(logits)[::-1]
        if np.min(np.abs(np.diff(top[:k + 1]))) > 1e-3:
            return r, logits
    raise AssertionError("no router with a clear top-k")


def _block(rng, types, n_experts, ffn, hidden, sffn, router_dtype=np.float32):
    tg, tu, td = types
    experts = [np.stack([random_rows(rng, t, rows, k) for _ in range(n_experts)])
               for t, rows, k in ((tg, ffn, hidden), (tu, ffn, hidden), (td, hidden, ffn))]
    shared = [random_rows(rng, t, rows, k)
              for t, rows, k in ((tg, sffn, hidden), (tu, sffn, hidden), (td, hidden, sffn))]
    g64 = [dequant64(m, tg) for m in experts[0]] + [dequant64(shared[0], tg)]
    u64 = [dequant64(m, tu) for m in experts[1]] + [dequant64(shared[1], tu)]
    x = rng.standard_normal(hidden)
    x /= max(max(np.abs(g).sum(axis=1).max() for g in g64), max(np.abs(u).sum(axis=1).max() for u in u64)) / 3
    return experts, shared, x.astype(np.float32)


def _softmax_topk64(logits, k, normalize):
    p = np.exp(logits - logits.max())
    p /= p.sum()
    ids = np.argsort(-p, kind="stable")[:k]
    w = p[ids]
    return ids, (w / w.sum() if normalize else w)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("types", [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q8_0, Q.Q8_0, Q.Q8_0), (Q.IQ2_XS, Q.IQ2_XS, Q.Q2_K)])
@pytest.mark.parametrize("normalize", [True, False])
def test_moe_token_matches_float64(rng, types, quantized, normalize):
    tg, tu, td = types
    n_experts, ffn, hidden, k, sffn = 12, 256, 512, 4, 512
    experts, shared, x = _block(rng, types, n_experts, ffn, hidden, sffn)
    router, logits = _router(rng, n_experts, hidden, x, k, np.float32)
    gate_inp = rng.standard_normal((1, hidden)).astype(np.float32)
    out, ids, weights = moe_token(x, (router.view(np.uint8), 0), k, normalize,
                                  tuple(zip(experts, (int(tg), int(tu), int(td)))),
                                  tuple(zip(shared, (int(tg), int(tu), int(td)))), (gate_inp.view(np.uint8), 0),
                                  quantized)
    ids64, w64 = _softmax_topk64(logits, k, normalize)
    assert ids.tolist() == ids64.tolist()
    np.testing.assert_allclose(weights, w64, rtol=1e-5)
    g64, u64, d64 = (np.stack([dequant64(m, t) for m in ms]) for ms, t in zip(experts, types))
    sg64, su64, sd64 = (dequant64(m, t)[None] for m, t in zip(shared, types))
    scale = 1 / (1 + np.exp(-(gate_inp[0].astype(np.float64) @ x)))
    if quantized:
        expected, bound = np.zeros(hidden), np.zeros(hidden)
        for e, w in zip(ids64, w64):
            y, b = _rounded_expert_ref(x, g64[e], u64[e], d64[e], tg, td)
            expected += w * y
            bound += w * b
        y, b = _rounded_expert_ref(x, sg64[0], su64[0], sd64[0], tg, td)
        expected += scale * y
        bound += scale * b
    else:
        x64 = x.astype(np.float64)
        expected = swiglu_ref(x64, g64, u64, d64, ids64, w64) + swiglu_ref(x64, sg64, su64, sd64, [0], [scale])
        terms = (swiglu_ref(np.abs(x64), np.abs(g64), np.abs(u64), np.abs(d64), ids64, w64)
                 + swiglu_ref(np.abs(x64), np.abs(sg64), np.abs(su64), np.abs(sd64), [0], [scale]))
        bound = 1e-4 * (np.abs(terms) + np.abs(expected).max())
    assert np.all(np.abs(out - expected) <= bound)


@pytest.mark.parametrize("quantized", [False, True])
def test_moe_token_equals_route_then_pools(rng, quantized):
    """The fused call computes what the separate calls do (router matvec, softmax_topk, the routed experts' pool,
    the shared expert's pool scaled by its sigmoid gate), to the last bit: the same dots, the same order of sums.
    No shared expert here, an F16 router."""
    types = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    n_experts, ffn, hidden, k = 16, 256, 256, 3
    experts, _, x = _block(rng, types, n_experts, ffn, hidden, 256)
    router, _ = _router(rng, n_experts, hidden, x, k, np.float16)
    rb = router.view(np.uint8)
    out, ids, weights = moe_token(x, (rb, int(Q.F16)), k, True, tuple(zip(experts, map(int, types))), None, None,
                                  quantized)
    ids2, w2 = softmax_topk(quant.matvec(rb, int(Q.F16), x, quantized)[None], k, True)
    assert ids.tolist() == ids2[0].tolist() and np.array_equal(weights, w2[0])
    ref = np.zeros(hidden, np.float32)
    swiglu_experts(experts[0], int(types[0]), experts[1], int(types[1]), experts[2], int(types[2]), x, ids2[0], w2[0],
                   ref, quantized)
    assert np.array_equal(out, ref)


def test_moe_token_with_shared_expert_equals_pools(rng):
    types = (Q.Q8_0, Q.Q8_0, Q.Q8_0)
    experts, shared, x = _block(rng, types, 8, 256, 256, 512)
    router, _ = _router(rng, 8, 256, x, 2, np.float32)
    gate_inp = rng.standard_normal((1, 256)).astype(np.float32)
    t = int(Q.Q8_0)
    out, ids, weights = moe_token(x, (router.view(np.uint8), 0), 2, False, tuple((e, t) for e in experts),
                                  tuple((s, t) for s in shared), (gate_inp.view(np.uint8), 0), True)
    ref = np.zeros(256, np.float32)
    swiglu_experts(*experts[:1], t, experts[1], t, experts[2], t, x, ids, weights, ref, True)
    scale = sigmoid(quant.matvec(gate_inp.view(np.uint8), 0, x, True))
    swiglu_experts(shared[0][None], t, shared[1][None], t, shared[2][None], t, x, np.zeros(1, np.int64), scale, ref,
                   True)
    assert np.array_equal(out, ref)


@pytest.mark.parametrize("quantized", [False, True])
def test_moe_token_equal_for_any_worker_count(rng, quantized):
    """The block's one region hands each expert's output (and the routing) from the worker that finishes it to the
    workers that go on: the same bits with one worker, one per thread, and more workers than threads, where two
    workers take turns on one thread (a wait must then never be for a task nobody has claimed)."""
    types = (Q.Q4_K, Q.Q4_K, Q.Q6_K)
    n_experts, ffn, hidden, k, sffn = 16, 512, 256, 5, 256
    experts, shared, x = _block(rng, types, n_experts, ffn, hidden, sffn)
    router, _ = _router(rng, n_experts, hidden, x, k, np.float32)
    gate_inp = rng.standard_normal((1, hidden)).astype(np.float32)
    call = MoETokenCall((router.view(np.uint8), 0), k, True, tuple(zip(experts, map(int, types))),
                        tuple(zip(shared, map(int, types))), (gate_inp.view(np.uint8), 0), quantized)
    ref, ids_ref, weights_ref = call(x)
    for workers in (1, 2, 3, 7, 2, 3):
        ids, weights, out = np.empty(k, np.int64), np.empty(k, np.float32), np.zeros(hidden, np.float32)
        _moe_token(*call._weights, x, quantized, call._blocks, ids, weights, out, workers)
        assert np.array_equal(ids, ids_ref) and np.array_equal(weights, weights_ref)
        assert np.array_equal(out, ref), workers


def test_moe_token_types_and_errors(rng):
    assert has_moe_token(int(Q.F32), None, (int(Q.Q4_K),) * 3, True)
    assert not has_moe_token(int(Q.Q8_0), None, (int(Q.Q4_K),) * 3, False)  # a quantized router: separate calls
    assert not has_moe_token(int(Q.F32), int(Q.Q8_0), (int(Q.Q4_K),) * 3, False)
    assert not has_moe_token(int(Q.F32), None, (int(Q.F16),) * 3, True)  # float rows: no integer dot
    assert has_moe_token(int(Q.F32), None, (int(Q.F16),) * 3, False)
    assert has_moe_token(int(Q.F32), None, (int(Q.Q4_0),) * 3, True)  # every quantized type has one
    assert not has_moe_token(int(Q.F32), None, (int(Q.Q4_K), int(Q.Q6_K), int(Q.Q6_K)), True)  # gate != up
    assert has_moe_token(int(Q.F32), None, (int(Q.Q4_K), int(Q.Q6_K), int(Q.Q6_K)), False)
    assert not has_moe_token(int(Q.F32), None, (int(Q.Q4_K),) * 3 + (int(Q.Q8_0), int(Q.Q4_K), int(Q.Q4_K)), True)
    types = (Q.Q8_0, Q.Q8_0, Q.Q8_0)
    experts, _, x = _block(rng, types, 4, 256, 256, 256)
    router = rng.standard_normal((4, 256)).astype(np.float32).view(np.uint8)
    pairs = tuple((e, int(Q.Q8_0)) for e in experts)
    with pytest.raises(ValueError, match="k must be"):
        moe_token(x, (router, 0), 5, True, pairs)
    with pytest.raises(ValueError, match="router must be"):
        moe_token(x, (router[:3], 0), 2, True, pairs)
    with pytest.raises(ValueError, match="x must be"):
        moe_token(x[:128], (router, 0), 2, True, pairs)
    with pytest.raises(ValueError, match="float router"):
        moe_token(x, (experts[0][0][:4], int(Q.Q8_0)), 2, True, pairs)
