"""The vector building blocks of the integer dots (kernels/simd.py) against numpy, on random bytes.

Every function is exact integer arithmetic (or an exact half -> float conversion), so results must be equal,
not close. Offsets are odd and the byte values cover the extremes (0, 127, 128, 255) that sign or zero
extension gets wrong.
"""

import numba
import numpy as np
import pytest

from strata_async.kernels import ggml_blocks, simd


@numba.njit
def _s8_32(a, ao, x, xo):
    return simd.idot_s8_32(a, ao, x, xo)


@numba.njit
def _f16_all(src, out):
    for i in range(out.shape[0]):
        out[i] = ggml_blocks.f16(src, 2 * i)


_HAS_AVX512 = simd.HAS_AVX512BW  # the CPU's, before any test patches it


def _bytes(rng, n):
    b = rng.integers(0, 256, n, dtype=np.uint8)
    b[:4] = (0, 127, 128, 255)
    return b


def _compiled(name, module=simd):
    """A new compiled caller of module.<name>: an intrinsic picks its instructions when a caller compiles, so a
    test that changes simd.HAS_AVX512BW or simd.GRID_READ needs a fresh one."""
    fn = getattr(module, name)

    @numba.njit
    def call(*args):
        return fn(*args)
    return call


@pytest.fixture(params=[True, False], ids=["avx512bw", "portable"])
def avx512bw(request, monkeypatch):
    """Both code paths of the 4-bit and i-quant dots (the portable one wherever AVX-512BW is missing)."""
    if request.param and not simd.HAS_AVX512BW:
        pytest.skip("this CPU has no AVX-512BW")
    monkeypatch.setattr(simd, "HAS_AVX512BW", request.param)


@pytest.fixture(params=["gather", "permute", "loads"])
def grid_read(request, monkeypatch):
    """Every way of reading IQ2_XS grid points: a vpgatherqq per eight (Intel cores), the level codes permuted in
    registers (AVX-512 VBMI and BITALG) and a load per point."""
    if request.param == "gather" and not _HAS_AVX512 or request.param == "permute" and not simd.HAS_VBMI_BITALG:
        pytest.skip(f"this CPU cannot read grid points by {request.param}")
    monkeypatch.setattr(simd, "GRID_READ", request.param)


def test_idot_s8_32(rng):
    a, x = _bytes(rng, 200), _bytes(rng, 200).view(np.int8)
    for ao, xo in [(0, 0), (3, 17), (150, 101), (168, 168)]:
        want = int(np.dot(a[ao:ao + 32].view(np.int8).astype(np.int64), x[xo:xo + 32].astype(np.int64)))
        assert _s8_32(a, ao, x, xo) == want
    assert _s8_32(np.full(32, 128, np.uint8), 0, np.full(32, -128, np.int8), 0) == 32 * 128 * 128  # no int16 wrap


def test_f16_every_half():
    """All 65536 halves (subnormals, infinities, NaNs) convert exactly, at unaligned offsets too."""
    halves = np.arange(65536, dtype=np.uint16).view(np.float16)
    src = np.zeros(2 * 65536 + 1, np.uint8)
    src[1:] = halves.view(np.uint8)
    out = np.empty(65536, np.float32)
    _f16_all(src[1:], out)
    want = halves.astype(np.float32)
    finite = ~np.isnan(want)
    np.testing.assert_array_equal(out[finite], want[finite])
    assert np.isnan(out[~finite]).all()
    np.testing.assert_array_equal(np.signbit(out[finite]), np.signbit(want[finite]))


