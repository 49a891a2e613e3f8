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

from .simd import (_FL, _I8, _I32, _I64, HAS_VNNI, PLANES_SCALES, _array_1d, _byte_array, _data, _dpbusd,
                   _iq2_xs_blocks, _load, _planes_blocks, _planes_in_value_order, _splat, _splat_f, _store)


ROWS = 16  # rows per tile: one 512-bit vector of int32 lanes

_V16I = ir.VectorType(_I32, 16)
_V16F = ir.VectorType(ir.FloatType(), 16)


def _i64(builder, v):
    return builder.sext(v, _I64) if v.type.width < 64 else v


def codes_block(nt: int, sb: int, vnni: bool = HAS_VNNI):
    """An intrinsic: out[16 t + i] = sum over the n_sub sub-blocks of row i's values times token t's activations,
    for the nt tokens t (nt x 16 float32 accumulators stay in registers for the whole row length).

    codes uint8 [n_sub * sb * 16] interleaved as above; scale, bias float32 [n_sub * 16] (sub-block-major);
    xq int8: token t's codes at xo + t * ldx; xd, xs at xdo + t * ldxd and xso + t * ldxs: token t's activations
    as int_matmul.TokenCodes holds them for sub-blocks of sb; out float32 [nt * 16].

    Sub-blocks of 16 (Q6_K, Q2_K, IQ2_XS: 16 of them per 256-value Q8_K activation block; xd one scale per
    activation block) sum the sub-blocks' float terms over the activation block and multiply by its scale once
    (~10% faster products in the cache than per sub-block). Sub-blocks of 32 (xd the activation scale of each
    sub-block) take it per sub-block: Q8_0's activation blocks are its sub-blocks, and the factored form was
    3-30% slower there (a loop level over one sub-block), Q4_K's 1-3% faster only.

    With int32 xs (codes offset from their values: -offset times the code sums) each integer sum starts from it
    and the bias is not used: scale * (sum c q - offset * sum q) is the sub-block's sum, one float multiply-add
    per sub-block and token instead of two (a 16 x 2048 IQ2_XS tile times 8 tokens in cache: 149 -> 179 G
    multiply-adds a second). With float32 xs (types with mins: their code sums, times the activation scale for
    sub-blocks of 32) the bias term is a multiply-add of its own."""

    @intrinsic
    def block(typingctx, codes, scale, bias, n_sub, xq, xo, ldx, xd, xdo, ldxd, xs, xso, ldxs, out):
        if not (_array_1d(codes, types.uint8) and _array_1d(scale, types.float32) and _array_1d(bias, types.float32)
                and _array_1d(xq, types.int8) and _array_1d(xd, types.float32)
                and _array_1d(xs, types.float32, types.int32) and _array_1d(out, types.float32)):
            return None
        folded = xs.dtype == types.int32

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

            def xs_at(t, j):
                return builder.load(builder.gep(pxs, [builder.add(s_rows[t], j)]))

            def sub_block(j):
                """Token t's integer sums of sub-block j (<16 x i32> each), the sub-block's scales and biases (none
                when folded: the bias is not read)."""
                if folded:
                    isum = [_splat(builder, xs_at(t, j), 16, 32) for t in range(nt)]
                else:
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
                bv = None if folded else builder.load(builder.bitcast(builder.gep(pb, [soff]), _V16F.as_pointer()),
                                                      align=4)
                return isum, sv, bv

            def fma(acc, a, b):
                return builder.fadd(acc, builder.fmul(a, b, flags=_FL), flags=_FL)

            def bias_term(acc, bv, t, j):
                """acc plus the bias times the xs term (none when folded)."""
                if folded:
                    return acc
                return fma(acc, bv, _splat_f(builder, xs_at(t, j), 16))

            if sb == 16:
                with cgutils.for_range(builder, ldxd_v) as outer:
                    ab = outer.index
                    for t in range(nt):
                        builder.store(fzero, blks[t])
                    with cgutils.for_range(builder, spb) as inner:
                        j = builder.add(builder.mul(ab, spb), inner.index)
                        isum, sv, bv = sub_block(j)
                        for t in range(nt):
                            blk = fma(builder.load(blks[t]), builder.sitofp(isum[t], _V16F), sv)
                            builder.store(bias_term(blk, bv, t, j), blks[t])
                    for t in range(nt):
                        dx = _splat_f(builder, builder.load(builder.gep(pxd, [builder.add(d_rows[t], ab)])), 16)
                        builder.store(fma(builder.load(accs[t]), builder.load(blks[t]), dx), accs[t])
            else:
                with cgutils.for_range(builder, n_sub_v) as loop:
                    j = loop.index
                    isum, sv, bv = sub_block(j)
                    for t in range(nt):
                        dxv = _splat_f(builder, builder.load(builder.gep(pxd, [builder.add(d_rows[t], j)])), 16)
                        a = fma(builder.load(accs[t]), builder.sitofp(isum[t], _V16F), builder.fmul(sv, dxv, flags=_FL))
                        builder.store(bias_term(a, bv, t, j), accs[t])
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
        flip = ir.Constant(ir.VectorType(_I8, 64), [0x80] * 64)
        both = ir.Constant(ir.VectorType(_I32, 64), list(range(64)))
        whole = ir.Constant(_I64, ROWS)
        row_offsets = _tile_rows(builder, o_v, stride_v, whole)
        rows = []
        for ro in row_offsets:
            halves = []
            for j in range(2):
                qp = builder.gep(ps, [builder.add(ro, ir.Constant(_I64, 34 * j + 2))])
                halves.append(builder.load(builder.bitcast(qp, v32.as_pointer()), align=1))
            row = builder.xor(builder.shuffle_vector(halves[0], halves[1], both), flip)
            rows.append(builder.bitcast(row, _V16I))
        _store_interleaved(builder, pt, builder.mul(w0_v, ir.Constant(_I64, 4)), rows)
        for j in range(2):
            _store_scales(builder, _data(context, builder, sig.args[5], scale_v),
                          _data(context, builder, sig.args[6], bias_v), builder.add(s0_v, ir.Constant(_I64, 16 * j)),
                          whole, _q8_0_sub_blocks(builder, ps, [builder.add(r, ir.Constant(_I64, 34 * j))
                                                                for r in row_offsets]))
        return context.get_dummy_value()
    return types.none(src, o, stride, tile, w0, scale, bias, s0), codegen


