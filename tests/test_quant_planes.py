"""IQ2_XS_PLANES (IQ2_XS repacked at load into level planes and sign bits) against gguf.quants and float64.

The planes must hold exactly IQ2_XS's values: their decode is compared bit for bit with gguf-py's decode of the
IQ2_XS blocks they were made from, and every product (matvec and matmul, float and int8 activations, the portable
loop) with float64 of those weights, at the tolerances test_quant_iq explains.
"""

import gguf
import numpy as np
import pytest
from gguf import quants as gguf_quants
import assets
from parity import PROMPT_ID_LIMIT, prompt_then_tokens, rewrite_gguf
from test_gguf_io import _resident_bytes_of
from test_quant_iq import assert_product_close, random_rows, reference_weights

from strata_async import cli
from strata_async.io import open_gguf
from strata_async.kernels import quant, quant_int, quant_planes
from strata_async.kernels.quant_planes import IQ2_XS_PLANES
from strata_async.kernels.reference import q8_k_activations_ref
from strata_async.model_info import describe, format_bytes
from strata_async.runtime import LoadOptions, load_runtime, weights
from strata_async.runtime.weights import QTensor

IQ2_XS = int(gguf.GGMLQuantizationType.IQ2_XS)
needs_planes = pytest.mark.skipif(not quant_planes.AVAILABLE, reason="the planes' dots need AVX-512 VBMI")


def planes(rng, rows, k):
    """(IQ2_XS rows, their planes, float64 weights from gguf's decode of the IQ2_XS rows)."""
    w = random_rows(rng, "IQ2_XS", rows, k)
    return w, quant_planes.repack(w), reference_weights(w, "IQ2_XS")


