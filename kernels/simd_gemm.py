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

from .simd import HAS_VNNI, _array_1d, _byte_array, _dpbusd, _load, _splat, _splat_f, _store


ROWS = 16  # rows per tile: one 512-bit vector of int32 lanes

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_V16I = ir.VectorType(_I32, 16)
_V16F = ir.VectorType(ir.FloatType(), 16)
_FL = ("reassoc", "nsz", "contract")


def _data(context, builder, ty, ary):
    return context.make_array(ty)(context, builder, ary).data


def _i64(builder, v):
    return builder.sext(v, _I64) if v.type.width < 64 else v


def codes_block(nt: int, sb: int, vnni: bool = HAS_VNNI):
    """An intrinsic: out[16 t + i] = sum over the n_sub sub-blocks of row i's values times token t's activations,
    for the nt tokens t (nt x 16 float32 accumulators stay in registers for the whole row length).

    codes uint8 [n_sub * sb * 16] interleaved as above; scale, bias float32 [n_sub * 16] (sub-block-major);
    xq int8: token t's codes at xo + t * ldx; xd, xs float32: token t's sub-block j activation scale and scale
    times the sub-block's code sum at xso + t * ldxs + j; out float32 [nt * 16]."""

    @intrinsic
    def block(typingctx, codes, scale, bias, n_sub, xq, xo, ldx, xd, xs, xso, ldxs, out):
        if not (_array_1d(codes, types.uint8) and _array_1d(scale, types.float32) and _array_1d(bias, types.float32)
                and _array_1d(xq, types.int8) and _array_1d(xd, types.float32) and _array_1d(xs, types.float32)
                and _array_1d(out, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            codes_v, scale_v, bias_v, n_sub_v, xq_v, xo_v, ldx_v, xd_v, xs_v, xso_v, ldxs_v, out_v = args
            pc = _data(context, builder, sig.args[0], codes_v)
            ps = _data(context, builder, sig.args[1], scale_v)
            pb = _data(context, builder, sig.args[2], bias_v)
            px = _data(context, builder, sig.args[4], xq_v)
            pxd = _data(context, builder, sig.args[7], xd_v)
            pxs = _data(context, builder, sig.args[8], xs_v)
            po = _data(context, builder, sig.args[11], out_v)
            xo_v, ldx_v, xso_v, ldxs_v = (_i64(builder, v) for v in (xo_v, ldx_v, xso_v, ldxs_v))
            x_rows = [builder.add(xo_v, builder.mul(ldx_v, ir.Constant(_I64, t))) for t in range(nt)]
            s_rows = [builder.add(xso_v, builder.mul(ldxs_v, ir.Constant(_I64, t))) for t in range(nt)]
            accs = [cgutils.alloca_once_value(builder, ir.Constant(_V16F, [0.0] * 16)) for _ in range(nt)]
            zero = ir.Constant(_V16I, [0] * 16)
            with cgutils.for_range(builder, _i64(builder, n_sub_v)) as loop:
                j = loop.index
                isum = [zero] * nt
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
                for t in range(nt):
                    k = builder.add(s_rows[t], j)
                    dx = builder.load(builder.gep(pxd, [k]))
                    sx = builder.load(builder.gep(pxs, [k]))
                    dxv, sxv = _splat_f(builder, dx, 16), _splat_f(builder, sx, 16)
                    a = builder.load(accs[t])
                    prod = builder.fmul(builder.sitofp(isum[t], _V16F), builder.fmul(sv, dxv, flags=_FL), flags=_FL)
                    a = builder.fadd(a, prod, flags=_FL)
                    a = builder.fadd(a, builder.fmul(bv, sxv, flags=_FL), flags=_FL)
                    builder.store(a, accs[t])
            for t in range(nt):
                op = builder.gep(po, [ir.Constant(_I64, ROWS * t)])
                builder.store(builder.load(accs[t]), builder.bitcast(op, _V16F.as_pointer()), align=4)
            return context.get_dummy_value()
        return types.none(codes, scale, bias, n_sub, xq, xo, ldx, xd, xs, xso, ldxs, out), codegen
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
            cols = _transpose16(builder, rows)
            base = builder.mul(builder.add(w0_v, builder.mul(loop.index, ir.Constant(_I64, 256))), ir.Constant(_I64, 4))
            for s in range(16):
                p = builder.gep(pt, [builder.add(base, ir.Constant(_I64, 64 * s))])
                builder.store(cols[s], builder.bitcast(p, _V16I.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.none(stage, n, tile, w0), codegen


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
def lookup_codes64(typingctx, table, src, qo, dst, y):
    """dst[y + 8 g : y + 8 g + 8] = the 8 bytes of table[u16 code g at byte qo + 2 g of src] for g < 8: a whole
    group's codes in one load from a table indexed by the group's 16 bits (IQ2_XS: 9-bit grid point, 7 signs)."""
    if not (_array_1d(table, types.uint64) and _byte_array(src) and _byte_array(dst)):
        return None

    def codegen(context, builder, sig, args):
        table_v, src_v, qo_v, dst_v, y_v = args
        pt = _data(context, builder, sig.args[0], table_v)
        ps = _data(context, builder, sig.args[1], src_v)
        pd = _data(context, builder, sig.args[3], dst_v)
        qo_v, y_v = _i64(builder, qo_v), _i64(builder, y_v)
        i16p = ir.IntType(16).as_pointer()
        for g in range(8):
            code = builder.load(builder.bitcast(builder.gep(ps, [builder.add(qo_v, ir.Constant(_I64, 2 * g))]), i16p),
                                align=1)
            word = builder.load(builder.gep(pt, [builder.zext(code, _I64)]))
            out = builder.bitcast(builder.gep(pd, [builder.add(y_v, ir.Constant(_I64, 8 * g))]), _I64.as_pointer())
            builder.store(word, out, align=1)
        return context.get_dummy_value()
    return types.none(table, src, qo, dst, y), codegen