@intrinsic
def unpack_codes32(typingctx, src, o, shift, mask, flip, dst, y):
    """dst[y + l] = ((src[o + l] >> shift) & mask) ^ flip for l < 32 (bit fields of 32 packed bytes as codes)."""
    if not (_byte_array(src) and _byte_array(dst)):
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
    if not (_byte_array(src) and _byte_array(dst)):
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
    if not (_byte_array(src) and _byte_array(dst)):
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
    """dst[y:y + 256] = the codes 43 +- grid value of the IQ2_XS block at src[o] (grid: quant_iq's
    grid tables, simd.IQ2_XS_POINTS): the points and signs as the decode dot takes them (simd._iq2_xs_blocks)."""
    if not (_array_1d(grid, types.uint64) and _byte_array(src) and _byte_array(dst)):
        return None

    def codegen(context, builder, sig, args):
        grid_v, src_v, o_v, dst_v, y_v = args
        _store_iq2_xs_codes(context, builder, sig.args[0], grid_v, [(sig.args[1], src_v, o_v, sig.args[3], dst_v,
                                                                     y_v)])
        return context.get_dummy_value()
    return types.none(grid, src, o, dst, y), codegen


@intrinsic
def iq2_xs_codes256_pair(typingctx, grid, src_a, oa, dst_a, src_b, ob, dst_b):
    """iq2_xs_codes256 of the blocks at src_a[oa] and src_b[ob] into dst_a[:256] and dst_b[:256], with one grid
    look-up for both (simd._level_words)."""
    if not (_array_1d(grid, types.uint64) and all(_byte_array(a) for a in (src_a, dst_a, src_b, dst_b))):
        return None

    def codegen(context, builder, sig, args):
        zero = ir.Constant(args[2].type, 0)
        _store_iq2_xs_codes(context, builder, sig.args[0], args[0], [
            (sig.args[1], args[1], args[2], sig.args[3], args[3], zero),
            (sig.args[4], args[4], args[5], sig.args[6], args[6], zero)])
        return context.get_dummy_value()
    return types.none(grid, src_a, oa, dst_a, src_b, ob, dst_b), codegen