def test_repack_layout(rng):
    """The planes' bytes where the layout puts them: d and scale bytes copied; value v = 16 c + 4 s + k (k < 4) at
    position u = 64 s + 4 c + k, its level at bits 2 s of level byte u % 64 and its sign at bit u % 8 of sign byte
    u // 8 (gguf's decode gives magnitude and sign)."""
    w, p, w64 = planes(rng, 5, 512)
    assert p.shape == (5, 2 * 106) and p.dtype == np.uint8
    blocks, packed = w.reshape(-1, 74), p.reshape(-1, 106)
    np.testing.assert_array_equal(packed[:, :2], blocks[:, :2])
    np.testing.assert_array_equal(packed[:, 2:10], blocks[:, 66:74])
    v = np.arange(256)
    step, u = v % 16 // 4, 64 * (v % 16 // 4) + 4 * (v // 16) + v % 4
    levels = packed[:, 10 + u % 64] >> (2 * step) & 3
    negative = packed[:, 74 + u // 8] >> (u % 8) & 1
    values = w64.reshape(-1, 256)
    magnitudes = np.array([8, 25, 43])[levels]
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64)
    scales = (blocks[:, 66 + v // 32] >> (4 * (v // 16 % 2)) & 15).astype(np.float64)
    db = d * (0.5 + scales) * 0.25
    np.testing.assert_array_equal(np.where(negative == 1, -1.0, 1.0) * magnitudes * db, values)


def test_repack_keeps_leading_shape_and_checks_rows(rng):
    w = random_rows(rng, "IQ2_XS", 6, 512).reshape(3, 2, -1)  # experts x rows x bytes
    p = quant_planes.repack(w)
    assert p.shape == (3, 2, 212)
    np.testing.assert_array_equal(p.reshape(6, -1), quant_planes.repack(w.reshape(6, -1)))
    with pytest.raises(ValueError, match="74-byte blocks"):
        quant_planes.repack(np.zeros((2, 75), np.uint8))


def test_dequantize_bit_exact_with_gguf(rng):
    for rows, k in [(1, 256), (37, 512), (15, 2048)]:
        w, p, _ = planes(rng, rows, k)
        got = quant.dequantize(p, IQ2_XS_PLANES, (rows, k))
        want = gguf_quants.dequantize(w, gguf.GGMLQuantizationType.IQ2_XS).reshape(rows, k)
        assert np.any(got != 0)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
        one_by_one = np.empty(k, np.float32)
        quant_planes.dequant_planes_loop(p[0], one_by_one)
        np.testing.assert_array_equal(one_by_one.view(np.uint32), want[0].view(np.uint32))


@needs_planes
def test_matvec_against_float64_and_iq2_xs(rng):
    for rows, k in [(1, 256), (67, 512), (131, 2048), (200, 768)]:  # 768: block pairs and an odd last block
        w, p, w64 = planes(rng, rows, k)
        x = (rng.standard_normal(k) * rng.uniform(0.1, 10.0)).astype(np.float32)
        assert_product_close(quant.matvec(p, IQ2_XS_PLANES, x), w64, x.astype(np.float64))
        got = quant.matvec(p, IQ2_XS_PLANES, x, act_quant=True)
        assert_product_close(got, w64, q8_k_activations_ref(x[None])[0])
        # IQ2_XS's own dot: the same integer sums of runs, summed in other float lanes (a run a lane here)
        iq2 = quant.matvec(w, IQ2_XS, x, act_quant=True)
        scale = np.abs(w64) @ np.abs(q8_k_activations_ref(x[None])[0])
        assert np.all(np.abs(got.astype(np.float64) - iq2) <= 1e-6 * scale)


@needs_planes
def test_matmul_against_float64(rng):
    """Float tiles (float activations) and code tiles (int8 activations, simd_gemm.planes_codes256)."""
    rows = 131  # one full tile of 128 rows and a partial one (code tiles: 8 of 16 rows and a partial one)
    for i, n in enumerate([1, 2, 3, 5, 17, 33]):
        k = [256, 512, 2048][i % 3]
        w, p, w64 = planes(rng, rows, k)
        x = (rng.standard_normal((n, k)) * rng.uniform(0.1, 10.0)).astype(np.float32)
        assert_product_close(quant.matmul(p, IQ2_XS_PLANES, x), w64, x.astype(np.float64))
        assert_product_close(quant.matmul(p, IQ2_XS_PLANES, x, act_quant=True), w64, q8_k_activations_ref(x))


def test_portable_loop_against_float64(rng):
    """The loop for CPUs without the vector dot, with int8 codes and with float32 activations."""
    for k in (256, 768):
        w, p, w64 = planes(rng, 3, k)
        x = rng.standard_normal(k).astype(np.float32)
        xq, xd, _ = quant_int.q8_activations(x, 256)
        x64 = xq.astype(np.float64) * np.repeat(xd.astype(np.float64), 256)
        got = np.array([quant_planes.planes_loop(p[r], xq, xd) for r in range(3)], np.float32)
        assert_product_close(got, w64, x64)
        ones = np.ones(k // 256, np.float32)
        got = np.array([quant_planes.planes_loop(p[r], x, ones) for r in range(3)], np.float32)
        assert_product_close(got, w64, x.astype(np.float64))


def test_not_a_file_type():
    assert IQ2_XS_PLANES not in quant.supported_types() and IQ2_XS in quant.supported_types()


def _iq2_xs_copy(rng, src, dst):
    """The checkpoint's F32 conversion with every matrix of whole 256-value rows as random IQ2_XS blocks."""
    def retype(specs):
        for name, ggml_type, shape, data in specs:
            if len(shape) >= 2 and shape[-1] % 256 == 0:
                rows = int(np.prod(shape[:-1]))
                w = random_rows(rng, "IQ2_XS", rows, shape[-1])
                w[:, 0::74] = w[:, 0::74] & 0x7F  # positive d of a modest size: finite logits through the layers
                yield name, IQ2_XS, shape, w.reshape(-1)
            else:
                yield name, ggml_type, shape, data
    return rewrite_gguf(src, dst, tensors=retype)


def _types_of(obj, seen=None) -> set[int]:
    """The ggml types of every QTensor reachable from a model object."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (np.ndarray, str, int, float, bytes)) or obj is None:
        return set()
    seen.add(id(obj))
    if isinstance(obj, QTensor):
        return {obj.ggml_type}
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else (
        vars(obj).values() if hasattr(obj, "__dict__") else ())
    return set().union(*(_types_of(v, seen) for v in items))


@needs_planes
def test_repacked_model_computes_what_iq2_xs_does(rng, tmp_path):
    """A qwen3next of IQ2_XS matrices, loaded repacked and not: the same logits to the last bit, for a prompt
    (tiles: float, or code tiles with int8 activations) and decoded tokens (row dots), float and int8 activations."""
    src = assets.converted_gguf(assets.checkpoint_dir("qwen3next_kquant"), "f32")
    path = _iq2_xs_copy(rng, src, tmp_path / "iq2_xs.gguf")
    prompt = rng.integers(0, PROMPT_ID_LIMIT, 37)
    for int8 in (False, True):
        logits = {}
        for mode in ("always", "never"):
            rt = load_runtime(path, quantized_activations=int8, options=LoadOptions(repack=mode))
            types = _types_of(rt.model)
            assert (IQ2_XS_PLANES in types) == (mode == "always") and IQ2_XS in types  # embeddings stay IQ2_XS
            logits[mode] = prompt_then_tokens(rt, prompt)
        assert np.isfinite(logits["never"]).all() and np.ptp(logits["never"]) > 0
        # the prompt's tiles hold the same values in the same order: the same bits
        np.testing.assert_array_equal(logits["always"][:len(prompt)], logits["never"][:len(prompt)])
        # decoded tokens: the row dots sum each run in a lane of its own (simd.PLANES_ORDER), IQ2_XS's dot in
        # other lanes: the same integer sums, float rounding apart. With int8 activations a value that lands within
        # that rounding of a code boundary takes the next code in one path, and the random model (activations to
        # 6e4, random routers) can carry that far: over 60 fresh seeds, 54 had the int8 decoded logits within
        # 1.7e-4 of each other (ranges 420-510) and 6 differed by 1.5-10.4 from one step on (one seed traced: a
        # layer's mixer output 1% off after inputs 1e-7 apart, then a routing choice), with the kernels before and
        # after quant.matvecs alike. Float activations stayed within 0.012 in all 60. A wrong order or sign in the
        # planes moves the logits by their own size; the planes' products are held to float64 in the tests above.
        diff = np.abs(logits["always"] - logits["never"]).max()
        print(f"int8 {int8}: decoded logits differ by at most {diff:.3g} (range {np.ptp(logits['never']):.3g})")
        assert diff <= (0.1 if int8 else 1e-4) * np.abs(logits["never"]).max()


def _repacked_by_name(f, skip_blocks=()):
    """IQ2_XS bytes a repack grows, from the tensor names: all but the token embeddings and the given blocks."""
    return sum(t.data.nbytes for name, t in f.tensors.items() if t.ggml_type == IQ2_XS
               and name != "token_embd.weight" and not any(name.startswith(f"blk.{b}.") for b in skip_blocks))


def test_repack_policy(tmp_path, rng):
    src = assets.converted_gguf(assets.checkpoint_dir("qwen3next_kquant"), "f32")
    path = _iq2_xs_copy(rng, src, tmp_path / "iq2_xs.gguf")
    with open_gguf(path) as f:
        assert f.tensors["token_embd.weight"].ggml_type == IQ2_XS  # the rule's row-table exception is exercised
        size = sum(t.data.nbytes for t in f.tensors.values())
        iq2 = _repacked_by_name(f)
        grown = size + iq2 // 74 * 106 - iq2
        assert weights.repacked_bytes(f) == iq2
        assert weights.held_bytes(f, True) == grown and weights.held_bytes(f, False) == size
        assert weights.repacks_iq2_xs(f, "never", ram=1 << 40) is False
        assert weights.repacks_iq2_xs(f, "auto", ram=int(grown / 0.8) + 1) is quant_planes.AVAILABLE
        assert weights.repacks_iq2_xs(f, "auto", ram=int(grown / 0.8) - 1) is False
        with pytest.raises(ValueError, match="auto, always, never"):
            weights.repacks_iq2_xs(f, "yes")
    with open_gguf(src) as f:  # nothing of IQ2_XS to repack
        assert weights.repacks_iq2_xs(f, "auto", ram=1 << 40) is False
        assert describe(f).repack is None


def test_repack_leaves_out_mtp_blocks_and_inspect_shows_the_growth(tmp_path, rng):
    src = assets.converted_gguf(assets.checkpoint_dir("qwen3next_kquant"), "f32")
    plain = _iq2_xs_copy(rng, src, tmp_path / "iq2_xs.gguf")
    with open_gguf(plain) as f:
        arch = f.metadata["general.architecture"]
        blocks = int(f.metadata[f"{arch}.block_count"])
    count_type = lambda md: md[f"{arch}.block_count"][0]  # noqa: E731
    path = rewrite_gguf(plain, tmp_path / "mtp.gguf", metadata=lambda md: {
        **md, f"{arch}.nextn_predict_layers": (count_type(md), 1)})  # the last block becomes an MTP block
    with open_gguf(path) as f:
        iq2 = _repacked_by_name(f, skip_blocks=[blocks - 1])
        assert 0 < iq2 < _repacked_by_name(f)
        assert weights.repacked_bytes(f) == iq2
        size = sum(t.data.nbytes for t in f.tensors.values())
        info = describe(f)
        auto = weights.repacks_iq2_xs(f, "auto")
    r = info.repack
    assert (r.iq2_xs_bytes, r.held_bytes, r.file_tensor_bytes) == (iq2, size + iq2 * 32 // 74, size)
    assert r.auto is auto and r.ram_bytes == weights.physical_memory()
    line = next(x for x in cli._info_text(info).splitlines() if x.strip().startswith("repack"))
    assert format_bytes(r.held_bytes) in line and format_bytes(iq2 * 106 // 74) in line
    assert ("does here" in line) is r.auto


@needs_planes
def test_load_progress_counts_the_repacked_bytes(tmp_path, rng):
    src = assets.converted_gguf(assets.checkpoint_dir("qwen3next_kquant"), "f32")
    path = _iq2_xs_copy(rng, src, tmp_path / "iq2_xs.gguf")
    seen = []
    rt = load_runtime(path, options=LoadOptions(repack="always", progress=lambda done, total: seen.append((done,
                                                                                                         total))))
    rt.close()
    with open_gguf(path) as f:
        iq2 = sum(t.data.nbytes for n, t in f.tensors.items() if t.ggml_type == IQ2_XS and n != "token_embd.weight")
    totals = {total for _, total in seen}
    assert len(totals) == 1 and seen[-1][0] == seen[-1][1] and seen[-1][1] > iq2
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert any(d == iq2 for d, _ in seen)  # the repacked tensors come first
    # the repacked tensors' file pages are dropped from the mapping once copied: the file's resident bytes are
    # about those of the tensors the model computes from as they lie (a page per tensor edge, fault-around)
    with open_gguf(path) as f:
        kept = sum(t.data.nbytes for n, t in f.tensors.items() if t.ggml_type != IQ2_XS or n == "token_embd.weight")
    rt = load_runtime(path, options=LoadOptions(repack="always"))
    try:
        assert iq2 > 1 << 23  # megabytes more if they stayed: the margin below is not in the fault-around noise
        assert _resident_bytes_of(path) < kept + 0.25 * iq2
    finally:
        rt.close()


@needs_planes
@pytest.mark.parametrize("quantized", [False, True])
def test_moe_block_and_pool_compute_what_iq2_xs_does(rng, quantized):
    """The fused MoE block and the expert pool with planes experts (their activations put into the planes' order
    once per input, quant_dispatch.int_ready) against the same IQ2_XS experts unrepacked, which
    test_kernels_moe_token checks against float64: the same experts, outputs within float rounding. The float
    pool also with gate as planes and up as IQ2_XS (each projection's activations in its own order)."""
    from strata_async.kernels.expert_pool import swiglu_experts
    from strata_async.kernels.moe_token import moe_token
    n_experts, ffn, hidden, k = 8, 512, 768, 3
    gate, up = (random_rows(rng, "IQ2_XS", n_experts * ffn, hidden).reshape(n_experts, ffn, -1) for _ in range(2))
    down = random_rows(rng, "IQ2_XS", n_experts * hidden, ffn).reshape(n_experts, hidden, -1)
    shared = [random_rows(rng, "IQ2_XS", rows, cols) for rows, cols in ((ffn, hidden), (ffn, hidden), (hidden, ffn))]
    x = (rng.standard_normal(hidden) / 50).astype(np.float32)
    router = rng.standard_normal((n_experts, hidden)).astype(np.float32)
    gate_inp = rng.standard_normal((1, hidden)).astype(np.float32)
    iq2 = int(gguf.GGMLQuantizationType.IQ2_XS)

    def block(t, f):
        return moe_token(x, (router.view(np.uint8), 0), k, True, tuple((f(m), t) for m in (gate, up, down)),
                         tuple((f(m), t) for m in shared), (gate_inp.view(np.uint8), 0), quantized)
    want, ids, w = block(iq2, lambda m: m)
    got, got_ids, got_w = block(IQ2_XS_PLANES, quant_planes.repack)
    assert got_ids.tolist() == ids.tolist() and np.array_equal(got_w, w)
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()

    ref = swiglu_experts(gate, iq2, up, iq2, down, iq2, x, ids, w, np.zeros(hidden, np.float32), quantized)
    for up_planes in (True, False) if not quantized else (True,):  # the integer pool takes gate and up of one type
        pu, tu = (quant_planes.repack(up), IQ2_XS_PLANES) if up_planes else (up, iq2)
        got = swiglu_experts(quant_planes.repack(gate), IQ2_XS_PLANES, pu, tu, quant_planes.repack(down),
                             IQ2_XS_PLANES, x, ids, w, np.zeros(hidden, np.float32), quantized)
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
