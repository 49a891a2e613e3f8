"""The integer matrix-product block: 16 weight rows times a few tokens' int8 activations (LLVM IR).

A weight row is held as codes c (uint8) with a float scale and bias per sub-block of `sb` values (16 or 32):
value = scale * c + bias. Every ggml type the integer path covers decodes to this form (kernels/code_tiles.py).
With activations x = xd * q (q int8, xd one float per activation block),

    sum over a sub-block of value * x = scale * xd * (sum c q) + bias * (xd * sum q)

so the products are exact integer sums and only two multiply-adds per (sub-block, token) are in floats.

The codes of a tile of 16 rows are interleaved: for each 4 consecutive values, 64 bytes hold rows 0..15's four
codes in turn. One vpdpbusd (AVX-512 VNNI) then multiplies them with a token's 4 activation codes, broadcast,
and adds each row's 4 products into its own int32 lane: 64 multiply-adds per instruction, each lane one row,
so no horizontal sums at all, and the 16 lanes of the scale and bias vectors are the 16 rows' (loaded once per
sub-block for every token). Float32 products of decoded tiles (BLAS) do 16 per instruction.

Without VNNI the same IR is written with widening multiplies and adds (correct everywhere, slower; the
callers keep the float path there: int_matmul.use_codes).
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .simd import (_FL, HAS_VNNI, _array_1d, _byte_array, _data, _dpbusd, _iq2_xs_block, _load, _q4_k_scales_mins,
                   _splat, _splat_f, _store)


ROWS = 16  # rows per tile: one 512-bit vector of int32 lanes

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V16I = ir.VectorType(_I32, 16)
_V16F = ir.VectorType(ir.FloatType(), 16)


def _i64(builder, v):
    return builder.sext(v, _I64) if v.type.width < 64 else v


def codes_block(nt: int, sb: int, vnni: bool = HAS_VNNI):
    """An intrinsic: out[16 t + i] = sum over the n_sub sub-blocks of row i's values times token t's activations,
    for the nt tokens t (nt x 16 float32 accumulators stay in registers for the whole row length).

    codes uint8 [n_sub * sb * 16] interleaved as above; scale, bias float32 [n_sub * 16] (sub-block-major);
    xq int8: token t's codes at xo + t * ldx; xd, xs float32 at xdo + t * ldxd and xso + t * ldxs: token t's
    activations as int_matmul.TokenCodes holds them for sub-blocks of sb; out float32 [nt * 16].

    Sub-blocks of 16 (Q6_K, Q2_K, IQ2_XS: 16 of them per 256-value Q8_K activation block; xd one scale per
    activation block, xs the sub-blocks' code sums) sum scale * isum + bias * code sum over the activation block
    and multiply by its scale once: three float operations per sub-block and token instead of four, ~10% faster
    products in the cache. Sub-blocks of 32 (xd the activation scale of each sub-block, xs that scale times the
    code sum) take it per sub-block: Q8_0's activation blocks are its sub-blocks, and the factored form was
    3-30% slower there (a loop level over one sub-block), Q4_K's 1-3% faster only."""

    @intrinsic
    def block(typingctx, codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out):
        if not (_array_1d(codes, types.uint8) and _array_1d(scale, types.float32) and _array_1d(bias, types.float32)
                and _array_1d(xq, types.int8) and _array_1d(xd, types.float32) and _array_1d(xs, types.float32)
                and _array_1d(out, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            (codes_v, scale_v, bias_v, n_sub_v, xq_v, xo_v, ldx_v, xd_v, xdo_v, ldxd_v, xs_v, xso_v, ldxs_v,
             out_v) = args
            pc = _data(context, builder, sig.args[0], codes_v)
            ps = _data(context, builder, sig.args[1], scale_v)
            pb = _data(context, builder, sig.args[2], bias_v)
            px = _data(context, builder, sig.args[4], xq_v)
            pxd = _data(context, builder, sig.args[7], xd_v)
            pxs = _data(context, builder, sig.args[10], xs_v)
            po = _data(context, builder, sig.args[13], out_v)
            xo_v, ldx_v, xdo_v, ldxd_v, xso_v, ldxs_v, n_sub_v = (
                _i64(builder, v) for v in (xo_v, ldx_v, xdo_v, ldxd_v, xso_v, ldxs_v, n_sub_v))
            spb = builder.udiv(n_sub_v, ldxd_v)  # sub-blocks per activation block
            x_rows = [builder.add(xo_v, builder.mul(ldx_v, ir.Constant(_I64, t))) for t in range(nt)]
            s_rows = [builder.add(xso_v, builder.mul(ldxs_v, ir.Constant(_I64, t))) for t in range(nt)]
            d_rows = [builder.add(xdo_v, builder.mul(ldxd_v, ir.Constant(_I64, t))) for t in range(nt)]
            fzero = ir.Constant(_V16F, [0.0] * 16)
            accs = [cgutils.alloca_once_value(builder, fzero) for _ in range(nt)]
            blks = [cgutils.alloca_once_value(builder, fzero) for _ in range(nt)]

            def sub_block(j):
                """Token t's integer sums of sub-block j (<16 x i32> each), the sub-block's scales and biases."""
                isum = [ir.Constant(_V16I, [0] * 16)] * nt
                cbase = builder.mul(j, ir.Constant(_I64, sb * ROWS))
                xbase = builder.mul(j, ir.Constant(_I64, sb))
                for s in range(sb // 4):
                    wp = builder.gep(pc, [builder.add(cbase, ir.Constant(_I64, 64 * s))])
                    w = builder.load(builder.bitcast(wp, _V16I.as_pointer()), align=1)
                    for t in range(nt):
                        xp = builder.gep(px, [builder.add(x_rows[t], builder.add(xbase, ir.Constant(_I64, 4 * s)))])
                        x4 = builder.load(builder.bitcast(xp, _I32.as_pointer()), align=1)
                        isum[t] = _dpbusd(builder, isum[t], w, _splat(builder, x4, 16, 32), vnni)
                soff = builder.mul(j, ir.Constant(_I64, ROWS))
                sv = builder.load(builder.bitcast(builder.gep(ps, [soff]), _V16F.as_pointer()), align=4)
                bv = builder.load(builder.bitcast(builder.gep(pb, [soff]), _V16F.as_pointer()), align=4)
                return isum, sv, bv

            def fma(acc, a, b):
                return builder.fadd(acc, builder.fmul(a, b, flags=_FL), flags=_FL)

            if sb == 16:
                with cgutils.for_range(builder, ldxd_v) as outer:
                    ab = outer.index
                    for t in range(nt):
                        builder.store(fzero, blks[t])
                    with cgutils.for_range(builder, spb) as inner:
                        j = builder.add(builder.mul(ab, spb), inner.index)
                        isum, sv, bv = sub_block(j)
                        for t in range(nt):
                            sx = _splat_f(builder, builder.load(builder.gep(pxs, [builder.add(s_rows[t], j)])), 16)
                            blk = fma(builder.load(blks[t]), builder.sitofp(isum[t], _V16F), sv)
                            builder.store(fma(blk, bv, sx), blks[t])
                    for t in range(nt):
                        dx = _splat_f(builder, builder.load(builder.gep(pxd, [builder.add(d_rows[t], ab)])), 16)
                        builder.store(fma(builder.load(accs[t]), builder.load(blks[t]), dx), accs[t])
            else:
                with cgutils.for_range(builder, n_sub_v) as loop:
                    j = loop.index
                    isum, sv, bv = sub_block(j)
                    for t in range(nt):
                        dxv = _splat_f(builder, builder.load(builder.gep(pxd, [builder.add(d_rows[t], j)])), 16)
                        sxv = _splat_f(builder, builder.load(builder.gep(pxs, [builder.add(s_rows[t], j)])), 16)
                        a = fma(builder.load(accs[t]), builder.sitofp(isum[t], _V16F), builder.fmul(sv, dxv, flags=_FL))
                        builder.store(fma(a, bv, sxv), accs[t])
            for t in range(nt):
                op = builder.gep(po, [ir.Constant(_I64, ROWS * t)])
                builder.store(builder.load(accs[t]), builder.bitcast(op, _V16F.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.none(codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out), codegen
    return block


# Blocks of 1 to 8 tokens, for sub-blocks of 32 and of 16 values: a group of tokens runs in blocks of near-equal
# size (int_matmul.tile_times_tokens).
(codes_1x32, codes_2x32, codes_3x32, codes_4x32, codes_5x32, codes_6x32, codes_7x32,
 codes_8x32) = (codes_block(nt, 32) for nt in range(1, 9))
(codes_1x16, codes_2x16, codes_3x16, codes_4x16, codes_5x16, codes_6x16, codes_7x16,
 codes_8x16) = (codes_block(nt, 16) for nt in range(1, 9))


def _transpose16(builder, vecs):
    """16 vectors <16 x i32> as the rows of a matrix -> its columns: four rounds, each swapping one bit of the
    row number with the same bit of the lane number (two-source shuffles)."""
    vecs = list(vecs)
    for b in range(4):
        m = 1 << b
        lo = ir.Constant(ir.VectorType(_I32, 16), [16 + (j & ~m) if j & m else j for j in range(16)])
        hi = ir.Constant(ir.VectorType(_I32, 16), [16 + j if j & m else j | m for j in range(16)])
        for i in range(16):
            if i & m:
                continue
            a, c = vecs[i], vecs[i | m]
            vecs[i], vecs[i | m] = builder.shuffle_vector(a, c, lo), builder.shuffle_vector(a, c, hi)
    return vecs


def _store_interleaved(builder, pt, base, rows):
    """64 codes of each of 16 rows (<16 x i32> each, row i's codes 4 s .. 4 s + 3 in word s) into a tile at byte
    base of pointer pt, interleaved: word s of row i to word 16 s + i."""
    for s, col in enumerate(_transpose16(builder, rows)):
        p = builder.gep(pt, [builder.add(base, ir.Constant(_I64, 64 * s))])
        builder.store(col, builder.bitcast(p, _V16I.as_pointer()), align=1)


@intrinsic
def interleave16(typingctx, stage, n, tile, w0):
    """Codes of 16 rows, row i at stage[i * n : (i + 1) * n] (n a multiple of 64), into the tile's interleaved
    order from word w0 on: tile word w0 + 16 s + i = row i's codes 4 s .. 4 s + 3 (a 16 x 16 transpose of
    32-bit words per 64 codes)."""
    if not (_array_1d(stage, types.uint8) and _array_1d(tile, types.uint8)):
        return None

    def codegen(context, builder, sig, args):
        stage_v, n_v, tile_v, w0_v = args
        ps = _data(context, builder, sig.args[0], stage_v)
        pt = _data(context, builder, sig.args[2], tile_v)
        n_v, w0_v = _i64(builder, n_v), _i64(builder, w0_v)
        with cgutils.for_range(builder, builder.udiv(n_v, ir.Constant(_I64, 64))) as loop:
            c64 = builder.mul(loop.index, ir.Constant(_I64, 64))
            rows = []
            for i in range(16):
                p = builder.gep(ps, [builder.add(builder.mul(n_v, ir.Constant(_I64, i)), c64)])
                rows.append(builder.load(builder.bitcast(p, _V16I.as_pointer()), align=1))
            base = builder.mul(builder.add(w0_v, builder.mul(loop.index, ir.Constant(_I64, 256))), ir.Constant(_I64, 4))
            _store_interleaved(builder, pt, base, rows)
        return context.get_dummy_value()
    return types.none(stage, n, tile, w0), codegen


@intrinsic
def q8_0_tile64(typingctx, src, o, stride, tile, w0, scale, bias, s0):
    """64 values (two Q8_0 blocks) of 16 rows straight into the tile: row i's blocks at src[o + i stride] (34
    bytes each), their codes q + 128 to tile words w0 .. w0 + 255 (interleaved as interleave16 does), the blocks'
    scales d and biases -128 d to scale and bias [s0 + 16 j + i] for block j < 2. Without the staging chunk of
    the generic decode: each row's 64 codes are one vector, flipped and transposed in registers."""
    if not (_byte_array(src) and _array_1d(tile, types.uint8) and _array_1d(scale, types.float32)
            and _array_1d(bias, types.float32)):
        return None

    def codegen(context, builder, sig, args):
        src_v, o_v, stride_v, tile_v, w0_v, scale_v, bias_v, s0_v = args
        ps = _data(context, builder, sig.args[0], src_v)
        pt = _data(context, builder, sig.args[3], tile_v)
        o_v, stride_v, w0_v, s0_v = (_i64(builder, v) for v in (o_v, stride_v, w0_v, s0_v))
        v32 = ir.VectorType(_I8, 32)
        v16h = ir.VectorType(ir.IntType(16), 16)
        flip = ir.Constant(ir.VectorType(_I8, 64), [0x80] * 64)
        both = ir.Constant(ir.VectorType(_I32, 64), list(range(64)))
        rows, ds = [], [ir.Constant(v16h, ir.Undefined)] * 2
        for i in range(16):
            ro = builder.add(o_v, builder.mul(stride_v, ir.Constant(_I64, i)))
            halves = []
            for j in range(2):
                bo = builder.add(ro, ir.Constant(_I64, 34 * j))
                h = builder.load(builder.bitcast(builder.gep(ps, [bo]), ir.IntType(16).as_pointer()), align=1)
                ds[j] = builder.insert_element(ds[j], h, ir.Constant(_I32, i))
                qp = builder.gep(ps, [builder.add(bo, ir.Constant(_I64, 2))])
                halves.append(builder.load(builder.bitcast(qp, v32.as_pointer()), align=1))
            row = builder.xor(builder.shuffle_vector(halves[0], halves[1], both), flip)
            rows.append(builder.bitcast(row, _V16I))
        _store_interleaved(builder, pt, builder.mul(w0_v, ir.Constant(_I64, 4)), rows)
        for j in range(2):
            d = builder.fpext(builder.bitcast(ds[j], ir.VectorType(ir.HalfType(), 16)), _V16F)
            so = builder.add(s0_v, ir.Constant(_I64, 16 * j))
            _store(context, builder, sig.args[5], scale_v, so, d)
            _store(context, builder, sig.args[6], bias_v, so, builder.fmul(d, ir.Constant(_V16F, [-128.0] * 16)))
        return context.get_dummy_value()
    return types.none(src, o, stride, tile, w0, scale, bias, s0), codegen


@intrinsic
def unpack_codes32(typingctx, src, o, shift, mask, flip, dst, y):
    """dst[y + l] = ((src[o + l] >> shift) & mask) ^ flip for l < 32 (bit fields of 32 packed bytes as codes)."""
    if not _byte_array(src) and _byte_array(dst):
        return None

    def codegen(context, builder, sig, args):
        src_v, o_v, shift_v, mask_v, flip_v, dst_v, y_v = args
        v = _load(context, builder, sig.args[0], src_v, o_v, 32)
        v = builder.lshr(v, _splat(builder, shift_v, 32))
        v = builder.xor(builder.and_(v, _splat(builder, mask_v, 32)), _splat(builder, flip_v, 32))
        _store(context, builder, sig.args[5], dst_v, y_v, v)
        return context.get_dummy_value()
    return types.none(src, o, shift, mask, flip, dst, y), codegen


@intrinsic
def q6_codes32(typingctx, src, ql, qh, sl, sh, dst, y):
    """dst[y + l] = ((src[ql + l] >> sl) & 15) | (((src[qh + l] >> sh) & 3) << 4) for l < 32 (Q6_K's 6-bit codes
    from a nibble and a bit pair)."""
    if not _byte_array(src) and _byte_array(dst):
        return None

    def codegen(context, builder, sig, args):
        src_v, ql_v, qh_v, sl_v, sh_v, dst_v, y_v = args
        lo = builder.lshr(_load(context, builder, sig.args[0], src_v, ql_v, 32), _splat(builder, sl_v, 32))
        hi = builder.lshr(_load(context, builder, sig.args[0], src_v, qh_v, 32), _splat(builder, sh_v, 32))
        lo = builder.and_(lo, _splat(builder, ir.Constant(_I8, 15), 32))
        hi = builder.and_(hi, _splat(builder, ir.Constant(_I8, 3), 32))
        v = builder.or_(lo, builder.shl(hi, _splat(builder, ir.Constant(_I8, 4), 32)))
        _store(context, builder, sig.args[5], dst_v, y_v, v)
        return context.get_dummy_value()
    return types.none(src, ql, qh, sl, sh, dst, y), codegen


@intrinsic
def crumb_codes64(typingctx, src, o, dst, y):
    """dst[y + 4 i + s] = (src[o + i] >> 2 s) & 3 for i < 16, s < 4 (Q2_0's 2-bit codes, low bits first)."""
    if not _byte_array(src) and _byte_array(dst):
        return None

    def codegen(context, builder, sig, args):
        src_v, o_v, dst_v, y_v = args
        v = _load(context, builder, sig.args[0], src_v, o_v, 16)
        three = _splat(builder, ir.Constant(_I8, 3), 16)
        parts = [builder.and_(builder.lshr(v, _splat(builder, ir.Constant(_I8, 2 * s), 16)), three) for s in range(4)]
        v01 = builder.shuffle_vector(parts[0], parts[1], ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        v23 = builder.shuffle_vector(parts[2], parts[3], ir.Constant(ir.VectorType(_I32, 32), list(range(32))))
        # lane 4 i + s of the result = lane i of part s = lane 16 s + i of v01 ++ v23
        out = builder.shuffle_vector(v01, v23, ir.Constant(ir.VectorType(_I32, 64),
                                                           [16 * (j % 4) + j // 4 for j in range(64)]))
        _store(context, builder, sig.args[2], dst_v, y_v, out)
        return context.get_dummy_value()
    return types.none(src, o, dst, y), codegen


@intrinsic
def iq2_xs_codes256(typingctx, grid, src, o, dst, y):
    """dst[y:y + 256] = the codes 43 +- grid value of the IQ2_XS block at src[o] (grid: uint64 [points], 8 byte
    magnitudes each): the points by a load each from the 4 KiB grid and the signs computed from the code bits
    (simd._iq2_xs_block, as the decode dot takes them)."""
    if not (_array_1d(grid, types.uint64) and _byte_array(src) and _byte_array(dst)):
        return None

    def codegen(context, builder, sig, args):
        grid_v, src_v, o_v, dst_v, y_v = args
        block = _iq2_xs_block(context, builder, sig.args[0], grid_v, sig.args[1], src_v, o_v)
        v64 = ir.VectorType(_I8, 64)
        c43 = ir.Constant(v64, [43] * 64)
        for step in range(4):
            g8, m8, _ = block(step)
            codes = builder.select(builder.trunc(m8, ir.VectorType(ir.IntType(1), 64)), builder.sub(c43, g8),
                                   builder.add(c43, g8))
            _store(context, builder, sig.args[3], dst_v, builder.add(y_v, ir.Constant(y_v.type, 64 * step)), codes)
        return context.get_dummy_value()
    return types.none(grid, src, o, dst, y), codegen


def _tile_scales(context, builder, scale_ty, scale_v, bias_ty, bias_v, at_v, sc, bi):
    """Store the <n x float> scales sc and biases bi of n consecutive sub-blocks of one tile row at the tile's
    stride: scale[at + 16 j] = sc[j], bias[at + 16 j] = bi[j] for j < n."""
    ps = _data(context, builder, scale_ty, scale_v)
    pb = _data(context, builder, bias_ty, bias_v)
    at_v = _i64(builder, at_v)
    for j in range(sc.type.count):
        off = builder.add(at_v, ir.Constant(_I64, ROWS * j))
        builder.store(builder.extract_element(sc, ir.Constant(_I32, j)), builder.gep(ps, [off]))
        builder.store(builder.extract_element(bi, ir.Constant(_I32, j)), builder.gep(pb, [off]))


def _nibbles16(builder, sb, lanes, shifts):
    """<16 x float> of (sb[lanes[j]] >> shifts[j]) & 15 for bytes sb."""
    v = builder.shuffle_vector(sb, sb, ir.Constant(ir.VectorType(_I32, 16), lanes))
    nib = builder.and_(builder.lshr(v, ir.Constant(ir.VectorType(_I8, 16), shifts)),
                       ir.Constant(ir.VectorType(_I8, 16), [15] * 16))
    return builder.uitofp(nib, ir.VectorType(ir.FloatType(), 16))


@intrinsic
def q4_k_scales8(typingctx, src, o, d, dmin, scale, bias, at):
    """The 8 sub-block scales and biases of the Q4_K block at src[o] (fp16 d and dmin given as floats) into a
    code tile: scale[at + 16 j] = d * sc_j, bias[at + 16 j] = -(dmin * m_j), the 6-bit scales and mins unpacked
    by simd._q4_k_scales_mins (_tile_scales)."""
    if not _tile_args(src, scale, bias):
        return None

    def codegen(context, builder, sig, args):
        src_v, o_v, d_v, dmin_v, scale_v, bias_v, at_v = args
        v8f = ir.VectorType(ir.FloatType(), 8)
        sc, mn = _q4_k_scales_mins(context, builder, sig.args[0], src_v, o_v)
        scales = builder.fmul(_splat_f(builder, d_v, 8), builder.uitofp(sc, v8f))
        mins = builder.fmul(_splat_f(builder, dmin_v, 8), builder.uitofp(mn, v8f))
        _tile_scales(context, builder, sig.args[4], scale_v, sig.args[5], bias_v, at_v, scales, builder.fneg(mins))
        return context.get_dummy_value()
    return types.none(src, o, d, dmin, scale, bias, at), codegen


@intrinsic
def q2_k_scales16(typingctx, src, o, d, dmin, scale, bias, at):
    """The 16 sub-block scales and biases of the Q2_K block at src[o] (fp16 d and dmin given as floats) into a
    code tile: scale[at + 16 j] = d * (byte j & 15), bias[at + 16 j] = -(dmin * (byte j >> 4)); one vector,
    stored at the tile's stride (_tile_scales). Scalar stores through Numba's indexing had cost ~40% of the
    tile decode."""
    if not _tile_args(src, scale, bias):
        return None

    def codegen(context, builder, sig, args):
        src_v, o_v, d_v, dmin_v, scale_v, bias_v, at_v = args
        sb = _load(context, builder, sig.args[0], src_v, o_v, 16)
        sc = builder.fmul(_splat_f(builder, d_v, 16), _nibbles16(builder, sb, list(range(16)), [0] * 16))
        mn = builder.fmul(_splat_f(builder, dmin_v, 16), _nibbles16(builder, sb, list(range(16)), [4] * 16))
        _tile_scales(context, builder, sig.args[4], scale_v, sig.args[5], bias_v, at_v, sc, builder.fneg(mn))
        return context.get_dummy_value()
    return types.none(src, o, d, dmin, scale, bias, at), codegen


def _d_scales_codegen(at_byte, n_bytes, levels, post, offset):
    """The codegen of a block's 16 scales d * levels(bytes) * post into a code tile, biases offset times them
    (_tile_scales): levels maps the <n_bytes x i8> at src[o + at_byte] to <16 x float>."""
    def codegen(context, builder, sig, args):
        src_v, o_v, d_v, scale_v, bias_v, at_v = args
        v16f = ir.VectorType(ir.FloatType(), 16)
        sb = _load(context, builder, sig.args[0], src_v, builder.add(o_v, ir.Constant(o_v.type, at_byte)), n_bytes)
        sc = builder.fmul(builder.fmul(_splat_f(builder, d_v, 16), levels(builder, sb)), ir.Constant(v16f, [post] * 16))
        _tile_scales(context, builder, sig.args[3], scale_v, sig.args[4], bias_v, at_v, sc,
                       builder.fmul(sc, ir.Constant(v16f, [offset] * 16)))
        return context.get_dummy_value()
    return codegen


def _tile_args(src, scale, bias) -> bool:
    return _byte_array(src) and _array_1d(scale, types.float32) and _array_1d(bias, types.float32)


@intrinsic
def q6_k_scales16(typingctx, src, o, d, scale, bias, at):
    """The 16 sub-block scales of the Q6_K block at src[o] (its fp16 d given as a float) into a code tile:
    scale[at + 16 j] = d * int8 scale j, bias[at + 16 j] = -32 times it (_tile_scales)."""
    if not _tile_args(src, scale, bias):
        return None
    return types.none(src, o, d, scale, bias, at), _d_scales_codegen(
        192, 16, lambda builder, sb: builder.sitofp(sb, ir.VectorType(ir.FloatType(), 16)), 1.0, -32.0)


@intrinsic
def iq2_xs_scales16(typingctx, src, o, d, scale, bias, at):
    """The 16 sub-block scales of the IQ2_XS block at src[o] (its fp16 d given as a float) into a code tile:
    scale[at + 16 j] = d * (0.5 + s_j) * 0.25 (ggml's order), bias[at + 16 j] = -43 times it, s_j the 4-bit
    scale of values 16 j .. 16 j + 15 (_tile_scales)."""
    if not _tile_args(src, scale, bias):
        return None

    def levels(builder, sb):
        nib = _nibbles16(builder, sb, [j // 2 for j in range(16)], [0, 4] * 8)
        return builder.fadd(ir.Constant(ir.VectorType(ir.FloatType(), 16), [0.5] * 16), nib)
    return types.none(src, o, d, scale, bias, at), _d_scales_codegen(66, 8, levels, 0.25, -43.0)