@intrinsic
def planes_codes256(typingctx, src, o, dst, y):
    """dst[y:y + 256] = the codes 43 +- value of the IQ2_XS_PLANES block at src[o] in value order, as
    iq2_xs_codes256 gives an IQ2_XS block's (simd._planes_blocks with an offset: two vpermb a step; the steps
    shuffled into value order, simd._planes_in_value_order)."""
    if not (_byte_array(src) and _byte_array(dst)):
        return None

    def codegen(context, builder, sig, args):
        src_v, o_v, dst_v, y_v = args
        block, = _planes_blocks(context, builder, None, None, [(sig.args[0], src_v, o_v)], 43)
        for j, codes in enumerate(_planes_in_value_order(builder, [block(step)[0] for step in range(4)])):
            _store(context, builder, sig.args[2], dst_v, builder.add(y_v, ir.Constant(y_v.type, 64 * j)), codes)
        return context.get_dummy_value()
    return types.none(src, o, dst, y), codegen


def _store_iq2_xs_codes(context, builder, grid_ty, grid, blocks, reader=_iq2_xs_blocks):
    """The codes 43 +- grid value of one or two IQ2_XS blocks (or the blocks reader reads), each given as (src
    type, src, o, dst type, dst, y): the block at src[o] into dst[y:y + 256]. Two blocks share one grid look-up."""
    steps = reader(context, builder, grid_ty, grid, [b[:3] for b in blocks], 43)
    for block, (_, _, _, dst_ty, dst_v, y_v) in zip(steps, blocks):
        for step in range(4):
            _store(context, builder, dst_ty, dst_v, builder.add(y_v, ir.Constant(y_v.type, 64 * step)),
                   block(step)[0])


def _tile_rows(builder, o, stride, n):
    """Byte offsets o + i * stride of a tile's 16 rows (i64); rows past the n present repeat row n - 1, whose
    loads are then in bounds (their lanes are zeroed where stored: _store_scales)."""
    o, stride, n = _i64(builder, o), _i64(builder, stride), _i64(builder, n)
    last = builder.sub(n, ir.Constant(_I64, 1))
    rows = []
    for i in range(ROWS):
        c = ir.Constant(_I64, i)
        rows.append(builder.add(o, builder.mul(stride, builder.select(builder.icmp_signed("<", c, n), c, last))))
    return rows


def _rows_half(builder, ps, rows, at):
    """The fp16 value at byte rows[i] + at of each row, as <16 x float>."""
    i16 = ir.IntType(16)
    v = ir.Constant(ir.VectorType(i16, ROWS), ir.Undefined)
    for i, r in enumerate(rows):
        p = builder.bitcast(builder.gep(ps, [builder.add(r, ir.Constant(_I64, at))]), i16.as_pointer())
        v = builder.insert_element(v, builder.load(p, align=1), ir.Constant(_I32, i))
    return builder.fpext(builder.bitcast(v, ir.VectorType(ir.HalfType(), ROWS)), _V16F)


def _byte_columns(builder, ps, rows, at, n_bytes):
    """Bytes at .. at + n_bytes - 1 of the 16 rows as n_bytes columns <16 x i8> (column k: byte at + k of each
    row): 8 bytes of each row a load, transposed by byte shuffles (vpermt2b where the CPU has AVX-512 VBMI)."""
    columns = []
    for q in range(0, n_bytes, 8):
        halves = []
        for h in range(2):  # rows 0-7 and 8-15, 8 bytes each in one <64 x i8>
            v = ir.Constant(ir.VectorType(_I64, 8), ir.Undefined)
            for i in range(8):
                p = builder.gep(ps, [builder.add(rows[8 * h + i], ir.Constant(_I64, at + q))])
                v = builder.insert_element(v, builder.load(builder.bitcast(p, _I64.as_pointer()), align=1),
                                           ir.Constant(_I32, i))
            halves.append(builder.bitcast(v, ir.VectorType(_I8, 64)))
        for k in range(min(8, n_bytes - q)):
            columns.append(builder.shuffle_vector(halves[0], halves[1], ir.Constant(
                ir.VectorType(_I32, ROWS), [8 * i + k if i < 8 else 64 + 8 * (i - 8) + k for i in range(ROWS)])))
    return columns