def _q6_half_want(src, ql, qh, sc, x, xo):
    """Value (i, k) of a Q6_K half takes its low nibble from ql[i + 32 (k % 2)] (bits 4 k // 2 ...), its high
    bits from qh[i] >> 2 k, its scale from sc[2 k + i // 16], and is (code - 32) times the scale."""
    want = 0
    for k in range(4):
        for i in range(32):
            low = (int(src[ql + i + 32 * (k % 2)]) >> (4 * (k // 2))) & 15
            code = low | (((int(src[qh + i]) >> (2 * k)) & 3) << 4)
            scale = int(src[sc + 2 * k + i // 16].astype(np.int8))
            want += scale * (code - 32) * int(x[xo + 32 * k + i])
    return want


def test_idot_q6_half(rng):
    """The portable Q6_K half against the layout written out."""
    src, x = _bytes(rng, 300), _bytes(rng, 300).view(np.int8)
    for ql, qh, sc, xo in [(0, 64, 96, 0), (5, 100, 290, 37), (150, 214, 246, 172)]:
        assert _compiled("idot_q6_half")(src, ql, qh, sc, x, xo) == _q6_half_want(src, ql, qh, sc, x, xo)


def _random_halves(rng, n):
    """n random finite fp16 values over several binades, as their bytes."""
    return (rng.choice([-1, 1], n) * 2.0 ** rng.uniform(-10, 2, n)).astype(np.float16).view(np.uint8)


@pytest.mark.skipif(not simd.HAS_AVX512BW, reason="this CPU has no AVX-512BW")
def test_fdot_q6_k_blocks(rng):
    """Whole Q6_K rows (three blocks) against the layout written out: per block d * xd[b] * the two halves."""
    nb = 3
    src, x = _bytes(rng, 210 * nb), np.maximum(_bytes(rng, 256 * nb).view(np.int8), -127)
    for b in range(nb):
        src[210 * b + 208:210 * b + 210] = _random_halves(rng, 1)
    xd = rng.uniform(0.01, 1.0, nb).astype(np.float32)
    xs16 = x.astype(np.int64).reshape(-1, 16).sum(axis=1).astype(np.int32)
    want = bound = 0.0
    for b in range(nb):
        o = 210 * b
        isum = sum(_q6_half_want(src, o + 64 * h, o + 128 + 32 * h, o + 192 + 8 * h, x, 256 * b + 128 * h)
                   for h in range(2))
        scale = float(src[o + 208:o + 210].view(np.float16)[0]) * float(xd[b])
        want += scale * isum
        bound += abs(scale) * 32 * 64 * 127 * 256
    for blocks in (nb, 1):
        got = _compiled("fdot_q6_k_blocks")(src, x, xd, xs16, blocks)
        if blocks == 1:
            o_scale = float(src[208:210].view(np.float16)[0]) * float(xd[0])
            want = o_scale * sum(_q6_half_want(src, 64 * h, 128 + 32 * h, 192 + 8 * h, x, 128 * h) for h in range(2))
        assert abs(got - want) <= 1e-6 * bound, blocks


@pytest.mark.parametrize("vnni", [True, False], ids=["vnni", "no-vnni"])
def test_fdot_q8_0_pairs(rng, vnni, monkeypatch):
    """Pairs of Q8_0 blocks (weights -128..127, -128 included) against numpy, with and without VNNI."""
    if not simd.HAS_AVX512BW or (vnni and not simd.HAS_VNNI):
        pytest.skip("this CPU lacks the instructions")
    monkeypatch.setattr(simd, "HAS_VNNI", vnni)
    nb = 6
    src = _bytes(rng, 34 * nb)
    src[2:6] = (128, 128, 127, 0)  # -128 codes, whose magnitude only fits unsigned
    for b in range(nb):
        src[34 * b:34 * b + 2] = _random_halves(rng, 1)
    x = np.maximum(_bytes(rng, 32 * nb).view(np.int8), -127)
    x[:2] = (-127, 127)
    xd = rng.uniform(0.01, 1.0, nb).astype(np.float32)
    blocks = src.reshape(nb, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64).reshape(-1)
    isums = (blocks[:, 2:].view(np.int8).astype(np.int64) * x.reshape(nb, 32)).sum(axis=1)
    for pairs in (3, 1):
        terms = d[:2 * pairs] * xd[:2 * pairs] * isums[:2 * pairs]
        got = _compiled("fdot_q8_0_pairs")(src, x, xd, pairs)
        assert abs(got - terms.sum()) <= 1e-6 * np.abs(d * xd).sum() * 32 * 128 * 127


@pytest.mark.skipif(not simd.HAS_VNNI, reason="this CPU has no AVX-512 VNNI")
def test_fdot_q8_0_octets(rng):
    """Octets of Q8_0 blocks against numpy: every block's sum must be the exact integer, so a block whose codes
    are all 0 under activations all 127 (the largest offset the unsigned codes add, 128 * 32 * 127) adds
    nothing, and the error stays within float32 rounding of the terms, not of that offset."""
    nb = 16
    src = _bytes(rng, 34 * nb)
    src[2:6] = (128, 128, 127, 0)  # -128 codes, whose offset code is 0
    src[34 * 5 + 2:34 * 6] = 0
    for b in range(nb):
        src[34 * b:34 * b + 2] = _random_halves(rng, 1)
    src[34 * 5:34 * 5 + 2] = np.array([60000.0], np.float16).view(np.uint8)  # the zero block's scale the largest
    x = np.maximum(_bytes(rng, 32 * nb).view(np.int8), -127)
    x[:2] = (-127, 127)
    x[32 * 5:32 * 6] = 127
    xd = rng.uniform(0.01, 1.0, nb).astype(np.float32)
    xs16 = x.astype(np.int64).reshape(-1, 16).sum(axis=1).astype(np.int32)
    blocks = src.reshape(nb, 34)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float64).reshape(-1)
    isums = (blocks[:, 2:].view(np.int8).astype(np.int64) * x.reshape(nb, 32)).sum(axis=1)
    assert isums[5] == 0
    for octets in (2, 1):
        terms = d[:8 * octets] * xd[:8 * octets] * isums[:8 * octets]
        got = _compiled("fdot_q8_0_octets")(src, x, xd, xs16, octets)
        assert abs(got - terms.sum()) <= 1e-6 * np.abs(terms).sum()


def _q4_k_sums(src, o, x, y):
    """(sum_j sc_j (codes_j . x_j), sum_j m_j sum(x_j)) of the Q4_K block at src[o] with x[y:y + 256], its scales
    and mins (6 bits, packed in 12 bytes) read as ggml's get_scale_min_k4 reads them."""
    s = [int(v) for v in src[o + 4:o + 16]]
    sc = [s[j] & 63 if j < 4 else (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4) for j in range(8)]
    mn = [s[j + 4] & 63 if j < 4 else (s[j + 4] >> 4) | ((s[j] >> 6) << 4) for j in range(8)]
    q = src[o + 16:o + 144].astype(np.int64)
    codes = np.concatenate([np.concatenate([q[32 * i:32 * i + 32] & 15, q[32 * i:32 * i + 32] >> 4])
                            for i in range(4)])
    xv = x[y:y + 256].astype(np.int64)
    isc = sum(sc[j] * int(codes[32 * j:32 * j + 32] @ xv[32 * j:32 * j + 32]) for j in range(8))
    return isc, sum(mn[j] * int(xv[32 * j:32 * j + 32].sum()) for j in range(8))


def _q5_k_sums(src, o, x, y):
    """The same for a Q5_K block: Q4_K's scales and nibbles (from byte 48), plus 16 times bit j of fifth-bit byte
    o + 16 + l % 32 for value l of sub-block j (ggml's dequantize_row_q5_K)."""
    s = [int(v) for v in src[o + 4:o + 16]]
    sc = [s[j] & 63 if j < 4 else (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4) for j in range(8)]
    mn = [s[j + 4] & 63 if j < 4 else (s[j + 4] >> 4) | ((s[j] >> 6) << 4) for j in range(8)]
    qh = src[o + 16:o + 48].astype(np.int64)
    q = src[o + 48:o + 176].astype(np.int64)
    codes = np.concatenate([(q[32 * (j // 2):32 * (j // 2) + 32] >> (4 * (j % 2)) & 15) + 16 * (qh >> j & 1)
                            for j in range(8)])
    xv = x[y:y + 256].astype(np.int64)
    isc = sum(sc[j] * int(codes[32 * j:32 * j + 32] @ xv[32 * j:32 * j + 32]) for j in range(8))
    return isc, sum(mn[j] * int(xv[32 * j:32 * j + 32].sum()) for j in range(8))


def _q2_k_sums(src, o, x, y):
    """The same for a Q2_K block: 2-bit codes at shifts 0, 2, 4, 6 of two 32-byte groups, a 4-bit scale and min
    per 16 values."""
    sb = src[o:o + 16].astype(np.int64)
    q = src[o + 16:o + 80].astype(np.int64)
    codes = np.concatenate([(q[32 * h:32 * h + 32] >> (2 * j)) & 3 for h in range(2) for j in range(4)])
    xv = x[y:y + 256].astype(np.int64)
    isc = sum(int(sb[r] & 15) * int(codes[16 * r:16 * r + 16] @ xv[16 * r:16 * r + 16]) for r in range(16))
    return isc, sum(int(sb[r] >> 4) * int(xv[16 * r:16 * r + 16].sum()) for r in range(16))


@pytest.mark.parametrize("name,sums", [("q4_k", _q4_k_sums), ("q2_k", _q2_k_sums)])
def test_idot_k_block(rng, avx512bw, name, sums):
    """One block: d * the scaled dots - dmin * the mins against the activations' sums, exactly."""
    src, x = _bytes(rng, 400), np.maximum(_bytes(rng, 600).view(np.int8), -127)
    for o, y in [(3, 0), (150, 301)]:
        isc, imin = sums(src, o, x, y)
        xs16 = np.zeros(40, np.int32)
        xs16[3:19] = x[y:y + 256].astype(np.int64).reshape(16, 16).sum(axis=1)
        d, dmin = np.float32(0.375), np.float32(-1.25)
        want = d * np.float32(isc) - dmin * np.float32(imin)
        assert _compiled(f"idot_{name}_block")(src, o, x, y, xs16, 3, d, dmin) == want


@pytest.mark.skipif(not simd.HAS_AVX512BW, reason="this CPU has no AVX-512BW")
@pytest.mark.parametrize("name,sums,size,at", [
    ("q4_k", _q4_k_sums, 144, 0), ("q2_k", _q2_k_sums, 84, 80),
    pytest.param("q5_k", _q5_k_sums, 176, 0, marks=pytest.mark.skipif(not simd.HAS_GFNI, reason="no GFNI"))])
def test_fdot_k_blocks(rng, name, sums, size, at):
    """Whole rows (three blocks; and the first alone): sum_b xd[b] (d_b isc_b - dmin_b imin_b), d and dmin the
    block's fp16 pair at byte `at`."""
    nb = 3
    src, x = _bytes(rng, size * nb), np.maximum(_bytes(rng, 256 * nb).view(np.int8), -127)
    for b in range(nb):
        src[size * b + at:size * b + at + 4] = _random_halves(rng, 2)
    xd = rng.uniform(0.01, 1.0, nb).astype(np.float32)
    xs16 = x.astype(np.int64).reshape(-1, 16).sum(axis=1).astype(np.int32)
    terms, bound = [], 0.0
    for b in range(nb):
        d, dmin = src[size * b + at:size * b + at + 4].view(np.float16).astype(np.float64)
        isc, imin = sums(src, size * b, x, 256 * b)
        terms.append(float(xd[b]) * (d * isc - dmin * imin))
        bound += float(xd[b]) * (abs(d) + abs(dmin)) * 63 * 63 * 127 * 256
    for blocks in (nb, 1):
        got = _compiled(f"fdot_{name}_blocks")(src, x, xd, xs16, blocks)
        assert abs(got - sum(terms[:blocks])) <= 1e-6 * bound, blocks


def _q2_0_halves(src, o, x, xo):
    """(sum (code - 1) x over values 0-31, the same over 32-63) of the Q2_0 block at src[o] with x[xo:]: weight
    j's 2-bit code at bits 2 (j % 4) of byte j // 4 after the fp16 d, value code - 1."""
    codes = np.array([(int(src[o + 2 + j // 4]) >> (2 * (j % 4))) & 3 for j in range(64)], np.int64)
    xv = x[xo:xo + 64].astype(np.int64)
    return tuple(int((codes[32 * h:32 * h + 32] - 1) @ xv[32 * h:32 * h + 32]) for h in range(2))


def test_idot_q2_0_block(rng, avx512bw):
    """A Q2_0 block's two 32-value halves, the -1 taken off against the activations' 16-sums."""
    src, x = _bytes(rng, 100), np.maximum(_bytes(rng, 300).view(np.int8), -127)
    for o, xo in [(0, 0), (41, 77)]:
        xs16 = np.zeros(10, np.int32)
        xs16[3:7] = x[xo:xo + 64].astype(np.int64).reshape(4, 16).sum(axis=1)
        assert _compiled("idot_q2_0_block")(src, o, x, xo, xs16, 3) == _q2_0_halves(src, o, x, xo)


@pytest.mark.skipif(not simd.HAS_AVX512BW, reason="this CPU has no AVX-512BW")
def test_fdot_q2_0_blocks(rng):
    """Whole Q2_0 rows (three blocks; and the first alone): sum_b d_b (xd[2b] lo_b + xd[2b + 1] hi_b)."""
    nb = 3
    src, x = _bytes(rng, 18 * nb), np.maximum(_bytes(rng, 64 * nb).view(np.int8), -127)
    for b in range(nb):
        src[18 * b:18 * b + 2] = _random_halves(rng, 1)
    xd = rng.uniform(0.01, 1.0, 2 * nb).astype(np.float32)
    xs16 = x.astype(np.int64).reshape(-1, 16).sum(axis=1).astype(np.int32)
    d = src.reshape(nb, 18)[:, :2].copy().view(np.float16).astype(np.float64).reshape(-1)
    terms = []
    for b in range(nb):
        lo, hi = _q2_0_halves(src, 18 * b, x, 64 * b)
        terms.append(d[b] * (float(xd[2 * b]) * lo + float(xd[2 * b + 1]) * hi))
    bound = float(np.abs(d).sum()) * 2 * 64 * 127
    for blocks in (nb, 1):
        got = _compiled("fdot_q2_0_blocks")(src, x, xd, xs16, blocks)
        assert abs(got - sum(terms[:blocks])) <= 1e-6 * bound, blocks


def _iq2_xs_want(src, o, x, xo):
    """The integer sum of the IQ2_XS block at src[o] with x[xo:xo + 256], decoded here in numpy from gguf's grid
    and sign tables."""
    from gguf import quants

    quants.IQ2_XS.init_grid()
    grid = quants.IQ2_XS.grid.reshape(512, 8).astype(np.int64)
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8)
    codes = src[o + 2:o + 66].copy().view(np.uint16)
    want = 0
    for g in range(32):  # 8-value groups; a scale nibble covers two
        sc = (int(src[o + 66 + g // 4]) >> (4 * ((g // 2) % 2))) & 15
        sign_bits = int(ksigns[int(codes[g]) >> 9])
        for j in range(8):
            v = int(grid[int(codes[g]) & 511, j]) * (-1 if (sign_bits >> j) & 1 else 1)
            want += (2 * sc + 1) * v * int(x[xo + 8 * g + j])
    return want


def test_idot_iq2_xs_block(rng, avx512bw, grid_read):
    """IQ2_XS blocks against gguf's grid and sign tables."""
    from strata_async.kernels import quant, quant_iq  # noqa: F401 - quant first: it loads the formats in order

    src, x = _bytes(rng, 200), np.maximum(_bytes(rng, 300).view(np.int8), -127)  # ggml's codes: never -128
    src[3:11] = (0, 0, 255, 1, 255, 255, 0, 2)  # codes 0, 511, 65535, 512 in the first block at o = 1
    src[67:69] = (0xF0, 0x0F)  # scales 15 and 0 side by side
    for o, xo in [(1, 0), (100, 41)]:
        assert _compiled("idot_iq2_xs_block")(quant_iq._IQ2XS_TABLES, src, o, x, xo) == _iq2_xs_want(src, o, x, xo)


@pytest.mark.skipif(not simd.HAS_AVX512BW, reason="this CPU has no AVX-512BW")
def test_fdot_iq2_xs_blocks(rng, grid_read):
    """Whole IQ2_XS rows (two blocks a step and an odd last one: 5, 4, 1 blocks): sum_b d_b / 8 * xd[b] * the
    block's integer sum."""
    from strata_async.kernels import quant, quant_iq  # noqa: F401

    nb = 5
    src, x = _bytes(rng, 74 * nb), np.maximum(_bytes(rng, 256 * nb).view(np.int8), -127)
    for b in range(nb):
        src[74 * b:74 * b + 2] = _random_halves(rng, 1)
    xd = rng.uniform(0.01, 1.0, nb).astype(np.float32)
    d = src.reshape(nb, 74)[:, :2].copy().view(np.float16).astype(np.float64).reshape(-1)
    terms = [d[b] / 8 * float(xd[b]) * _iq2_xs_want(src, 74 * b, x, 256 * b) for b in range(nb)]
    bound = float(np.abs(d * xd).sum()) / 8 * 31 * 43 * 127 * 256
    for blocks in (nb, 4, 1):
        got = _compiled("fdot_iq2_xs_blocks")(quant_iq._IQ2XS_TABLES, src, x, xd, blocks)
        assert abs(got - sum(terms[:blocks])) <= 1e-6 * bound, blocks


def _iq2_xs_values(src, o):
    """The 256 signed grid values of the IQ2_XS block at src[o] (scales not applied), from gguf's tables."""
    from gguf import quants

    quants.IQ2_XS.init_grid()
    grid = quants.IQ2_XS.grid.reshape(512, 8).astype(np.int64)
    ksigns = np.frombuffer(quants.IQ2_XXS.ksigns, np.uint8)
    codes = src[o + 2:o + 66].copy().view(np.uint16).astype(np.int64)
    signs = np.unpackbits(ksigns[codes >> 9][:, None], axis=1, bitorder="little").astype(np.int64)
    return (grid[codes & 511] * (1 - 2 * signs)).reshape(-1)


@pytest.mark.skipif(not simd.HAS_AVX512BW, reason="this CPU has no AVX-512BW")
def test_iq2_xs_codes256(rng, grid_read):
    """A block's tile codes are 43 plus its signed grid values, for every grid point and sign index."""
    from strata_async.kernels import quant, quant_iq, simd_gemm  # noqa: F401

    nb = 2048 + 1  # every uint16 group code once in the first 2048 blocks, then one of random bytes
    blocks = _bytes(rng, 74 * nb).reshape(nb, 74)
    blocks[:2048, 2:66] = np.arange(65536, dtype=np.uint16).reshape(2048, 32).view(np.uint8)
    src = np.concatenate([np.zeros(1, np.uint8), blocks.reshape(-1)])  # an odd offset
    dst = np.zeros(300, np.uint8)
    run = _compiled("iq2_xs_codes256", simd_gemm)
    for b in range(nb):
        o = 1 + 74 * b
        run(quant_iq._IQ2XS_TABLES, src, o, dst, 7)
        np.testing.assert_array_equal(dst[7:263].astype(np.int64), 43 + _iq2_xs_values(src, o))
        assert not dst[:7].any() and not dst[263:].any()


@pytest.mark.skipif(not simd.HAS_AVX512BW, reason="this CPU has no AVX-512BW")
def test_iq2_xs_codes256_pair(rng, grid_read):
    """Two blocks of two arrays decoded at once (one grid look-up) give each block's own codes."""
    from strata_async.kernels import quant, quant_iq, simd_gemm  # noqa: F401

    a, b = _bytes(rng, 74 * 5 + 3), _bytes(rng, 74 * 4)
    dst_a, dst_b = np.zeros(256, np.uint8), np.zeros(256, np.uint8)
    run = _compiled("iq2_xs_codes256_pair", simd_gemm)
    for oa, ob in [(3, 0), (3 + 74 * 4, 74 * 3), (77, 74)]:
        run(quant_iq._IQ2XS_TABLES, a, oa, dst_a, b, ob, dst_b)
        np.testing.assert_array_equal(dst_a.astype(np.int64), 43 + _iq2_xs_values(a, oa))
        np.testing.assert_array_equal(dst_b.astype(np.int64), 43 + _iq2_xs_values(b, ob))


def test_fdot_iq2_xs_row(rng, grid_read):
    """The float dot of an IQ2_XS row: sum_b d_b / 8 * sum (2 s + 1) * value * x, against float64."""
    from strata_async.kernels import quant, quant_iq  # noqa: F401

    nb = 3
    src = _bytes(rng, 74 * nb)
    for b in range(nb):
        src[74 * b:74 * b + 2] = _random_halves(rng, 1)
    x = rng.standard_normal(256 * nb).astype(np.float32)
    want = 0.0
    for b in range(nb):
        d = float(src[74 * b:74 * b + 2].copy().view(np.float16)[0])
        nib = np.array([(int(src[74 * b + 66 + j // 2]) >> (4 * (j % 2))) & 15 for j in range(16)], np.float64)
        scales = np.repeat(2 * nib + 1, 16)
        want += d / 8 * float(np.dot(scales * _iq2_xs_values(src, 74 * b), x[256 * b:256 * (b + 1)]))
    bound = sum(abs(float(src[74 * b:74 * b + 2].copy().view(np.float16)[0])) for b in range(nb)) / 8 * 31 * 43 * \
        float(np.abs(x).sum())
    got = _compiled("fdot_iq2_xs_row")(quant_iq._IQ2XS_TABLES, src, x, nb)
    assert abs(got - want) <= 1e-6 * bound


@numba.njit
def _products_flushed(x, y, out):
    old = simd.flush_subnormals(True)
    for i in range(x.shape[0]):
        out[i] = x[i] * y[i]
    simd.flush_subnormals(False)  # clears the bits again
    for i in range(x.shape[0]):
        out[x.shape[0] + i] = x[i] * y[i]
    simd.flush_subnormals(True)
    simd.flush_subnormals(old)
    for i in range(x.shape[0]):
        out[2 * x.shape[0] + i] = x[i] * y[i]


@pytest.mark.skipif(not simd.HAS_MXCSR, reason="the SSE control register is x86's")
def test_flush_subnormals_sets_and_restores():
    """Products below 1.18e-38 are zero while flushing, subnormal again once cleared or restored."""
    x = np.array([1e-30, 1e-20, 3.0], np.float32)
    y = np.array([1e-10, 1e-19, 2.0], np.float32)
    out = np.empty(9, np.float32)
    _products_flushed(x, y, out)
    np.testing.assert_array_equal(out[:3], [0.0, 0.0, 6.0])
    np.testing.assert_array_equal(out[3:6], x * y)
    np.testing.assert_array_equal(out[6:], x * y)
    assert out[3] > 0 and out[4] > 0