def _store_scales(builder, ps, pb, at, n, sub_blocks):
    """scale[at + 16 j + i], bias[at + 16 j + i] = lane i of sub_blocks[j] = (scales, biases) <16 x float>, the
    lanes of rows i >= n (past the matrix's end) zero."""
    at = _i64(builder, at)
    lane = ir.Constant(_V16I, list(range(ROWS)))
    live = builder.icmp_signed("<", lane, _splat(builder, n, ROWS, 32))
    zero = _splat16(0.0)
    for j, (sc, bi) in enumerate(sub_blocks):
        off = builder.add(at, ir.Constant(_I64, ROWS * j))
        for ptr, v in ((ps, sc), (pb, bi)):
            builder.store(builder.select(live, v, zero), builder.bitcast(builder.gep(ptr, [off]), _V16F.as_pointer()),
                          align=4)


def _splat16(value):
    return ir.Constant(_V16F, [value] * ROWS)


def _tile_scales_intrinsic(sub_blocks_of):
    """An intrinsic (src, o, stride, n, scale, bias, at) that stores one block of each of a tile's 16 rows' scales
    and biases: row i's block at src[o + i * stride] (src: the matrix's bytes, rows of `stride` bytes; n rows
    present), sub-block j's to scale and bias [at + 16 j + i] (_store_scales). sub_blocks_of(builder, ps, rows)
    gives the block's (scales, biases) per sub-block, <16 x float> each, lane i row i. One vector store per
    sub-block for the 16 rows: a row's scales stored one by one at the tile's stride had been half of an IQ2_XS
    tile decode (0.052 of 0.106 ns per weight, in cache)."""

    @intrinsic
    def scales(typingctx, src, o, stride, n, scale, bias, at):
        if not (_byte_array(src) and _array_1d(scale, types.float32) and _array_1d(bias, types.float32)):
            return None

        def codegen(context, builder, sig, args):
            src_v, o_v, stride_v, n_v, scale_v, bias_v, at_v = args
            ps = _data(context, builder, sig.args[0], src_v)
            rows = _tile_rows(builder, o_v, stride_v, n_v)
            _store_scales(builder, _data(context, builder, sig.args[4], scale_v),
                          _data(context, builder, sig.args[5], bias_v), at_v, n_v, sub_blocks_of(builder, ps, rows))
            return context.get_dummy_value()
        return types.none(src, o, stride, n, scale, bias, at), codegen
    return scales


def _q8_0_sub_blocks(builder, ps, rows):
    """Q8_0 (34 bytes: fp16 d, 32 int8 codes stored as q + 128): scale d, bias -128 d."""
    d = _rows_half(builder, ps, rows, 0)
    return [(d, builder.fmul(d, _splat16(-128.0)))]


def _q2_0_sub_blocks(builder, ps, rows):
    """Q2_0 (18 bytes: fp16 d, 64 2-bit codes, value (code - 1) d): two sub-blocks of scale d, bias -d."""
    d = _rows_half(builder, ps, rows, 0)
    return [(d, builder.fneg(d))] * 2


def _q4_k_sub_blocks(builder, ps, rows):
    """Q4_K (144 bytes: fp16 d and dmin, 12 bytes of 6-bit scales and mins (ggml's get_scale_min_k4), codes):
    scale d * sc_j, bias -(dmin * m_j), eight sub-blocks of 32."""
    d, dmin = _rows_half(builder, ps, rows, 0), _rows_half(builder, ps, rows, 2)
    q = _byte_columns(builder, ps, rows, 4, 12)
    v16 = ir.VectorType(_I8, ROWS)

    def c(v):
        return ir.Constant(v16, [v] * ROWS)

    out = []
    for j in range(8):
        if j < 4:
            sc, mn = builder.and_(q[j], c(63)), builder.and_(q[j + 4], c(63))
        else:
            sc = builder.or_(builder.and_(q[j + 4], c(15)), builder.shl(builder.lshr(q[j - 4], c(6)), c(4)))
            mn = builder.or_(builder.lshr(q[j + 4], c(4)), builder.shl(builder.lshr(q[j], c(6)), c(4)))
        out.append((builder.fmul(d, builder.uitofp(sc, _V16F)),
                    builder.fneg(builder.fmul(dmin, builder.uitofp(mn, _V16F)))))
    return out


def _q2_k_sub_blocks(builder, ps, rows):
    """Q2_K (84 bytes: 16 bytes of 4-bit scale and min, codes, fp16 d and dmin at 80): scale d * (byte j & 15),
    bias -(dmin * (byte j >> 4)), sixteen sub-blocks of 16."""
    d, dmin = _rows_half(builder, ps, rows, 80), _rows_half(builder, ps, rows, 82)
    lo, sh = ir.Constant(ir.VectorType(_I8, ROWS), [15] * ROWS), ir.Constant(ir.VectorType(_I8, ROWS), [4] * ROWS)
    return [(builder.fmul(d, builder.uitofp(builder.and_(b, lo), _V16F)),
             builder.fneg(builder.fmul(dmin, builder.uitofp(builder.lshr(b, sh), _V16F))))
            for b in _byte_columns(builder, ps, rows, 0, 16)]


def _q6_k_sub_blocks(builder, ps, rows):
    """Q6_K (210 bytes: codes, 16 int8 scales at 192, fp16 d at 208; codes stored unsigned, value code - 32):
    scale d * sc_j, bias -32 times it, sixteen sub-blocks of 16."""
    d = _rows_half(builder, ps, rows, 208)
    out = []
    for b in _byte_columns(builder, ps, rows, 192, 16):
        sc = builder.fmul(d, builder.sitofp(b, _V16F))
        out.append((sc, builder.fmul(sc, _splat16(-32.0))))
    return out


def _iq2_xs_sub_blocks(builder, ps, rows, scales_at=66):
    """IQ2_XS (74 bytes: fp16 d, 32 group codes, 8 bytes of 4-bit scales s_j at 66; codes stored as 43 +- grid
    value), or IQ2_XS_PLANES (its scale bytes at scales_at): scale d * (0.5 + s_j) * 0.25 (ggml's order), bias
    -43 times it, sixteen sub-blocks of 16."""
    d = _rows_half(builder, ps, rows, 0)
    v16 = ir.VectorType(_I8, ROWS)
    out = []
    columns = _byte_columns(builder, ps, rows, scales_at, 8)
    for j in range(16):
        nib = builder.and_(builder.lshr(columns[j // 2], ir.Constant(v16, [4 * (j % 2)] * ROWS)),
                           ir.Constant(v16, [15] * ROWS))
        sc = builder.fmul(builder.fmul(d, builder.fadd(_splat16(0.5), builder.uitofp(nib, _V16F))), _splat16(0.25))
        out.append((sc, builder.fmul(sc, _splat16(-43.0))))
    return out


# Per type: one block of 16 rows' scales and biases into a code tile (_tile_scales_intrinsic).
q8_0_tile_scales, q2_0_tile_scales, q4_k_tile_scales, q2_k_tile_scales, q6_k_tile_scales, iq2_xs_tile_scales = (
    _tile_scales_intrinsic(f) for f in (_q8_0_sub_blocks, _q2_0_sub_blocks, _q4_k_sub_blocks, _q2_k_sub_blocks,
                                        _q6_k_sub_blocks, _iq2_xs_sub_blocks))
planes_tile_scales = _tile_scales_intrinsic(lambda builder, ps, rows: _iq2_xs_sub_blocks(builder, ps, rows,
                                                                                       PLANES_SCALES))
