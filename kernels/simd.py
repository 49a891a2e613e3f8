"""Small vector operations written as LLVM IR, for the block dot products (Numba intrinsics).

LLVM does not vectorize the integer dot products of a ggml block as Numba lowers them: every index into
an array is a signed integer with a wraparound select, and the 16/32-value reductions stay scalar (one
movsx/imul/add per weight, ~0.5 ns per weight on a 3 GHz core, a third of what one core reads from RAM).
Each function here loads one run of bytes as a vector, extracts the codes, multiplies them with int8
activations and sums, in one expression the x86 backend lowers to vpmovsx/vpmaddwd and a short horizontal
add (seen in the generated code). Where the CPU has AVX-512BW, the 4-bit codes go through the instructions
themselves (vpmaddubsw: unsigned codes times int8 activations, pairs added; vpmaddwd: times the sub-block
scales), 64 weights per step: the portable form costs twice the instructions per weight. The half-float
load is one vcvtph2ps instead of a branchy bit decode; it is exact, as is every integer sum here
(|sum| < 2^24).

Arguments are 1-D contiguous uint8/int8 arrays and element offsets into them; nothing is bounds checked
(as Numba's own indexing is not): callers index inside their blocks. Tests compare each function with
numpy on random bytes (tests/test_simd.py); the format tests cover them through the kernels.
"""

import platform

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def _host_features() -> dict:
    try:
        return dict(llvm.get_host_cpu_features())
    except Exception:  # noqa: BLE001 - no feature list: callers keep the portable code
        return {}


def _has_f16c() -> bool:
    """Whether LLVM lowers a half -> float conversion to an instruction here (x86 needs F16C; without it
    LLVM would call a runtime helper the JIT may not link)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    return machine in ("x86_64", "amd64") and bool(_host_features().get("f16c"))


HAS_F16C = _has_f16c()
# AVX-512BW: 64-byte vpmaddubsw/vpmaddwd for the 4-bit dots (else the portable vector IR below, half as fast).
HAS_AVX512BW = platform.machine().lower() in ("x86_64", "amd64") and bool(_host_features().get("avx512bw"))
# AVX-512 VNNI: vpdpbusd, uint8 x int8 products summed by 4 into int32 lanes in one instruction.
HAS_VNNI = HAS_AVX512BW and bool(_host_features().get("avx512vnni"))
# GFNI: vgf2p8affineqb, a bit matrix per 64-bit lane applied to every byte (two nibble unpacks in one instruction).
HAS_GFNI = HAS_AVX512BW and bool(_host_features().get("gfni"))


def _cpu_vendor() -> str:
    """The x86 vendor string of /proc/cpuinfo ("GenuineIntel", "AuthenticAMD"), "" where there is none."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# Intel cores stream rows best when the rows ~2 KiB ahead are asked into L1 (see quant_dispatch.prefetch_row).
IS_INTEL = _cpu_vendor() == "GenuineIntel"
HAS_VBMI_BITALG = HAS_AVX512BW and all(_host_features().get(f) for f in ("avx512vbmi", "avx512bitalg"))
# How the IQ2_XS grid points and signs of a block are read (_iq2_xs_blocks): "permute", the grid's level codes
# looked up in registers, two blocks at a time where the caller has two (_level_words), and the signs taken into
# mask registers (_permuted_steps; AVX-512 VBMI and BITALG; on an AMD EPYC (Zen 4) core, in cache, alternating, the
# integer dot 0.054 -> 0.043-0.050 ns per weight a block at a time, the float dot 0.119 -> 0.110-0.115 against a
# load each; two blocks at a time, 0.050 -> 0.044, fdot_iq2_xs_blocks); "gather",
# eight points by one vpgatherqq (on an Intel Xeon, 2 vCPUs, in cache, alternating runs, the integer dot
# 0.064-0.068 -> 0.053-0.057 ns per weight against a load each, the float dot 0.111-0.117 -> 0.098-0.101; not
# measured there against "permute"); "loads", a load per point.
GRID_READ = "gather" if IS_INTEL and HAS_AVX512BW else "permute" if HAS_VBMI_BITALG else "loads"

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)
_I64 = ir.IntType(64)
_FL = ("reassoc", "nsz", "contract")  # the float flags of the dots' sums: reassociated, contracted to FMAs


def _array_1d(ty, *dtypes) -> bool:
    """Whether a Numba type is a 1-D C-contiguous array of one of these dtypes."""
    return isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C" and ty.dtype in dtypes


def _byte_array(ty) -> bool:
    return _array_1d(ty, types.uint8, types.int8)


def _float_array(ty) -> bool:
    return _array_1d(ty, types.float32)


def _data(context, builder, ary_ty, ary):
    """The data pointer of an array."""
    return context.make_array(ary_ty)(context, builder, ary).data


def _pointer(context, builder, ary_ty, ary, off, elem):
    """Pointer to element `off` of an array, as `elem`*."""
    data = _data(context, builder, ary_ty, ary)
    return builder.bitcast(builder.gep(data, [off]), elem.as_pointer())


def _load_vec(context, builder, ary_ty, ary, off, elem, n):
    """n elements of `elem` type from element offset `off`, as a vector."""
    return builder.load(_pointer(context, builder, ary_ty, ary, off, ir.VectorType(elem, n)), align=1)


def _load(context, builder, ary_ty, ary, off, n):
    """n bytes from byte offset `off`, as <n x i8>."""
    return _load_vec(context, builder, ary_ty, ary, off, _I8, n)


def _at(builder, base, k):
    """base + k, k a Python int."""
    return builder.add(base, ir.Constant(base.type, k))


def _splat(builder, value, n, width=8):
    """A vector of n copies of an integer scalar (truncated to `width` bits)."""
    ty = ir.IntType(width)
    v = builder.trunc(value, ty) if value.type.width > width else builder.zext(value, ty) \
        if value.type.width < width else value
    vec = ir.VectorType(ty, n)
    undef = ir.Constant(vec, ir.Undefined)
    first = builder.insert_element(undef, v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, undef, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _vec_const(width, values):
    return ir.Constant(ir.VectorType(ir.IntType(width), len(values)), list(values))


def _reduce_add(builder, vec, n):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [vec.type]),
                                        f"llvm.vector.reduce.add.v{n}i32")
    return builder.call(fn, [vec])


@intrinsic
def idot_s8_32(typingctx, a, ao, x, xo):
    """sum over i < 32 of int8(a[ao + i]) * x[xo + i] (Q8_0)."""
    if not (_byte_array(a) and _byte_array(x)):
        return None

    def codegen(context, builder, sig, args):
        v32 = ir.VectorType(_I32, 32)
        va = builder.sext(_load(context, builder, sig.args[0], args[0], args[1], 32), v32)
        vx = builder.sext(_load(context, builder, sig.args[2], args[2], args[3], 32), v32)
        return _reduce_add(builder, builder.mul(va, vx), 32)
    return types.int32(a, ao, x, xo), codegen


def _float_lanes_row(context, builder, n, terms):
    """sum over b < n of each (lanes <16 x i32> or <16 x float>, float32 scale) in terms(b): the lanes converted
    (if integer) and multiply-added with their scale (a scalar, or <16 x float> lane by lane) into float lanes,
    reduced once at the end. The row dots below run a whole row this way: a reduction per block had cost 30-45%
    of the integer ones, and the float dots (fdot_*_row) had reduced each block or half-block too."""
    f32 = ir.FloatType()
    v16f = ir.VectorType(f32, 16)
    acc = cgutils.alloca_once_value(builder, ir.Constant(v16f, [0.0] * 16))
    with cgutils.for_range(builder, n) as loop:
        a = builder.load(acc)
        for lanes, scale in terms(loop.index):
            s = scale if isinstance(scale.type, ir.VectorType) else _splat_f(builder, scale, 16)
            v = lanes if isinstance(lanes.type.element, ir.FloatType) else builder.sitofp(lanes, v16f)
            a = builder.fadd(a, builder.fmul(v, s, flags=_FL), flags=_FL)
        builder.store(a, acc)
    return _reduce_fadd(builder, builder.load(acc), 16)


def _half_at(context, builder, ary_ty, ary, off):
    """The fp16 value at byte offset `off` of a byte array, as float32 (vcvtph2ps where HAS_F16C)."""
    h = builder.load(_pointer(context, builder, ary_ty, ary, off, ir.HalfType()), align=1)
    return builder.fpext(h, ir.FloatType())


def _elem(context, builder, ary_ty, ary, i):
    """ary[i] of a 1-D array (no bounds check)."""
    return builder.load(builder.gep(_data(context, builder, ary_ty, ary), [i]))


def _pair_scales16(context, builder, src_ty, src, o, stride, xd_ty, xd, p, scale=None):
    """The float scales of a pair p of 32-value blocks (fp16 d at src[o] and src[o + stride], or what
    scale(context, builder, src_ty, src, offset) reads there) times their activation scales xd[2 p], xd[2 p + 1],
    as 16 lanes: eight for each block (its vpdpbusd lanes)."""
    f32 = ir.FloatType()
    scale = scale or _half_at
    d2 = ir.Constant(ir.VectorType(f32, 2), ir.Undefined)
    for h in range(2):
        d2 = builder.insert_element(d2, scale(context, builder, src_ty, src, _at(builder, o, stride * h)),
                                    ir.Constant(_I32, h))
    xd2 = _load_vec(context, builder, xd_ty, xd, builder.mul(p, ir.Constant(p.type, 2)), f32, 2)
    return _shuffle(builder, builder.fmul(d2, xd2), [i // 8 for i in range(16)])


@intrinsic
def fdot_q8_0_pairs(typingctx, src, x, xd, pairs):
    """sum over blocks b < 2 pairs of a Q8_0 row (34-byte blocks: fp16 d, 32 int8) of d_b * xd[b] * (codes_b .
    x[32 b:32 b + 32]), x int8 in [-127, 127] (ggml's activation codes), two blocks a step: |codes| times x with
    the codes' signs (vpdpbusd, or vpmaddubsw and vpmaddwd without VNNI; AVX-512BW only), the int32 lanes
    into float lanes with each block's d * xd (_float_lanes_row)."""
    if not (_byte_array(src) and _byte_array(x) and _float_array(xd)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v, xd_ty, xd_v = sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2]
        v16i, v64 = ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)
        zero = ir.Constant(v64, [0] * 64)

        def terms(p):
            o = builder.mul(p, ir.Constant(p.type, 68))
            w = builder.shuffle_vector(_load(context, builder, src_ty, src_v, _at(builder, o, 2), 32),
                                       _load(context, builder, src_ty, src_v, _at(builder, o, 36), 32),
                                       _vec_const(32, range(64)))
            xv = _load(context, builder, x_ty, x_v, builder.mul(p, ir.Constant(p.type, 64)), 64)
            neg = builder.icmp_signed("<", w, zero)
            aw = builder.select(neg, builder.sub(zero, w), w)  # -128 -> 0x80: 128 as vpdpbusd's unsigned byte
            sx = builder.select(neg, builder.sub(zero, xv), xv)
            if HAS_VNNI:
                isum = _dpbusd(builder, ir.Constant(v16i, [0] * 16), builder.bitcast(aw, v16i),
                               builder.bitcast(sx, v16i), True)
            else:
                isum = _pmaddwd(builder, _pmaddubsw(builder, aw, sx), _vec_const(16, [1] * 32))
            return [(isum, _pair_scales16(context, builder, src_ty, src_v, o, 34, xd_ty, xd_v, p))]
        return _float_lanes_row(context, builder, args[3], terms)
    return types.float32(src, x, xd, pairs), codegen


def _x86(builder, name, ret, args):
    """A call of an x86 vector instruction's LLVM intrinsic."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _pmaddubsw(builder, codes, x):
    """vpmaddubsw (AVX-512BW): <64 x u8> codes times <64 x i8> x, adjacent products added, as <32 x i16>
    (saturating: callers keep |code * x| * 2 < 2^15)."""
    return _x86(builder, "llvm.x86.avx512.pmaddubs.w.512", ir.VectorType(ir.IntType(16), 32), [codes, x])


def _pmaddwd(builder, a, b):
    """vpmaddwd (AVX-512BW): <32 x i16> a times b, adjacent products added, as <16 x i32>."""
    return _x86(builder, "llvm.x86.avx512.pmaddw.d.512", ir.VectorType(_I32, 16), [a, b])


def _dpbusd(builder, acc, codes, x, vnni):
    """acc + per lane i: sum over j < 4 of uint8 codes byte 4i + j times int8 x byte 4i + j (all <16 x i32>):
    vpdpbusd where vnni, else widening multiplies and adds."""
    v16 = ir.VectorType(_I32, 16)
    if vnni:
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v16, [v16] * 3),
                                            "llvm.x86.avx512.vpdpbusd.512")
        return builder.call(fn, [acc, codes, x])
    v64 = ir.VectorType(_I32, 64)
    prods = builder.mul(builder.zext(builder.bitcast(codes, ir.VectorType(_I8, 64)), v64),
                        builder.sext(builder.bitcast(x, ir.VectorType(_I8, 64)), v64))
    for j in range(4):
        lanes = ir.Constant(v16, [4 * i + j for i in range(16)])
        part = builder.shuffle_vector(prods, prods, lanes)
        acc = builder.add(acc, part)
    return acc


def _madd_scaled(builder, codes, x, scales):
    """sum over each 4 lanes of codes * x * scale as <16 x i32> (AVX-512BW): codes <64 x u8>, x <64 x i8>,
    scales <32 x i16> (one per pair of lanes); sums are exact."""
    return _pmaddwd(builder, _pmaddubsw(builder, codes, x), scales)


# vgf2p8affineqb matrices (result bit i = parity(matrix byte 7 - i & input byte)): a byte's low nibble, its high
# nibble shifted down.
_LOW_NIBBLE, _HIGH_NIBBLE = 0x0102040800000000, 0x1020408000000000


def _affine_bytes(builder, data, matrices):
    """One vgf2p8affineqb: every byte of quadword q of <64 x i8> data through the bit matrix matrices[q] (8 of
    them, as 64-bit integers)."""
    v64 = ir.VectorType(_I8, 64)
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v64, [v64, v64, _I8]),
                                        "llvm.x86.vgf2p8affineqb.512")
    flat = [m >> 8 * j & 0xFF for m in matrices for j in range(8)]
    return builder.call(fn, [data, _vec_const(8, [b - 256 if b > 127 else b for b in flat]), ir.Constant(_I8, 0)])


def _nibbles64(builder, packed):
    """<64 x i8> packed bytes (32 bytes, twice) -> their low nibbles then their high nibbles, one vgf2p8affineqb."""
    return _affine_bytes(builder, packed, [_LOW_NIBBLE] * 4 + [_HIGH_NIBBLE] * 4)


def _madd_runs(builder, codes_a, codes_b, x, scales, first, run):
    """_madd_scaled of the 64 codes codes_a ++ codes_b (two <32 x u8>) with x <64 x i8>, the runs of `run`
    values taking scales[first], scales[first + 1], ... (scales: <n x i16>)."""
    codes = builder.shuffle_vector(codes_a, codes_b, _vec_const(32, range(64)))
    return _madd_scaled(builder, codes, x, _shuffle(builder, scales, [first + 2 * k // run for k in range(32)]))


def _scaled_products(builder, codes, scales16, x, signed=False):
    """(codes * scales) * x over 32 lanes as <32 x i32>: codes <32 x i8> (unsigned unless `signed`), scales
    <32 x i16>, x <32 x i8>. code * scale fits int16 for every format here (6-bit code * int8 scale), so the
    second product is the int16 x int8 multiply-add the backend lowers to vpmaddwd."""
    v16 = ir.VectorType(ir.IntType(16), 32)
    v32 = ir.VectorType(_I32, 32)
    weighted = builder.mul(builder.sext(codes, v16) if signed else builder.zext(codes, v16), scales16)
    return builder.mul(builder.sext(weighted, v32), builder.sext(x, v32))


def _q6_half_codes(context, builder, ary_ty, ary, ql, qh, sc):
    """The four 32-value runs of a Q6_K half as signed (code - 32) <32 x i8>, and its 8 scales as <8 x i16>."""
    ql0 = _load(context, builder, ary_ty, ary, ql, 32)
    ql1 = _load(context, builder, ary_ty, ary, _at(builder, ql, 32), 32)
    qhv = _load(context, builder, ary_ty, ary, qh, 32)
    scales = builder.sext(_load(context, builder, ary_ty, ary, sc, 8), ir.VectorType(ir.IntType(16), 8))
    low4, three, four = _vec_const(8, [15] * 32), _vec_const(8, [3] * 32), _vec_const(8, [4] * 32)
    lows = (builder.and_(ql0, low4), builder.and_(ql1, low4), builder.lshr(ql0, four), builder.lshr(ql1, four))
    codes = []
    for k, low in enumerate(lows):
        high = builder.and_(builder.lshr(qhv, _vec_const(8, [2 * k] * 32)), three)
        code = builder.or_(low, builder.shl(high, four))
        codes.append(builder.sub(code, _vec_const(8, [32] * 32)))
    return codes, scales


def _q6_half_codes64(context, builder, ary_ty, ary, ql, qh):
    """The unsigned 6-bit codes of a Q6_K half as two <64 x u8>: values 0-63 (low nibbles of the 64 ql bytes, bit
    pairs 0 and 1 of the 32 qh bytes) and 64-127 (high nibbles, bit pairs 2 and 3). Whole 64-byte vectors: the
    high bit pairs by one 16-bit shift per vector (left 4 / 2 or right 0 / 2 in its two halves: the bits a shift
    carries across bytes fall outside the mask 0x30), where 32-byte runs had taken twice the instructions."""
    v64 = ir.VectorType(_I8, 64)
    w32 = ir.VectorType(ir.IntType(16), 32)
    ql64 = _load(context, builder, ary_ty, ary, ql, 64)
    qh32 = _load(context, builder, ary_ty, ary, qh, 32)
    qh64 = builder.bitcast(_twice32(builder, qh32), w32)
    low4, high2 = _vec_const(8, [15] * 64), _vec_const(8, [0x30] * 64)
    lows = builder.and_(ql64, low4)
    highs = builder.and_(builder.lshr(ql64, _vec_const(8, [4] * 64)), low4)
    bits_a = builder.bitcast(builder.shl(qh64, _vec_const(16, [4] * 16 + [2] * 16)), v64)
    bits_b = builder.bitcast(builder.lshr(qh64, _vec_const(16, [0] * 16 + [2] * 16)), v64)
    return builder.or_(lows, builder.and_(bits_a, high2)), builder.or_(highs, builder.and_(bits_b, high2))


@intrinsic
def idot_q6_half(typingctx, src, ql, qh, sc, x, xo):
    """One half (128 weights) of a Q6_K block times int8 activations, each 16-run times its int8 scale:
    sum_k sum_i scale[k] * (code_i - 32) * x_i with the 6-bit codes from 64 low-nibble bytes at ql and 32
    high-bit bytes at qh, the 8 scales at sc; one reduction for all 128. The portable form (plain vector
    products); with AVX-512BW whole rows go through fdot_q6_k_blocks."""
    if not (_byte_array(src) and _byte_array(x)):
        return None

    def codegen(context, builder, sig, args):
        codes, scales = _q6_half_codes(context, builder, sig.args[0], args[0], args[1], args[2], args[3])
        x_ty, x_v, xo_v = sig.args[4], args[4], args[5]
        total = None
        for k in range(4):
            sc16 = builder.shuffle_vector(scales, scales, _vec_const(32, [2 * k] * 16 + [2 * k + 1] * 16))
            x8 = _load(context, builder, x_ty, x_v, _at(builder, xo_v, 32 * k), 32)
            part = _scaled_products(builder, codes[k], sc16, x8, True)
            total = part if total is None else builder.add(total, part)
        return _reduce_add(builder, total, 32)
    return types.int32(src, ql, qh, sc, x, xo), codegen


@intrinsic
def fdot_q6_k_blocks(typingctx, src, x, xd, xs16, blocks):
    """sum over the first `blocks` Q6_K blocks of a row (210 bytes: 128 low-nibble bytes, 64 high-bit bytes, 16
    int8 scales, fp16 d) of d * xd[b] * sum_k scale_k * ((codes - 32) . x) over its 16-runs k, x int8 with its
    16-sums xs16 (AVX-512BW only). Per block the unsigned codes go through vpmaddubsw/vpmaddwd into int32 lanes,
    the offset comes off lane-wise as 32 * scale_k * xs16[k], and the lanes go into float lanes with d * xd[b]
    (_float_lanes_row)."""
    if not (_byte_array(src) and _byte_array(x) and _float_array(xd) and _int32_array(xs16)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v, xd_ty, xd_v, xs_ty, xs_v = (sig.args[0], args[0], sig.args[1], args[1],
                                                              sig.args[2], args[2], sig.args[3], args[3])
        v16i = ir.VectorType(_I32, 16)

        def terms(b):
            o = builder.mul(b, ir.Constant(b.type, 210))
            y = builder.mul(b, ir.Constant(b.type, 256))
            total = None
            for half in range(2):
                codes = _q6_half_codes64(context, builder, src_ty, src_v, _at(builder, o, 64 * half),
                                         _at(builder, o, 128 + 32 * half))
                scales = builder.sext(_load(context, builder, src_ty, src_v, _at(builder, o, 192 + 8 * half), 8),
                                      ir.VectorType(ir.IntType(16), 8))
                for c in range(2):  # values 64 c .. 64 c + 63 of the half: 64 activations, four scales
                    x64 = _load(context, builder, x_ty, x_v, _at(builder, y, 128 * half + 64 * c), 64)
                    part = _madd_scaled(builder, codes[c], x64, _shuffle(builder, scales, [4 * c + k // 8
                                                                                          for k in range(32)]))
                    total = part if total is None else builder.add(total, part)
            scales16 = builder.sext(_load(context, builder, src_ty, src_v, _at(builder, o, 192), 16), v16i)
            sums = _load_vec(context, builder, xs_ty, xs_v, builder.mul(b, ir.Constant(b.type, 16)), _I32, 16)
            total = builder.sub(total, builder.shl(builder.mul(scales16, sums), _vec_const(32, [5] * 16)))
            d = _half_at(context, builder, src_ty, src_v, _at(builder, o, 208))
            return [(total, builder.fmul(d, _elem(context, builder, xd_ty, xd_v, b)))]
        return _float_lanes_row(context, builder, args[4], terms)
    return types.float32(src, x, xd, xs16, blocks), codegen


def _shuffle(builder, vec, lanes):
    return builder.shuffle_vector(vec, vec, _vec_const(32, lanes))


def _pair_sums(builder, vec, n):
    """Lanes 2i and 2i + 1 of an integer <n x iN> added: <n / 2 x iN>."""
    return builder.add(_shuffle(builder, vec, range(0, n, 2)), _shuffle(builder, vec, range(1, n, 2)))


def _int32_array(ty) -> bool:
    return _array_1d(ty, types.int32)


def _kblock_args(sig, args):
    """(src type, src, o, xq type, xq, y, xs16 type, xs16, g, d, dmin) of a k-quant block dot."""
    return (sig.args[0], args[0], args[1], sig.args[2], args[2], args[3], sig.args[4], args[4], args[5], args[6],
            args[7])


def _scales_minus_mins(builder, d, isc, dmin, imin):
    """d * isc - dmin * imin in float32 (integer sums isc, imin)."""
    f32 = ir.FloatType()
    return builder.fsub(builder.fmul(d, builder.sitofp(isc, f32)), builder.fmul(dmin, builder.sitofp(imin, f32)))


# vgf2p8affineqb matrices of the Q4_K scale unpack (_q4_k_scales_mins): a byte's low six bits, its top two bits
# moved to bits 4-5, nothing.
_LOW_SIX, _TOP_TWO_UP, _ZERO = 0x0102040810200000, 0x40800000, 0
# Per quadword of the 64 bytes unpacked: (the source bytes' indices into the 12 scale bytes, the matrix). The low
# four quadwords give sc 0-3, the low nibbles of sc 4-7, m 0-3 and the low nibbles of m 4-7; the high four the
# top bits of sc 4-7 (quadword 5) and m 4-7 (quadword 7), ORed onto them.
_Q4_K_SCALE_QUADS = (((0, 1, 2, 3), _LOW_SIX), ((8, 9, 10, 11), _LOW_NIBBLE), ((4, 5, 6, 7), _LOW_SIX),
                     ((8, 9, 10, 11), _HIGH_NIBBLE), ((0, 1, 2, 3), _ZERO), ((0, 1, 2, 3), _TOP_TWO_UP),
                     ((0, 1, 2, 3), _ZERO), ((4, 5, 6, 7), _TOP_TWO_UP))


def _q4_k_scales_mins(context, builder, src_ty, src, o):
    """A Q4_K block's eight 6-bit scales and eight mins (ggml's get_scale_min_k4) as two <8 x i8>, unpacked
    from the 12 bytes at o + 4: with GFNI one byte permute, one vgf2p8affineqb (a bit matrix per quadword:
    the masks and shifts of every scale at once) and an OR of its halves, ~5 instructions where the shuffles
    and masks below take ~13."""
    v8 = ir.VectorType(_I8, 8)
    sb = _load(context, builder, src_ty, src, _at(builder, o, 4), 16)  # the 12 scale bytes (+4 of codes)
    if HAS_GFNI:
        spread = _shuffle(builder, sb, [i for idx, _ in _Q4_K_SCALE_QUADS for i in idx * 2])
        bits = _affine_bytes(builder, spread, [m for _, m in _Q4_K_SCALE_QUADS])
        both = builder.or_(_shuffle(builder, bits, range(32)), _shuffle(builder, bits, range(32, 64)))
        return _shuffle(builder, both, [0, 1, 2, 3, 8, 9, 10, 11]), _shuffle(builder, both, [16, 17, 18, 19, 24, 25,
                                                                                               26, 27])
    low_half = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1, 1, 1, 1, 0, 0, 0, 0])

    def lanes(idx):
        return builder.shuffle_vector(sb, sb, _vec_const(32, idx))

    def const8(v):
        return ir.Constant(v8, [v] * 8)

    a, b = lanes([0, 1, 2, 3, 8, 9, 10, 11]), lanes([0, 1, 2, 3, 0, 1, 2, 3])
    c, e = lanes([4, 5, 6, 7, 8, 9, 10, 11]), lanes([4, 5, 6, 7, 4, 5, 6, 7])
    hi2 = builder.shl(builder.lshr(b, const8(6)), const8(4))
    sc = builder.select(low_half, builder.and_(a, const8(63)), builder.or_(builder.and_(a, const8(15)), hi2))
    hi2m = builder.shl(builder.lshr(e, const8(6)), const8(4))
    mn = builder.select(low_half, builder.and_(c, const8(63)), builder.or_(builder.lshr(c, const8(4)), hi2m))
    return sc, mn


def _k4_row_codegen(size, nibbles_at, fifth_at=None):
    """The codegen of fdot_q4_k_row (and of fdot_q5_k_row: blocks of `size` bytes, the nibbles from byte
    `nibbles_at`, and with fifth_at the fifth code bits from there, bit j of byte l % 32 for value l of sub-block
    j, one shift, mask and OR per 16 codes)."""
    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v, xs_ty, xs_v = sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2]
        f32 = ir.FloatType()
        v16i, v16f, v8f = ir.VectorType(_I32, 16), ir.VectorType(f32, 16), ir.VectorType(f32, 8)

        def terms(b):
            o = builder.mul(b, ir.Constant(b.type, size))
            y = builder.mul(b, ir.Constant(b.type, 256))
            sc, mn = _q4_k_scales_mins(context, builder, src_ty, src_v, o)
            d = _half_at(context, builder, src_ty, src_v, o)
            dmin = _half_at(context, builder, src_ty, src_v, _at(builder, o, 2))
            dsc = builder.fmul(builder.uitofp(sc, v8f), _splat_f(builder, d, 8), flags=_FL)
            sums = [None] * 8
            for g in range(4):
                for k in range(2):
                    raw = builder.zext(_load(context, builder, src_ty, src_v,
                                             _at(builder, o, nibbles_at + 32 * g + 16 * k), 16), v16i)
                    if fifth_at is not None:
                        qh = builder.zext(_load(context, builder, src_ty, src_v, _at(builder, o, fifth_at + 16 * k),
                                                16), v16i)
                    for half, codes in enumerate((builder.and_(raw, _vec_const(32, [15] * 16)),
                                                  builder.lshr(raw, _vec_const(32, [4] * 16)))):
                        j = 2 * g + half
                        if fifth_at is not None:
                            top = builder.and_(builder.lshr(qh, _vec_const(32, [j] * 16)), _vec_const(32, [1] * 16))
                            codes = builder.or_(codes, builder.shl(top, _vec_const(32, [4] * 16)))
                        xv = _load_vec(context, builder, x_ty, x_v, _at(builder, y, 32 * j + 16 * k), f32, 16)
                        part = builder.fmul(builder.sitofp(codes, v16f), xv, flags=_FL)
                        sums[j] = part if sums[j] is None else builder.fadd(sums[j], part, flags=_FL)
            lanes = None
            for j in range(8):
                part = builder.fmul(sums[j], _shuffle(builder, dsc, [j] * 16), flags=_FL)
                lanes = part if lanes is None else builder.fadd(lanes, part, flags=_FL)
            xs = _load_vec(context, builder, xs_ty, xs_v, builder.mul(b, ir.Constant(b.type, 8)), f32, 8)
            mins = builder.fmul(builder.uitofp(mn, v8f), xs, flags=_FL)
            mins16 = builder.shuffle_vector(mins, ir.Constant(v8f, [0.0] * 8), _vec_const(32, list(range(16))))
            return [(lanes, ir.Constant(f32, 1.0)), (mins16, builder.fneg(dmin))]
        return _float_lanes_row(context, builder, args[3], terms)
    return codegen


@intrinsic
def fdot_q4_k_row(typingctx, src, x, xsum32, blocks):
    """sum over the first `blocks` Q4_K blocks of a row times float32 x (xsum32: its 32-sums) of d * sum_j sc_j
    (q_j . x_j) - dmin * sum_j m_j sum(x_j): each sub-block's code products summed in float lanes and scaled
    once by d sc_j (not value by value), the mins against the 32-sums; lanes kept across blocks and reduced
    once (_float_lanes_row). Codes come from 16 bytes at a time zero-extended to 32-bit lanes, where the low
    and high nibbles (sub-blocks 2 g and 2 g + 1) are an AND and a shift apart."""
    if not (_byte_array(src) and _float_array(x) and _float_array(xsum32)):
        return None
    return types.float32(src, x, xsum32, blocks), _k4_row_codegen(144, 16)


@intrinsic
def fdot_q5_k_row(typingctx, src, x, xsum32, blocks):
    """fdot_q4_k_row for Q5_K rows (176-byte blocks: Q4_K's scales, 32 bytes of fifth bits, the nibbles from byte
    48)."""
    if not (_byte_array(src) and _float_array(x) and _float_array(xsum32)):
        return None
    return types.float32(src, x, xsum32, blocks), _k4_row_codegen(176, 48, 16)


def _twice32(builder, v):
    """<32 x i8> v twice, as <64 x i8>."""
    return builder.shuffle_vector(v, v, _vec_const(32, list(range(32)) * 2))


def _nibble_codes64(context, builder, src_ty, src, at):
    """The 64 nibbles of the 32 bytes at src[at] as <64 x u8> (GFNI): the bytes twice, low nibbles from the lower 4
    quadwords, high from the upper 4 (sub-blocks 2 gi and 2 gi + 1 of a Q4_K or Q5_K block's 64-value group gi)."""
    return _nibbles64(builder, _twice32(builder, _load(context, builder, src_ty, src, at, 32)))


def _bit_to_4(s):
    """The vgf2p8affineqb matrix that moves a byte's bit s to bit 4 and clears the others."""
    return (1 << s) << 24


def _q5_k_codes(context, builder, src_ty, src, o):
    """The codes of the Q5_K block at src[o] (176 bytes: fp16 d and dmin, Q4_K's 12 scale bytes, 32 bytes of fifth
    bits qh, 128 of low nibbles) as a function of gi -> the 64 codes of sub-blocks 2 gi and 2 gi + 1 (<64 x u8>,
    GFNI): Q4_K's nibbles from byte 48 on, ORed with 16 times bit 2 gi (low nibbles) or 2 gi + 1 (high nibbles) of
    qh byte j % 32, ggml's dequantize_row_q5_K, by one more vgf2p8affineqb per 64 codes."""
    qh = _twice32(builder, _load(context, builder, src_ty, src, _at(builder, o, 16), 32))

    def codes(gi):
        low = _nibble_codes64(context, builder, src_ty, src, _at(builder, o, 48 + 32 * gi))
        return builder.or_(low, _affine_bytes(builder, qh, [_bit_to_4(2 * gi)] * 4 + [_bit_to_4(2 * gi + 1)] * 4))
    return codes


def _q4_k_packed_dots(context, builder, codes, xq_ty, xq, y, sc16):
    """sum_j sc_j (q_j . x_j) of a Q4_K block (or Q5_K: codes(gi) gives each 64) spread over <16 x i32> (GFNI and
    VNNI): each 64 codes' dot in 4-value sums by vpdpbusd (lanes 0-7 sub-block 2 gi, 8-15 sub-block 2 gi + 1; |sum|
    <= 4 * 31 * 128 fits int16), two such vectors packed to words by vpackssdw and scaled by one vpdpwssd. The
    scale words are made twice a block instead of four times, and two of the four word multiplies go: on a Zen 4
    core the row dot went 0.032 -> 0.030 ns a weight from the cache (vpmaddubsw and a scaled vpmaddwd per 64 codes
    before)."""
    v16, w32 = ir.VectorType(_I32, 16), ir.VectorType(ir.IntType(16), 32)
    dots = []
    for gi in range(4):
        x = _load(context, builder, xq_ty, xq, _at(builder, y, 64 * gi), 64)
        dots.append(_dpbusd(builder, ir.Constant(v16, [0] * 16), builder.bitcast(codes(gi), v16),
                            builder.bitcast(x, v16), True))
    total = ir.Constant(v16, [0] * 16)
    for pair in range(2):
        # vpackssdw packs per 128-bit lane L: words 8 L .. 8 L + 3 from the first vector's lanes 4 L .. 4 L + 3,
        # words 8 L + 4 .. 8 L + 7 from the second's; lane i of group gi is sub-block 2 gi + i // 8
        words = _x86(builder, "llvm.x86.avx512.packssdw.512", w32, [dots[2 * pair], dots[2 * pair + 1]])
        scales = _shuffle(builder, sc16, [2 * (2 * pair + w % 8 // 4) + (4 * (w // 8) + w % 4) // 8
                                          for w in range(32)])
        total = _x86(builder, "llvm.x86.avx512.vpdpwssd.512", v16,
                     [total, builder.bitcast(words, v16), builder.bitcast(scales, v16)])
    return total


def _q4_k_scaled_dots(context, builder, src_ty, src, o, xq_ty, xq, y, sc16, codes):
    """_q4_k_packed_dots without VNNI: per 64 codes (32 without AVX-512BW) vpmaddubsw and a vpmaddwd by the scale
    words, as <16 x i32> (<32 x i32> without AVX-512BW). Without GFNI the Q4_K codes come from the block at src[o]
    by masks and shifts (Q5_K's need GFNI)."""
    total = None
    for gi in range(4):
        if HAS_GFNI:
            x = _load(context, builder, xq_ty, xq, _at(builder, y, 64 * gi), 64)
            part = _madd_scaled(builder, codes(gi), x, _shuffle(builder, sc16, [2 * gi + k // 16 for k in range(32)]))
            total = part if total is None else builder.add(total, part)
            continue
        q = _load(context, builder, src_ty, src, _at(builder, o, 16 + 32 * gi), 32)
        low, high = builder.and_(q, _vec_const(8, [15] * 32)), builder.lshr(q, _vec_const(8, [4] * 32))
        if HAS_AVX512BW:  # sub-blocks 2 gi and 2 gi + 1 (64 contiguous activations) in one zmm
            x = _load(context, builder, xq_ty, xq, _at(builder, y, 64 * gi), 64)
            part = _madd_runs(builder, low, high, x, sc16, 2 * gi, 32)
            total = part if total is None else builder.add(total, part)
            continue
        for half, codes in enumerate((low, high)):
            j = 2 * gi + half
            scale = builder.shuffle_vector(sc16, sc16, _vec_const(32, [j] * 32))
            x = _load(context, builder, xq_ty, xq, _at(builder, y, 32 * j), 32)
            part = _scaled_products(builder, codes, scale, x)
            total = part if total is None else builder.add(total, part)
    return total


def _q4_k_lanes(context, builder, src_ty, src, o, xq_ty, xq, y, xs_ty, xs, g, codes=None):
    """The lanes of a Q4_K block (144 bytes at src[o]) times 256 Q8_K codes xq[y:] with their 16-sums at xs[g:],
    before any reduction: (sum_j sc_j (q_j . x_j) spread over <16 x i32> (<32 x i32> without AVX-512BW),
    m_j times each of sub-block j's two 16-sums as <16 x i32> (without AVX-512BW m_j times their sum, <8 x i32>)).
    The eight 6-bit scales and mins come from their 12 bytes by _q4_k_scales_mins, the scaled dots from
    _q4_k_packed_dots (GFNI and VNNI) or _q4_k_scaled_dots. codes: gi -> 64 codes of another format with Q4_K's
    scales (_q5_k_lanes), else the block's own nibbles."""
    sc, mn = _q4_k_scales_mins(context, builder, src_ty, src, o)
    sc16 = builder.zext(sc, ir.VectorType(ir.IntType(16), 8))
    if codes is None:
        def codes(gi):
            return _nibble_codes64(context, builder, src_ty, src, _at(builder, o, 16 + 32 * gi))
    if HAS_GFNI and HAS_VNNI:
        total = _q4_k_packed_dots(context, builder, codes, xq_ty, xq, y, sc16)
    else:
        total = _q4_k_scaled_dots(context, builder, src_ty, src, o, xq_ty, xq, y, sc16, codes)
    sums16 = _load_vec(context, builder, xs_ty, xs, g, _I32, 16)
    if HAS_AVX512BW:  # each 16-sum times its sub-block's min by one vpmaddwd: the sums' int32 lanes read as int16
        # pairs (|sum| <= 16 * 128, so the low half is the value), the mins as (m, 0) pairs
        w32 = ir.VectorType(ir.IntType(16), 32)
        mins = builder.zext(_shuffle(builder, mn, [k // 2 for k in range(16)]), ir.VectorType(_I32, 16))
        return total, _pmaddwd(builder, builder.bitcast(sums16, w32), builder.bitcast(mins, w32))
    sums32 = _pair_sums(builder, sums16, 16)
    return total, builder.mul(builder.zext(mn, ir.VectorType(_I32, 8)), sums32)


@intrinsic
def idot_q4_k_block(typingctx, src, o, xq, y, xs16, g, d, dmin):
    """One Q4_K block (144 bytes at src[o], its fp16 d and dmin given as floats) times 256 Q8_K codes xq[y:]
    with their 16-sums at xs16[g:]: d * sum_j sc_j (q_j . x_j) - dmin * sum_j m_j sum(x_j) (_q4_k_lanes, then
    one reduction each)."""
    if not (_byte_array(src) and _byte_array(xq) and _int32_array(xs16)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, o_v, xq_ty, xq_v, y_v, xs_ty, xs_v, g_v, d, dmin = _kblock_args(sig, args)
        total, mins = _q4_k_lanes(context, builder, src_ty, src_v, o_v, xq_ty, xq_v, y_v, xs_ty, xs_v, g_v)
        isc = _reduce_add(builder, total, 16 if HAS_AVX512BW else 32)
        return _scales_minus_mins(builder, d, isc, dmin, _reduce_add(builder, mins, mins.type.count))
    return types.float32(src, o, xq, y, xs16, g, types.float32, types.float32), codegen


def _k_row_codegen(lanes, size, at, dmin=True):
    """The codegen of a row dot over k-quant blocks with mins (fdot_q4_k_blocks, fdot_q2_k_blocks): sum over
    blocks b of xd[b] * (d * scaled dots - dmin * mins), `lanes` giving a block's two <16 x i32> lane vectors
    (before reduction; AVX-512BW), blocks of `size` bytes with the fp16 d and dmin at byte `at`; into float lanes
    with d * xd[b] and -dmin * xd[b] (_float_lanes_row). Without dmin (Q3_K) the block has d alone and the second
    lanes are scaled by -d."""
    def codegen(context, builder, sig, args):
        src_ty, src_v, xq_ty, xq_v, xd_ty, xd_v, xs_ty, xs_v = (sig.args[0], args[0], sig.args[1], args[1],
                                                                sig.args[2], args[2], sig.args[3], args[3])

        def terms(b):
            o = builder.mul(b, ir.Constant(b.type, size))
            y, g = builder.mul(b, ir.Constant(b.type, 256)), builder.mul(b, ir.Constant(b.type, 16))
            total, mins = lanes(context, builder, src_ty, src_v, o, xq_ty, xq_v, y, xs_ty, xs_v, g)
            # d and dmin converted as a pair, times xd[b] and (1, -1)
            v2f = ir.VectorType(ir.FloatType(), 2)
            if dmin:
                dd = builder.fpext(_load_vec(context, builder, src_ty, src_v, _at(builder, o, at), ir.HalfType(), 2),
                                   v2f)
            else:
                dd = _splat_f(builder, _half_at(context, builder, src_ty, src_v, _at(builder, o, at)), 2)
            dd = builder.fmul(builder.fmul(dd, _splat_f(builder, _elem(context, builder, xd_ty, xd_v, b), 2)),
                              ir.Constant(v2f, [1.0, -1.0]))
            return [(total, _shuffle(builder, dd, [0] * 16)), (mins, _shuffle(builder, dd, [1] * 16))]
        return _float_lanes_row(context, builder, args[4], terms)
    return codegen


@intrinsic
def fdot_q4_k_blocks(typingctx, src, xq, xd, xs16, blocks):
    """sum over the first `blocks` Q4_K blocks of a row of xd[b] * (d * sum_j sc_j (q_j . x_j) - dmin * sum_j m_j
    sum(x_j)): _q4_k_lanes in float lanes (_k_row_codegen; AVX-512BW only)."""
    if not (_byte_array(src) and _byte_array(xq) and _float_array(xd) and _int32_array(xs16)):
        return None
    return types.float32(src, xq, xd, xs16, blocks), _k_row_codegen(_q4_k_lanes, 144, 0)


def _q5_k_lanes(context, builder, src_ty, src, o, xq_ty, xq, y, xs_ty, xs, g):
    """_q4_k_lanes of a Q5_K block (176 bytes at src[o]; codes by _q5_k_codes, GFNI)."""
    return _q4_k_lanes(context, builder, src_ty, src, o, xq_ty, xq, y, xs_ty, xs, g,
                       _q5_k_codes(context, builder, src_ty, src, o))


@intrinsic
def fdot_q5_k_blocks(typingctx, src, xq, xd, xs16, blocks):
    """fdot_q4_k_blocks for Q5_K rows: the same scales, mins and sums, 5-bit codes (_q5_k_lanes; GFNI only)."""
    if not (HAS_GFNI and _byte_array(src) and _byte_array(xq) and _float_array(xd) and _int32_array(xs16)):
        return None
    return types.float32(src, xq, xd, xs16, blocks), _k_row_codegen(_q5_k_lanes, 176, 0)


def _u64_table(ty) -> bool:
    return _array_1d(ty, types.uint64)


def _u32_table(ty) -> bool:
    return _array_1d(ty, types.uint32)


# The IQ2_XS grid table the i-quant intrinsics take (quant_iq._IQ2XS_TABLES, uint64): the 512 grid points, each 8
# byte magnitudes, then the same points as 2-bit level codes (value j's magnitude IQ2_XS_MAGNITUDES[level] at bits
# 2 j of a uint16) in two byte planes, the 512 low bytes then the 512 high bytes (128 uint64), for GRID_READ
# "permute" (_level_words).
IQ2_XS_POINTS = 512
IQ2_XS_MAGNITUDES = (8, 25, 43)


def _grid_points(context, builder, grid_ty, grid, src_ty, src, o, codes):
    """The grid points of the IQ2_XS block at src[o] (its 32 uint16 group codes also given as <32 x i16>), as four
    <64 x i8>, each the byte magnitudes of eight groups, by GRID_READ "gather" or "loads": a load per point (on an
    AMD EPYC (Zen 4) core 1.25x faster than the gather), each code loaded on its own: taken out of the codes'
    vector instead they cost a vpextrw each."""
    i16, i64 = ir.IntType(16), ir.IntType(64)
    v8 = ir.VectorType(i64, 8)
    grid_data = _data(context, builder, grid_ty, grid)
    points = []
    if GRID_READ == "gather":
        index = builder.and_(builder.zext(codes, ir.VectorType(i64, 32)), ir.Constant(ir.VectorType(i64, 32),
                                                                                     [511] * 32))
        base = builder.bitcast(grid_data, _I8.as_pointer())
        every = ir.Constant(ir.VectorType(ir.IntType(1), 8), [1] * 8)
        for s in range(4):
            v = _x86(builder, "llvm.x86.avx512.mask.gather.qpq.512", v8,
                     [ir.Constant(v8, [0] * 8), base, _shuffle(builder, index, list(range(8 * s, 8 * s + 8))),
                      every, ir.Constant(_I32, 8)])
            points.append(builder.bitcast(v, ir.VectorType(_I8, 64)))
        return points
    for s in range(4):
        v = ir.Constant(v8, ir.Undefined)
        for g in range(8):
            code = builder.load(_pointer(context, builder, src_ty, src, _at(builder, o, 2 + 16 * s + 2 * g), i16),
                                align=1)
            point = builder.load(builder.gep(grid_data, [builder.and_(builder.zext(code, i64), ir.Constant(i64, 511))]))
            v = builder.insert_element(v, point, ir.Constant(_I32, g))
        points.append(builder.bitcast(v, ir.VectorType(_I8, 64)))
    return points


# GRID_READ "permute": the block's 32 codes reordered once so that quadword q holds groups q, 8 + q, 16 + q, 24 + q
# (word s of it: step s's group q), which is how vpmultishiftqb and vpshufbitqmb read a step's eight groups.
_COLUMNS = [8 * (w % 4) + w // 4 for w in range(32)]


def _opaque(builder, k):
    """The int64 k, opaque to the optimiser (an empty inline asm, marked as having effects so that it is neither
    hoisted nor merged), so that the loads it offsets stay in the loop: LLVM otherwise hoists a look-up table's 16
    registers of loads out of a row's loop, spills them to the stack and copies them there on every call (a row;
    IQ2_XS rows of 512 values, in cache: 0.068 -> 0.055 ns a weight with the pairs of fdot_iq2_xs_blocks)."""
    return builder.asm(ir.FunctionType(_I64, [_I64]), "", "=r,0", [ir.Constant(_I64, k)], True)


def _level_words(context, builder, grid_ty, grid, cols):
    """The 2-bit level codes (a uint16 per group, as <64 x i8>) of one or two IQ2_XS blocks from their codes in
    _COLUMNS order (a list of one or two <32 x i16>; AVX-512 VBMI): the grid's 512 level words are kept as two
    byte planes (low bytes, then high bytes) of 8 registers each; both blocks' 64 groups go through four vpermi2b
    per plane (128 points each, by index bits 0-6) and three selects on bits 7 and 8, and one vpermt2b per block
    puts each group's two bytes back together. Per pair of blocks ~20 instructions, as one block had taken with
    vpermi2w on the words (32 groups at a time). One block is looked up as its own pair."""
    v64 = ir.VectorType(_I8, 64)
    a8 = builder.bitcast(cols[0], v64)
    b8 = builder.bitcast(cols[-1], v64)
    lo = builder.shuffle_vector(a8, b8, _vec_const(32, [2 * j for j in range(32)] + [64 + 2 * j for j in range(32)]))
    hi = builder.shuffle_vector(a8, b8, _vec_const(32, [2 * j + 1 for j in range(32)] + [65 + 2 * j
                                                                                          for j in range(32)]))
    planes = builder.bitcast(builder.gep(_data(context, builder, grid_ty, grid), [_opaque(builder, IQ2_XS_POINTS)]),
                             v64.as_pointer())
    bit7 = builder.icmp_signed("<", lo, ir.Constant(v64, [0] * 64))
    bit8 = builder.icmp_unsigned("!=", builder.and_(hi, _vec_const(8, [1] * 64)), ir.Constant(v64, [0] * 64))
    looked = []
    for plane in range(2):
        chunk = [builder.load(builder.gep(planes, [ir.Constant(_I64, 8 * plane + t)]), align=8) for t in range(8)]
        quarters = [_x86(builder, "llvm.x86.avx512.vpermi2var.qi.512", v64, [chunk[2 * q], lo, chunk[2 * q + 1]])
                    for q in range(4)]
        low, high = (builder.select(bit7, quarters[2 * h + 1], quarters[2 * h]) for h in range(2))
        looked.append(builder.select(bit8, high, low))
    return [builder.shuffle_vector(looked[0], looked[1], _vec_const(32, [32 * k + j // 2 + (64 if j % 2 else 0)
                                                                        for j in range(64)]))
            for k in range(len(cols))]


def _permuted_steps(builder, lv, cols, offset):
    """The four steps' grid values (<64 x i8>) and negative lanes (<64 x i1>) of an IQ2_XS block from its level
    words lv (_level_words) and its codes in _COLUMNS order <32 x i16> (AVX-512 VBMI, BITALG): per step
    vpmultishiftqb puts value j's level in the low bits of byte j and vpermb maps it to its magnitude (a 64-byte
    table: vpermb reads six index bits, so no mask; vpshufb and a mask were 1.1x slower in the dot), while
    vpshufbitqmb takes the sign bits straight into a mask register. offset (not None): the values come as
    offset + magnitude or, where negative, offset - magnitude, by two table look-ups instead of a look-up, a
    negation and an add. With the look-up about 60 instructions a block where a load and an insert per point and
    sign bytes spread per step took ~110."""
    i16 = ir.IntType(16)
    v32 = ir.VectorType(i16, 32)
    v64 = ir.VectorType(_I8, 64)
    # a group's sign bits: its code's bits 9-15 for values 0-6, for value 7 the parity of their count (bit 0 here)
    ctpop = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v32, [v32]), "llvm.ctpop.v32i16")
    signs = builder.or_(builder.and_(cols, _vec_const(16, [0xFE00] * 32)),
                        builder.call(ctpop, [builder.lshr(cols, _vec_const(16, [9] * 32))]))
    signs = builder.bitcast(signs, v64)

    def lookup(sign):  # the 64-byte table by an index's low two bits (level 3 does not occur)
        return _vec_const(8, [((offset or 0) + sign * IQ2_XS_MAGNITUDES[j % 4]) % 256 if j % 4 < 3 else 0
                              for j in range(64)])
    steps = []
    for s in range(4):
        fields = _x86(builder, "llvm.x86.avx512.pmultishift.qb.512", v64,
                      [_vec_const(8, [16 * s + 2 * (j % 8) for j in range(64)]), lv])
        neg = _x86(builder, "llvm.x86.avx512.vpshufbitqmb.512", ir.VectorType(ir.IntType(1), 64),
                   [signs, _vec_const(8, [16 * s + (9 + j % 8 if j % 8 < 7 else 0) for j in range(64)])])
        g8 = _x86(builder, "llvm.x86.avx512.permvar.qi.512", v64, [lookup(1), fields])
        if offset is not None:
            g8 = builder.select(neg, _x86(builder, "llvm.x86.avx512.permvar.qi.512", v64, [lookup(-1), fields]), g8)
        steps.append((g8, neg))
    return steps


def _iq2_xs_blocks(context, builder, grid_ty, grid, blocks, offset=None):
    """The parts of the IQ2_XS blocks at src[o] for (src type, src, o) in blocks (one or two; 74 bytes each:
    fp16 d, 32 uint16 group codes, 8 scale bytes) that their four 64-value steps take, computed once a block:
    the grid magnitudes, the signs and the 16 scales (per step they had cost a fifth of the integer dot).
    Returns, per block, step(s) -> (the grid magnitudes of values 64 s .. 64 s + 63 as <64 x i8>, or with an
    offset (an int) offset + the signed values, their negative lanes as <64 x i1>, their four scales 2 s + 1 as
    <4 x i16>, the integer form of ggml's (0.5 + s) / 4). A group's uint16 holds its grid point (low 9 bits) and
    sign index (high 7 bits). Two blocks share one grid look-up (_level_words)."""
    i16 = ir.IntType(16)
    codes = [_load_vec(context, builder, src_ty, src, _at(builder, o, 2), i16, 32) for src_ty, src, o in blocks]
    if GRID_READ == "permute":
        cols = [_shuffle(builder, c, _COLUMNS) for c in codes]
        words = _level_words(context, builder, grid_ty, grid, cols)
        parts = [_permuted_steps(builder, lv, c, offset) for lv, c in zip(words, cols)]
    else:
        parts = []
        for (src_ty, src, o), c in zip(blocks, codes):
            points = _grid_points(context, builder, grid_ty, grid, src_ty, src, o, c)
            signs = _sign_bytes(builder, c, 32)
            steps = [(points[s], _sign_masks(builder, signs, 8 * s, 8)) for s in range(4)]
            if offset is not None:
                k = ir.Constant(ir.VectorType(_I8, 64), [offset] * 64)
                steps = [(builder.select(neg, builder.sub(k, g8), builder.add(k, g8)), neg) for g8, neg in steps]
            parts.append(steps)

    def stepper(src_ty, src, o, steps):
        odd = _nibble_odd16(context, builder, src_ty, src, o, 66, 8)

        def step(s):
            return steps[s][0], steps[s][1], _shuffle(builder, odd, [4 * s + k for k in range(4)])
        return step
    return [stepper(*block, steps) for block, steps in zip(blocks, parts)]


def _sign_bytes(builder, codes, n):
    """The 8 sign bits of each of n i-quant groups from their uint16 codes <n x i16>, as <n x i8>: the high 7
    bits are the signs of values 0-6 and value 7's sign makes the count even (ggml's ksigns)."""
    i16 = ir.IntType(16)
    vn = ir.VectorType(i16, n)
    s7 = builder.lshr(codes, _vec_const(16, [9] * n))
    ctpop = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vn, [vn]), f"llvm.ctpop.v{n}i16")
    parity = builder.and_(builder.call(ctpop, [s7]), _vec_const(16, [1] * n))
    return builder.trunc(builder.or_(s7, builder.shl(parity, _vec_const(16, [7] * n))), ir.VectorType(_I8, n))


def _sign_masks(builder, signs, first, n):
    """The negative lanes (<8 n x i1>) of groups first .. first + n - 1 of sign bytes <m x i8>."""
    spread = _shuffle(builder, signs, [first + j // 8 for j in range(8 * n)])
    bits = builder.and_(spread, _vec_const(8, [1 << (j % 8) if j % 8 < 7 else -128 for j in range(8 * n)]))
    return builder.icmp_unsigned("!=", bits, ir.Constant(ir.VectorType(_I8, 8 * n), [0] * (8 * n)))


def _negate_where(builder, v, neg):
    """v negated in the lanes where neg (<n x i1>) is set."""
    return builder.select(neg, builder.sub(ir.Constant(v.type, [0] * v.type.count), v), v)


def _q2_0_code_lanes(builder, spread, x64):
    """sum code * x of a Q2_0 block as <16 x i32> (lanes 0-7: values 0-31, lanes 8-15: values 32-63), its 16
    code bytes spread to four lanes each (AVX-512BW): each lane masked to one code in place (code * 4^s), so
    vpmaddubsw multiplies, an exact shift takes the 4^s off and vpmaddwd adds."""
    total = None
    for s in range(4):
        masked = builder.and_(spread, _vec_const(8, [(3 << 2 * s if s < 3 else -64) if j % 4 == s else 0
                                                     for j in range(64)]))
        part = builder.ashr(_pmaddubsw(builder, masked, x64), _vec_const(16, [2 * s] * 32))
        total = part if total is None else builder.add(total, part)
    return _pmaddwd(builder, total, _vec_const(16, [1] * 32))


@intrinsic
def fdot_q2_0_blocks(typingctx, src, x, xd, xs16, blocks):
    """sum over the first `blocks` Q2_0 blocks of a row (18 bytes: fp16 d, 64 2-bit codes) of d * (xd[2b] *
    sum (code - 1) x over values 0-31 + xd[2b + 1] * the same over 32-63), x int8 (two Q8_0 activation blocks
    per weight block) with its 16-sums xs16: _q2_0_code_lanes less the -1 offsets (lanes 0 and 8) into float
    lanes with d * xd (_float_lanes_row; AVX-512BW only)."""
    if not (_byte_array(src) and _byte_array(x) and _float_array(xd) and _int32_array(xs16)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v, xd_ty, xd_v, xs_ty, xs_v = (sig.args[0], args[0], sig.args[1], args[1],
                                                              sig.args[2], args[2], sig.args[3], args[3])
        f32 = ir.FloatType()

        def terms(b):
            o = builder.mul(b, ir.Constant(b.type, 18))
            qs = _load(context, builder, src_ty, src_v, _at(builder, o, 2), 16)
            spread = builder.shuffle_vector(qs, qs, _vec_const(32, [j // 4 for j in range(64)]))
            x64 = _load(context, builder, x_ty, x_v, builder.mul(b, ir.Constant(b.type, 64)), 64)
            lanes = _q2_0_code_lanes(builder, spread, x64)
            xs = _load_vec(context, builder, xs_ty, xs_v, builder.mul(b, ir.Constant(b.type, 4)), _I32, 4)
            # offsets: lane 0 takes the first half's sum of x (xs16 0 + 1), lane 8 the second's (2 + 3)
            pairs = builder.add(_shuffle(builder, xs, [0, 2]), _shuffle(builder, xs, [1, 3]))
            offsets = builder.shuffle_vector(pairs, ir.Constant(pairs.type, [0, 0]),
                                             _vec_const(32, [0] + [2] * 7 + [1] + [2] * 7))
            d = _half_at(context, builder, src_ty, src_v, o)
            xd2 = _load_vec(context, builder, xd_ty, xd_v, builder.mul(b, ir.Constant(b.type, 2)), f32, 2)
            scale = _shuffle(builder, builder.fmul(_splat_f(builder, d, 2), xd2), [h // 8 for h in range(16)])
            return [(builder.sub(lanes, offsets), scale)]
        return _float_lanes_row(context, builder, args[4], terms)
    return types.float32(src, x, xd, xs16, blocks), codegen


@intrinsic
def idot_q2_0_block(typingctx, src, o, x, xo, xs16, g):
    """The two 32-value halves of one Q2_0 block (18 bytes at src[o]: fp16 d, then 2-bit codes, weight j at
    bits 2 (j % 4) of byte j // 4) times int8 x[xo:xo + 64]: (sum (code - 1) x over values 0-31, the same over
    32-63), the -1 taken off against the activations' 16-sums xs16[g:g + 4]. With AVX-512BW each byte is
    spread to four lanes and masked to one code in place (code * 4^s), so vpmaddubsw multiplies, an exact
    shift takes the 4^s off and vpmaddwd adds; elsewhere plain vector products."""
    if not (_byte_array(src) and _byte_array(x) and _int32_array(xs16)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, o_v, x_ty, x_v, xo_v, xs_ty, xs_v, g_v = (
            sig.args[0], args[0], args[1], sig.args[2], args[2], args[3], sig.args[4], args[4], args[5])
        v64i32 = ir.VectorType(_I32, 64)
        qs = _load(context, builder, src_ty, src_v, _at(builder, o_v, 2), 16)
        spread = builder.shuffle_vector(qs, qs, _vec_const(32, [j // 4 for j in range(64)]))
        x64 = _load(context, builder, x_ty, x_v, xo_v, 64)
        if HAS_AVX512BW:
            lanes = _q2_0_code_lanes(builder, spread, x64)
            halves = [_shuffle(builder, lanes, list(range(8 * h, 8 * h + 8))) for h in range(2)]
            sums = [_reduce_add(builder, v, 8) for v in halves]
        else:
            codes = builder.and_(builder.lshr(spread, _vec_const(8, [2 * (j % 4) for j in range(64)])),
                                 _vec_const(8, [3] * 64))
            prod = builder.mul(builder.zext(codes, v64i32), builder.sext(x64, v64i32))
            sums = [_reduce_add(builder, _shuffle(builder, prod, list(range(32 * h, 32 * h + 32))), 32)
                    for h in range(2)]
        xs = _load_vec(context, builder, xs_ty, xs_v, g_v, _I32, 4)
        offsets = [builder.add(builder.extract_element(xs, ir.Constant(_I32, 2 * h)),
                               builder.extract_element(xs, ir.Constant(_I32, 2 * h + 1))) for h in range(2)]
        return context.make_tuple(builder, sig.return_type,
                                  [builder.sub(sums[h], offsets[h]) for h in range(2)])
    return types.UniTuple(types.int32, 2)(src, o, x, xo, xs16, g), codegen


def _iq2_xs_lanes(context, builder, grid_ty, grid, src_ty, src, offsets, x_ty, x, xos, reader=None, pairs=True):
    """The int32 lanes of one or two IQ2_XS blocks (74 bytes at src[o], o in offsets; or the blocks that reader
    reads, as _iq2_xs_blocks does) times 256 int8 x[xo:] each (xo in xos), before reduction (a <16 x i32> per
    block, <32 x i32> without AVX-512BW): per 16 values (2 * 4-bit scale + 1) * (signed grid values . x). The grid
    points' byte magnitudes and signs come from the reader; the signs go onto x instead, so the magnitudes stay
    unsigned for vpmaddubsw (AVX-512BW; else vpmaddwd): x must lie in [-127, 127], as ggml's activation codes do
    (-128 has no negation). pairs: with VNNI, two steps at a time (_vnni_step_pairs)."""
    totals = []
    blocks = (reader or _iq2_xs_blocks)(context, builder, grid_ty, grid, [(src_ty, src, o) for o in offsets])
    for block, xo in zip(blocks, xos):
        if HAS_VNNI and pairs:
            totals.append(_vnni_step_pairs(context, builder, block, x_ty, x, xo))
            continue
        total = None
        for step in range(4):  # 64 weights: eight groups, four scale nibbles
            g8, neg, sc4 = block(step)
            xs = _negate_where(builder, _load(context, builder, x_ty, x, _at(builder, xo, 64 * step), 64), neg)
            if HAS_AVX512BW:
                part = _madd_scaled(builder, g8, xs, _shuffle(builder, sc4, [k // 8 for k in range(32)]))
            else:
                part = None
                for half in range(2):
                    lanes = list(range(32 * half, 32 * half + 32))
                    p = _scaled_products(builder, _shuffle(builder, g8, lanes), _shuffle(builder, sc4, [
                        2 * half + k // 16 for k in range(32)]), _shuffle(builder, xs, lanes))
                    part = p if part is None else builder.add(part, p)
            total = part if total is None else builder.add(total, part)
        totals.append(total)
    return totals


def _vnni_step_pairs(context, builder, block, x_ty, x, xo):
    """_iq2_xs_lanes' lanes of one block with VNNI: each step's 64 products in 4-value sums by vpdpbusd (|sum| <= 4
    * 62 * 127 fits int16 for every grid here), two steps' sums packed to words by vpackssdw and scaled by one
    vpdpwssd, as _q4_k_packed_dots does: per two steps two vpdpbusd, a pack and a vpdpwssd where vpmaddubsw and a
    scaled vpmaddwd each had taken four multiplies."""
    v16, w32 = ir.VectorType(_I32, 16), ir.VectorType(ir.IntType(16), 32)
    total = ir.Constant(v16, [0] * 16)
    for pair in range(2):
        dots, scales = [], []
        for step in (2 * pair, 2 * pair + 1):
            g8, neg, sc4 = block(step)
            xs = _negate_where(builder, _load(context, builder, x_ty, x, _at(builder, xo, 64 * step), 64), neg)
            dots.append(_dpbusd(builder, ir.Constant(v16, [0] * 16), builder.bitcast(g8, v16),
                                builder.bitcast(xs, v16), True))
            scales.append(sc4)
        # vpackssdw per 128-bit lane L: words 8 L .. 8 L + 3 from the first step's lanes 4 L .. 4 L + 3 (its values
        # 16 L .. 16 L + 15: run L), words 8 L + 4 .. 8 L + 7 from the second step's run L
        words = _x86(builder, "llvm.x86.avx512.packssdw.512", w32, dots)
        both = builder.shuffle_vector(scales[0], scales[1], _vec_const(32, range(8)))
        scale_words = _shuffle(builder, both, [w // 8 + (4 if w % 8 >= 4 else 0) for w in range(32)])
        total = _x86(builder, "llvm.x86.avx512.vpdpwssd.512", v16,
                     [total, builder.bitcast(words, v16), builder.bitcast(scale_words, v16)])
    return total


@intrinsic
def idot_iq2_xs_block(typingctx, grid, src, o, x, xo):
    """The integer sum of one IQ2_XS block (74 bytes at src[o]) times 256 int8 x[xo:] (_iq2_xs_lanes, reduced).
    grid: the grid points as uint64 [points] (8 byte magnitudes each)."""
    if not (_u64_table(grid) and _byte_array(src) and _byte_array(x)):
        return None

    def codegen(context, builder, sig, args):
        total, = _iq2_xs_lanes(context, builder, sig.args[0], args[0], sig.args[1], args[1], [args[2]],
                               sig.args[3], args[3], [args[4]])
        return _reduce_add(builder, total, 16 if HAS_AVX512BW else 32)
    return types.int32(grid, src, o, x, xo), codegen


def _paired_blocks(context, builder, blocks, terms):
    """_float_lanes_row over a row's `blocks` blocks two at a time, terms([b, b + 1]), and an odd last one alone
    under a branch, terms([blocks - 1]): the IQ2_XS row dots, whose two blocks a step share one grid look-up
    (_level_words)."""
    def pair(p):
        first = builder.shl(p, ir.Constant(p.type, 1))
        return terms([first, builder.add(first, ir.Constant(p.type, 1))])
    paired = _float_lanes_row(context, builder, builder.lshr(blocks, ir.Constant(blocks.type, 1)), pair)
    total = cgutils.alloca_once_value(builder, paired)
    odd = builder.icmp_unsigned("!=", builder.and_(blocks, ir.Constant(blocks.type, 1)), ir.Constant(blocks.type, 0))
    # the odd block under a branch: as a loop of zero or one steps its set-up ran on every row (rows of two blocks,
    # in cache: 0.057 -> 0.065-0.070 ns a weight)
    with builder.if_then(odd, likely=False):
        last = builder.sub(blocks, ir.Constant(blocks.type, 1))
        one = _float_lanes_row(context, builder, ir.Constant(blocks.type, 1), lambda _: terms([last]))
        builder.store(builder.fadd(builder.load(total), one, flags=_FL), total)
    return builder.load(total)


def _iq2_dots(reader, size, name, d_factor=0.125, table=_u64_table, d_at=None, pairs=True):
    """The integer and float row dots of an i-quant whose blocks (`size` bytes, fp16 d first) reader reads into
    steps of (grid magnitudes, negative lanes, 2 s + 1 scales per 16 values), as _iq2_xs_blocks does: d d_factor
    times the block's sum (the 2-bit types' (0.5 + s) / 4 is (2 s + 1) / 8, IQ3_XXS's (0.5 + s) / 2 is
    (2 s + 1) / 4); the grid a 1-D array that table() accepts; d read by d_at(context, builder, src type, src, o)
    where it is not the block's first two bytes. pairs: the integer dot's steps two at a time with VNNI
    (_vnni_step_pairs; on a Zen 4 core from the cache, int8, alternating builds: IQ2_XS 0.041 -> 0.039 ns a weight,
    IQ3_XXS 0.071 -> 0.066, IQ3_S 0.114 -> 0.109, IQ1_S 0.107 -> 0.095, IQ2_XS_PLANES 0.0235 -> 0.0226; IQ2_XXS
    0.054 -> 0.057 and IQ2_S 0.056 -> 0.057 keep a step at a time).

    (grid, src, x, xd, blocks): sum over the first `blocks` blocks of a row of d_b d_factor xd[b] times the integer
    sum of the block with int8 x (_iq2_xs_lanes), in float lanes, two blocks a step (_paired_blocks; AVX-512BW
    only). For IQ2_XS on an AMD EPYC (Zen 4) core, from the cache, alternating with a block a step: 0.050 -> 0.045
    ns a weight for rows of 2048 values, 0.068 -> 0.055 for rows of 512 (a 512-row product a call, its parallel
    start-up included); from RAM on two cores 12.5 -> 14.0 GB/s.

    (grid, src, x, blocks): the same with float32 x: value times run scale is an exact int16 product (|value| <= 62,
    2 s + 1 <= 31), converted once and multiplied with x in float lanes kept across the row."""
    read_d = d_at or _half_at

    @intrinsic
    def int_dot(typingctx, grid, src, x, xd, blocks):
        if not (table(grid) and _byte_array(src) and _byte_array(x) and _float_array(xd)):
            return None

        def codegen(context, builder, sig, args):
            grid_ty, grid_v, src_ty, src_v, x_ty, x_v, xd_ty, xd_v = (sig.args[0], args[0], sig.args[1], args[1],
                                                                      sig.args[2], args[2], sig.args[3], args[3])

            def terms(bs):
                offsets = [builder.mul(b, ir.Constant(b.type, size)) for b in bs]
                totals = _iq2_xs_lanes(context, builder, grid_ty, grid_v, src_ty, src_v, offsets, x_ty, x_v,
                                       [builder.mul(b, ir.Constant(b.type, 256)) for b in bs], reader, pairs)
                d8 = [builder.fmul(read_d(context, builder, src_ty, src_v, o),
                                   ir.Constant(ir.FloatType(), d_factor)) for o in offsets]
                return [(t, builder.fmul(d, _elem(context, builder, xd_ty, xd_v, b)))
                        for t, d, b in zip(totals, d8, bs)]
            return _paired_blocks(context, builder, args[4], terms)
        return types.float32(grid, src, x, xd, blocks), codegen

    @intrinsic
    def float_dot(typingctx, grid, src, x, blocks):
        if not (table(grid) and _byte_array(src) and _float_array(x)):
            return None

        def codegen(context, builder, sig, args):
            grid_ty, grid_v, src_ty, src_v, x_ty, x_v = sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2]
            f32, i16 = ir.FloatType(), ir.IntType(16)

            def terms(bs):
                offsets = [builder.mul(b, ir.Constant(b.type, size)) for b in bs]
                blocks = reader(context, builder, grid_ty, grid_v, [(src_ty, src_v, o) for o in offsets])
                out = []
                for b, o, block in zip(bs, offsets, blocks):
                    y = builder.mul(b, ir.Constant(b.type, 256))
                    total = None
                    for step in range(4):  # 64 values: eight groups, four run scales
                        g8, neg, sc4 = block(step)
                        values = builder.sext(_negate_where(builder, g8, neg), ir.VectorType(i16, 64))
                        scaled = builder.mul(values, _shuffle(builder, sc4, [k // 16 for k in range(64)]))
                        xv = _load_vec(context, builder, x_ty, x_v, _at(builder, y, 64 * step), f32, 64)
                        part = builder.fmul(builder.sitofp(scaled, ir.VectorType(f32, 64)), xv, flags=_FL)
                        total = part if total is None else builder.fadd(total, part, flags=_FL)
                    d8 = builder.fmul(read_d(context, builder, src_ty, src_v, o), ir.Constant(f32, d_factor))
                    out.append((_fold16(builder, total), d8))
                return out
            return _paired_blocks(context, builder, args[3], terms)
        return types.float32(grid, src, x, blocks), codegen
    int_dot.__name__, float_dot.__name__ = f"fdot_{name}_blocks", f"fdot_{name}_row"
    return int_dot, float_dot


def _grid_steps(context, builder, grid_ty, grid, point_bits, index, signs, odd):
    """The step function of one i-quant block read a point at a time, as _iq2_xs_blocks' blocks give their steps:
    step s -> (the grid magnitudes of values 64 s .. 64 s + 63 as <64 x i8>, their negative lanes, the scales
    2 s + 1 of their four runs of 16 as <4 x i16>). grid: each point's byte magnitudes in a point_bits-wide integer
    (a load per point); index(s, k): step s's point k's grid index (an i64); signs: the block's 32 sign bytes
    (<32 x i8>, bit j of byte g the sign of group g's value j); odd: its 16 run scales (<16 x i16>)."""
    point_ty = ir.IntType(point_bits)
    points = 512 // point_bits  # a step's 64 values
    grid_data = builder.bitcast(_data(context, builder, grid_ty, grid), point_ty.as_pointer())

    def step(s):
        v = ir.Constant(ir.VectorType(point_ty, points), ir.Undefined)
        for k in range(points):
            v = builder.insert_element(v, builder.load(builder.gep(grid_data, [index(s, k)])), ir.Constant(_I32, k))
        return (builder.bitcast(v, ir.VectorType(_I8, 64)), _sign_masks(builder, signs, 8 * s, 8),
                _shuffle(builder, odd, [4 * s + k for k in range(4)]))
    return step


def _byte_at(context, builder, src_ty, src, o, k):
    """src[o + k] zero-extended to an i64."""
    return builder.zext(builder.load(_pointer(context, builder, src_ty, src, _at(builder, o, k), _I8)), _I64)


def _xxs_blocks(context, builder, grid_ty, grid, blocks, aux, point_at, point_bits):
    """The steps (_grid_steps) of IQ2_XXS or IQ3_XXS blocks at src[o] for (src type, src, o) in blocks.
    point_at(s, k): the byte offset in the block of step s's point k's index; aux(src type, src, o): the block's
    eight uint32 words, one per 32 values, of four 7-bit sign indices (ggml's ksigns: the 7 bits and their parity,
    _sign_bytes) and a 4-bit scale s at bits 28-31."""
    i16 = ir.IntType(16)
    steppers = []
    for src_ty, src, o in blocks:
        words = aux(src_ty, src, o)
        fields = builder.and_(builder.lshr(_shuffle(builder, words, [g // 4 for g in range(32)]),
                                           _vec_const(32, [7 * (g % 4) for g in range(32)])),
                              _vec_const(32, [127] * 32))
        signs = _sign_bytes(builder, builder.shl(builder.trunc(fields, ir.VectorType(i16, 32)),
                                                 _vec_const(16, [9] * 32)), 32)
        odd = builder.trunc(builder.add(builder.shl(builder.lshr(words, _vec_const(32, [28] * 8)),
                                                    _vec_const(32, [1] * 8)), _vec_const(32, [1] * 8)),
                            ir.VectorType(i16, 8))

        def index(s, k, src_ty=src_ty, src=src, o=o):
            return _byte_at(context, builder, src_ty, src, o, point_at(s, k))
        steppers.append(_grid_steps(context, builder, grid_ty, grid, point_bits, index, signs,
                                    _shuffle(builder, odd, [j // 2 for j in range(16)])))
    return steppers


def _iq2_xxs_blocks(context, builder, grid_ty, grid, blocks):
    """_xxs_blocks of IQ2_XXS blocks (66 bytes: fp16 d, then per 32 values four grid-point bytes and the aux
    word), grid uint64 [256]: each point's 8 byte magnitudes."""
    def aux(src_ty, src, o):
        words = _load_vec(context, builder, src_ty, src, _at(builder, o, 2), _I32, 16)
        return _shuffle(builder, words, [2 * ib + 1 for ib in range(8)])
    return _xxs_blocks(context, builder, grid_ty, grid, blocks, aux,
                       lambda s, k: 2 + 8 * (2 * s + k // 4) + k % 4, 64)  # group k: sub-block 2 s + k // 4


def _iq3_xxs_blocks(context, builder, grid_ty, grid, blocks):
    """_xxs_blocks of IQ3_XXS blocks (98 bytes: fp16 d, 64 grid-point bytes, then the eight aux words), grid
    uint32 [256]: each point's 4 byte magnitudes."""
    def aux(src_ty, src, o):
        return _load_vec(context, builder, src_ty, src, _at(builder, o, 66), _I32, 8)
    return _xxs_blocks(context, builder, grid_ty, grid, blocks, aux, lambda s, k: 2 + 16 * s + k, 32)


def _nibble_odd16(context, builder, src_ty, src, o, first, n):
    """2 s + 1 for the 4-bit scales s of the n bytes at src[o + first] (byte i's low nibble first), as <2 n x i16>."""
    i16 = ir.IntType(16)
    sb = builder.zext(_load(context, builder, src_ty, src, _at(builder, o, first), n), ir.VectorType(i16, n))
    nibs = builder.and_(builder.lshr(_shuffle(builder, sb, [j // 2 for j in range(2 * n)]),
                                     _vec_const(16, [0, 4] * n)), _vec_const(16, [15] * (2 * n)))
    return builder.add(builder.shl(nibs, _vec_const(16, [1] * (2 * n))), _vec_const(16, [1] * (2 * n)))


def _iq2_s_blocks(context, builder, grid_ty, grid, blocks):
    """The steps (_grid_steps) of IQ2_S blocks (82 bytes: fp16 d, 32 grid-index low bytes, 32 sign bytes, 8 qh
    bytes with the index's two high bits of group 4 i + l at bits 2 l of byte i, 8 scale bytes: a 4-bit scale
    per 16 values), grid uint64 [1024]: each point's 8 byte magnitudes."""
    steppers = []
    for src_ty, src, o in blocks:
        def index(s, k, src_ty=src_ty, src=src, o=o):
            g = 8 * s + k
            high = builder.and_(builder.lshr(_byte_at(context, builder, src_ty, src, o, 66 + g // 4),
                                             ir.Constant(_I64, 2 * (g % 4))), ir.Constant(_I64, 3))
            low = _byte_at(context, builder, src_ty, src, o, 2 + g)
            return builder.or_(low, builder.shl(high, ir.Constant(_I64, 8)))
        signs = _load(context, builder, src_ty, src, _at(builder, o, 34), 32)
        steppers.append(_grid_steps(context, builder, grid_ty, grid, 64, index, signs,
                                    _nibble_odd16(context, builder, src_ty, src, o, 74, 8)))
    return steppers


def _iq3_s_blocks(context, builder, grid_ty, grid, blocks):
    """The steps (_grid_steps) of IQ3_S blocks (110 bytes: fp16 d, 64 grid-index low bytes, 8 qh bytes with point
    8 i + j's ninth index bit at bit j of byte i, 32 sign bytes, 4 scale bytes: a 4-bit scale per 32 values),
    grid uint32 [512]: each point's 4 byte magnitudes. The block's value is d (2 s + 1) times the grid's."""
    steppers = []
    for src_ty, src, o in blocks:
        def index(s, k, src_ty=src_ty, src=src, o=o):
            p = 16 * s + k
            high = builder.and_(builder.lshr(_byte_at(context, builder, src_ty, src, o, 66 + p // 8),
                                             ir.Constant(_I64, p % 8)), ir.Constant(_I64, 1))
            low = _byte_at(context, builder, src_ty, src, o, 2 + p)
            return builder.or_(low, builder.shl(high, ir.Constant(_I64, 8)))
        signs = _load(context, builder, src_ty, src, _at(builder, o, 74), 32)
        odd8 = _nibble_odd16(context, builder, src_ty, src, o, 106, 4)  # one scale per 32 values
        steppers.append(_grid_steps(context, builder, grid_ty, grid, 32, index, signs,
                                    _shuffle(builder, odd8, [j // 2 for j in range(16)])))
    return steppers


def _iq1_blocks(context, builder, grid_ty, grid, blocks, index, delta_neg, odd):
    """The steps of IQ1_S or IQ1_M blocks at src[o] for (src type, src, o) in blocks, as _iq2_xs_blocks gives
    them. A group of 8 values is a grid point of values in {-1, 0, 1} (grid: uint64 [2048], 8 int8 values each)
    plus a delta of +-1/8: held as the integers 8 g +- 1 (magnitudes <= 9), so the dot's d factor is 1/8.
    index(src type, src, o, g) and delta_neg(...): group g's grid index (i64) and whether its delta is negative
    (i1); odd(src type, src, o): the 16 run scales 2 s + 1 (<16 x i16>)."""
    v64 = ir.VectorType(_I8, 64)
    v8 = ir.VectorType(_I64, 8)
    grid_data = _data(context, builder, grid_ty, grid)
    steppers = []
    for src_ty, src, o in blocks:
        runs = odd(src_ty, src, o)

        def step(s, src_ty=src_ty, src=src, o=o, runs=runs):
            v = ir.Constant(v8, ir.Undefined)
            deltas = ir.Constant(ir.VectorType(_I8, 8), ir.Undefined)
            for k in range(8):
                g = 8 * s + k
                v = builder.insert_element(v, builder.load(builder.gep(grid_data, [index(src_ty, src, o, g)])),
                                           ir.Constant(_I32, k))
                deltas = builder.insert_element(deltas, builder.select(delta_neg(src_ty, src, o, g),
                                                                       ir.Constant(_I8, -1), ir.Constant(_I8, 1)),
                                                ir.Constant(_I32, k))
            w = builder.add(builder.shl(builder.bitcast(v, v64), _vec_const(8, [3] * 64)),
                            _shuffle(builder, deltas, [j // 8 for j in range(64)]))
            neg = builder.icmp_signed("<", w, ir.Constant(v64, [0] * 64))
            return (_negate_where(builder, w, neg), neg, _shuffle(builder, runs, [4 * s + k for k in range(4)]))
        steppers.append(step)
    return steppers


def _iq1_s_blocks(context, builder, grid_ty, grid, blocks):
    """_iq1_blocks of IQ1_S blocks (50 bytes: fp16 d, 32 grid-index low bytes, then per 32 values ib a uint16 at
    34 + 2 ib: bits 3 l .. 3 l + 2 group 4 ib + l's high index bits, bits 12-14 the scale, bit 15 the delta's
    sign)."""
    i16 = ir.IntType(16)

    def qh(src_ty, src, o, ib):
        return builder.zext(builder.load(_pointer(context, builder, src_ty, src, _at(builder, o, 34 + 2 * ib), i16),
                                         align=1), _I64)

    def index(src_ty, src, o, g):
        high = builder.and_(builder.lshr(qh(src_ty, src, o, g // 4), ir.Constant(_I64, 3 * (g % 4))),
                            ir.Constant(_I64, 7))
        return builder.or_(_byte_at(context, builder, src_ty, src, o, 2 + g), builder.shl(high, ir.Constant(_I64, 8)))

    def delta_neg(src_ty, src, o, g):
        return builder.icmp_unsigned(">=", qh(src_ty, src, o, g // 4), ir.Constant(_I64, 0x8000))

    def odd(src_ty, src, o):
        words = _load_vec(context, builder, src_ty, src, _at(builder, o, 34), i16, 8)
        scales = builder.and_(builder.lshr(words, _vec_const(16, [12] * 8)), _vec_const(16, [7] * 8))
        ls = builder.add(builder.shl(scales, _vec_const(16, [1] * 8)), _vec_const(16, [1] * 8))
        return _shuffle(builder, ls, [j // 2 for j in range(16)])  # one scale per 32 values
    return _iq1_blocks(context, builder, grid_ty, grid, blocks, index, delta_neg, odd)


def _iq1_m_blocks(context, builder, grid_ty, grid, blocks):
    """_iq1_blocks of IQ1_M blocks (56 bytes: 32 grid-index low bytes; 16 qh bytes, byte i's low nibble for group
    2 i and high nibble for 2 i + 1: bits 0-2 the index's high bits, bit 3 the delta's sign; four uint16 of
    3-bit scales, one per 16 values, run r's at bits 3 (r % 4) of word r // 4; d in their top nibbles,
    _iq1_m_d)."""
    i16 = ir.IntType(16)

    def nibble(src_ty, src, o, g):
        return builder.lshr(_byte_at(context, builder, src_ty, src, o, 32 + g // 2), ir.Constant(_I64, 4 * (g % 2)))

    def index(src_ty, src, o, g):
        high = builder.and_(nibble(src_ty, src, o, g), ir.Constant(_I64, 7))
        return builder.or_(_byte_at(context, builder, src_ty, src, o, g), builder.shl(high, ir.Constant(_I64, 8)))

    def delta_neg(src_ty, src, o, g):
        return builder.icmp_unsigned("!=", builder.and_(nibble(src_ty, src, o, g), ir.Constant(_I64, 8)),
                                     ir.Constant(_I64, 0))

    def odd(src_ty, src, o):
        words = _load_vec(context, builder, src_ty, src, _at(builder, o, 48), i16, 4)
        scales = builder.and_(builder.lshr(_shuffle(builder, words, [r // 4 for r in range(16)]),
                                           _vec_const(16, [3 * (r % 4) for r in range(16)])), _vec_const(16, [7] * 16))
        return builder.add(builder.shl(scales, _vec_const(16, [1] * 16)), _vec_const(16, [1] * 16))
    return _iq1_blocks(context, builder, grid_ty, grid, blocks, index, delta_neg, odd)


def _iq1_m_d(context, builder, src_ty, src, o):
    """IQ1_M's fp16 d as float32: its four nibbles are the top nibbles of the block's four scale words."""
    i16 = ir.IntType(16)
    words = _load_vec(context, builder, src_ty, src, _at(builder, o, 48), i16, 4)
    tops = builder.lshr(builder.and_(words, _vec_const(16, [0xF000] * 4)), _vec_const(16, [12, 8, 4, 0]))
    bits = _reduce_or16(builder, tops)
    return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())


def _reduce_or16(builder, vec):
    """The OR of a <4 x i16>'s lanes."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(16), [vec.type]),
                                        "llvm.vector.reduce.or.v4i16")
    return builder.call(fn, [vec])


# IQ2_XS as level planes (quant_planes.IQ2_XS_PLANES, made from IQ2_XS blocks at load): per 256 values, 106 bytes.
# Bytes 0-1 fp16 d and 2-9 the 4-bit run scales, as IQ2_XS has them (run j's at nibble j % 2 of byte 2 + j // 2);
# bytes 10-73 the magnitude levels (0, 1, 2 for IQ2_XS_MAGNITUDES 8, 25, 43), position 64 s + p's at bits 2 s of
# byte 10 + p; bytes 74-105 the sign bits, position u's at bit u % 8 of byte 74 + u // 8 (IQ2_XS's eight signs a
# group with the parity bit made explicit). Position u = 64 s + p holds value PLANES_ORDER[u] = 16 (p // 4) + 4 s +
# p % 4: a step s (64 positions, one vector) holds four values of every run of 16, so each 4-byte lane j of a step
# is run j's in every step, and the integer dot sums the four steps into one vector before it multiplies by the run
# scales once a block (fdot_planes_blocks). Activations go into the same order first (order_planes_i8 / _f32).
PLANES_BYTES, PLANES_SCALES, PLANES_LEVELS, PLANES_SIGNS = 106, 2, 10, 74
PLANES_ORDER = tuple(16 * (u % 64 // 4) + 4 * (u // 64) + u % 4 for u in range(256))
# value v's position in a block (PLANES_ORDER[PLANES_POSITION[v]] == v)
PLANES_POSITION = tuple(sorted(range(256), key=PLANES_ORDER.__getitem__))


def _planes_in_value_order(builder, steps):
    """A planes block's four steps (<64 x T> each: positions 64 s .. 64 s + 63) as four <64 x T> of its values
    64 j .. 64 j + 63, each a shuffle of all four steps (a few vpermt2b where the CPU has AVX-512 VBMI): storing
    the steps' 64 four-value lanes one by one had made a 512-token prompt 15-25% slower."""
    n = 2 * steps[0].type.count
    ab = builder.shuffle_vector(steps[0], steps[1], _vec_const(32, range(n)))
    cd = builder.shuffle_vector(steps[2], steps[3], _vec_const(32, range(n)))
    return [builder.shuffle_vector(ab, cd, _vec_const(32, PLANES_POSITION[64 * j:64 * j + 64])) for j in range(4)]


def _planes_blocks(context, builder, grid_ty, grid, blocks, offset=None):
    """The steps of IQ2_XS_PLANES blocks at src[o] for (src type, src, o) in blocks (grid unused; AVX-512 VBMI):
    step s -> (the magnitudes of positions 64 s .. 64 s + 63 as <64 x i8>, their negative lanes), by one vpermb of
    the block's 64 level bytes through a 64-byte table that reads bits 2 s .. 2 s + 1 of the index (vpermb reads
    six index bits; step 3 shifts its bits down first), the negative lanes straight from the sign bytes as a mask
    register. With an offset, the values come as offset +- magnitude by a second table. No grid look-up and no
    sign computing: the IQ2_XS dot's look-up and signs had taken ~30% of it, and in-format the per-step
    multishift, bit-shuffle and vpermb ~25% more. Positions hold values in PLANES_ORDER; the run scales are the
    callers' (_planes_run_scales, _planes_odd64)."""
    v64 = ir.VectorType(_I8, 64)
    mask64 = ir.VectorType(ir.IntType(1), 64)

    def shift(s):  # where step s's level sits in its index byte (step 3's index is shifted down first)
        return 2 * s if s < 3 else 0

    def table(s, sign):
        return _vec_const(8, [((offset or 0) + sign * IQ2_XS_MAGNITUDES[i >> shift(s) & 3]) % 256
                              if i >> shift(s) & 3 < 3 else 0 for i in range(64)])

    def look_up(tbl, index, s):
        if HAS_VBMI_BITALG:
            return _x86(builder, "llvm.x86.avx512.permvar.qi.512", v64, [tbl, index])
        # without VBMI (where the engine makes no planes, but the kernels that branch on the type still compile):
        # the table's entries for the step's four levels by selects
        level = builder.and_(builder.lshr(index, _vec_const(8, [shift(s)] * 64)), _vec_const(8, [3] * 64))
        out = ir.Constant(v64, [0] * 64)
        for lv in range(3):
            entry = _shuffle(builder, tbl, [lv << shift(s)] * 64)
            out = builder.select(builder.icmp_unsigned("==", level, _vec_const(8, [lv] * 64)), entry, out)
        return out
    steppers = []
    for src_ty, src, o in blocks:
        levels = _load(context, builder, src_ty, src, _at(builder, o, PLANES_LEVELS), 64)

        def step(s, src_ty=src_ty, src=src, o=o, levels=levels):
            index = levels if s < 3 else builder.lshr(levels, _vec_const(8, [6] * 64))
            bits = builder.load(_pointer(context, builder, src_ty, src, _at(builder, o, PLANES_SIGNS + 8 * s), _I64),
                                align=1)
            neg = builder.bitcast(bits, mask64)
            g8 = look_up(table(s, 1), index, s)
            if offset is not None:
                g8 = builder.select(neg, look_up(table(s, -1), index, s), g8)
            return g8, neg
        steppers.append(step)
    return steppers


fdot_iq2_xs_blocks, fdot_iq2_xs_row = _iq2_dots(_iq2_xs_blocks, 74, "iq2_xs")
fdot_iq2_xxs_blocks, fdot_iq2_xxs_row = _iq2_dots(_iq2_xxs_blocks, 66, "iq2_xxs", pairs=False)
fdot_iq3_xxs_blocks, fdot_iq3_xxs_row = _iq2_dots(_iq3_xxs_blocks, 98, "iq3_xxs", d_factor=0.25, table=_u32_table)
fdot_iq2_s_blocks, fdot_iq2_s_row = _iq2_dots(_iq2_s_blocks, 82, "iq2_s", pairs=False)
fdot_iq3_s_blocks, fdot_iq3_s_row = _iq2_dots(_iq3_s_blocks, 110, "iq3_s", d_factor=1.0, table=_u32_table)
fdot_iq1_s_blocks, fdot_iq1_s_row = _iq2_dots(_iq1_s_blocks, 50, "iq1_s")
fdot_iq1_m_blocks, fdot_iq1_m_row = _iq2_dots(_iq1_m_blocks, 56, "iq1_m", d_at=_iq1_m_d)


def _planes_run_scales(context, builder, src_ty, src, o):
    """The 16 run scales 2 s + 1 of the IQ2_XS_PLANES block at src[o], run j's in lane j (<16 x i32>). With VBMI
    the scale qword broadcast and one vpmultishiftqb puts nibble j one bit up in dword j's low byte (run 0's field
    wraps around from bit 63), then one vpternlog keeps those four bits and sets bit 0."""
    v16 = ir.VectorType(_I32, 16)
    if HAS_VBMI_BITALG:
        v64, v8 = ir.VectorType(_I8, 64), ir.VectorType(_I64, 8)
        q = builder.load(_pointer(context, builder, src_ty, src, _at(builder, o, PLANES_SCALES), _I64), align=1)
        qs = builder.insert_element(ir.Constant(v8, ir.Undefined), q, ir.Constant(_I32, 0))
        wide = builder.bitcast(builder.shuffle_vector(qs, qs, _vec_const(32, [0] * 8)), v64)
        ctrl = _vec_const(8, [(4 * (b // 4) - 1) % 64 if b % 4 == 0 else 0 for b in range(64)])
        fields = builder.bitcast(_x86(builder, "llvm.x86.avx512.pmultishift.qb.512", v64, [ctrl, wide]), v16)
    else:
        sb = builder.zext(_load(context, builder, src_ty, src, _at(builder, o, PLANES_SCALES), 8),
                          ir.VectorType(_I32, 8))
        nibs = builder.lshr(_shuffle(builder, sb, [j // 2 for j in range(16)]), _vec_const(32, [0, 4] * 8))
        fields = builder.shl(nibs, _vec_const(32, [1] * 16))
    return builder.or_(builder.and_(fields, _vec_const(32, [0x1E] * 16)), _vec_const(32, [1] * 16))


@intrinsic
def fdot_planes_blocks(typingctx, src, x, xd, blocks):
    """sum over the first `blocks` IQ2_XS_PLANES blocks of a row of d_b / 8 xd[b] times the block's integer sum
    with int8 x, x in the planes' value order (order_planes_i8): per block the four steps' magnitudes times the
    sign-applied x in one vpdpbusd accumulator (lane j: run j's 16 values), times the run scales by one vpmulld.
    The steps had each been scaled apart (a pack, a vpdpwssd and the scale words per two steps): in a Zen 4 core's
    loop from L1, 15.5 cycles a block against 17.9. Lanes stay exact: |16 * 43 * 127 * 31| < 2^22."""
    if not (_byte_array(src) and _byte_array(x) and _float_array(xd)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v, xd_ty, xd_v = sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2]
        v16 = ir.VectorType(_I32, 16)

        def terms(bs):
            offsets = [builder.mul(b, ir.Constant(b.type, PLANES_BYTES)) for b in bs]
            steppers = _planes_blocks(context, builder, None, None, [(src_ty, src_v, o) for o in offsets])
            out = []
            for b, o, block in zip(bs, offsets, steppers):
                xo = builder.mul(b, ir.Constant(b.type, 256))
                acc = ir.Constant(v16, [0] * 16)
                for step in range(4):
                    g8, neg = block(step)
                    xs = _negate_where(builder, _load(context, builder, x_ty, x_v, _at(builder, xo, 64 * step), 64),
                                       neg)
                    acc = _dpbusd(builder, acc, builder.bitcast(g8, v16), builder.bitcast(xs, v16), HAS_VNNI)
                lanes = builder.mul(acc, _planes_run_scales(context, builder, src_ty, src_v, o))
                d8 = builder.fmul(_half_at(context, builder, src_ty, src_v, o), ir.Constant(ir.FloatType(), 0.125))
                out.append((lanes, builder.fmul(d8, _elem(context, builder, xd_ty, xd_v, b))))
            return out
        return _paired_blocks(context, builder, args[3], terms)
    return types.float32(src, x, xd, blocks), codegen


def _planes_odd64(context, builder, src_ty, src, o):
    """The run scale 2 s + 1 of each of a step's 64 positions (position p: run p // 4) as <64 x i16>."""
    odd = _nibble_odd16(context, builder, src_ty, src, o, PLANES_SCALES, 8)
    return _shuffle(builder, odd, [p // 4 for p in range(64)])


@intrinsic
def fdot_planes_row(typingctx, src, x, blocks):
    """sum over the first `blocks` IQ2_XS_PLANES blocks of a row times float32 x in the planes' value order
    (order_planes_f32): value times run scale as an exact int16 product, converted once and multiplied with x in
    float lanes kept across the row."""
    if not (_byte_array(src) and _float_array(x)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v = sig.args[0], args[0], sig.args[1], args[1]
        f32, i16 = ir.FloatType(), ir.IntType(16)

        def terms(bs):
            offsets = [builder.mul(b, ir.Constant(b.type, PLANES_BYTES)) for b in bs]
            steppers = _planes_blocks(context, builder, None, None, [(src_ty, src_v, o) for o in offsets])
            out = []
            for b, o, block in zip(bs, offsets, steppers):
                y = builder.mul(b, ir.Constant(b.type, 256))
                odd64 = _planes_odd64(context, builder, src_ty, src_v, o)
                total = None
                for step in range(4):
                    g8, neg = block(step)
                    scaled = builder.mul(builder.sext(_negate_where(builder, g8, neg), ir.VectorType(i16, 64)), odd64)
                    xv = _load_vec(context, builder, x_ty, x_v, _at(builder, y, 64 * step), f32, 64)
                    part = builder.fmul(builder.sitofp(scaled, ir.VectorType(f32, 64)), xv, flags=_FL)
                    total = part if total is None else builder.fadd(total, part, flags=_FL)
                d8 = builder.fmul(_half_at(context, builder, src_ty, src_v, o), ir.Constant(f32, 0.125))
                out.append((_fold16(builder, total), d8))
            return out
        return _paired_blocks(context, builder, args[2], terms)
    return types.float32(src, x, blocks), codegen


def _order_planes(elem, name):
    """An intrinsic (x, out, blocks): out = x's first `blocks` blocks of 256 values in the planes' value order
    (PLANES_ORDER), x and out 1-D arrays of `elem`: one shuffle a block."""

    @intrinsic
    def order(typingctx, x, out, blocks):
        check = _byte_array if elem == _I8 else _float_array
        if not (check(x) and check(out)):
            return None

        def codegen(context, builder, sig, args):
            x_ty, x_v, out_ty, out_v, n = sig.args[0], args[0], sig.args[1], args[1], args[2]
            with cgutils.for_range(builder, n) as loop:
                o = builder.mul(loop.index, ir.Constant(loop.index.type, 256))
                v = _load_vec(context, builder, x_ty, x_v, o, elem, 256)
                _store(context, builder, out_ty, out_v, o, builder.shuffle_vector(v, v, _vec_const(32, PLANES_ORDER)))
            return context.get_dummy_value()
        return types.none(x, out, blocks), codegen
    order.__name__ = name
    return order


order_planes_i8 = _order_planes(_I8, "order_planes_i8")


def _reduce_fadd(builder, vec, n):
    """Sum of a <n x float> in any order (a tree of vector adds)."""
    f32 = ir.FloatType()
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, vec.type]),
                                        f"llvm.vector.reduce.fadd.v{n}f32")
    return builder.call(fn, [ir.Constant(f32, 0.0), vec], fastmath=("reassoc", "nsz"))


def _fold16(builder, v):
    """A <32 x float> or <64 x float> folded to 16 lanes (the row accumulators' width) by adding its halves."""
    while v.type.count > 16:
        n = v.type.count // 2
        v = builder.fadd(_shuffle(builder, v, list(range(n))), _shuffle(builder, v, list(range(n, 2 * n))), flags=_FL)
    return v


def _codes_times_x(context, builder, codes, x_ty, x, xo):
    """sum of integer codes <32 x iN> (signed) times float32 x[xo:xo + 32], folded to <16 x float>."""
    xv = _load_vec(context, builder, x_ty, x, xo, ir.FloatType(), 32)
    return _fold16(builder, builder.fmul(builder.sitofp(codes, ir.VectorType(ir.FloatType(), 32)), xv, flags=_FL))


def _halves8(context, builder, ary_ty, ary, o, stride):
    """The eight fp16 values at byte offsets o + stride * i of a byte array, as <8 x float>: a load each, then one
    vcvtph2ps (a vpgatherdd of the eight dwords measured slower on the Xeon)."""
    i16 = ir.IntType(16)
    h = ir.Constant(ir.VectorType(i16, 8), ir.Undefined)
    for i in range(8):
        v = builder.load(_pointer(context, builder, ary_ty, ary, _at(builder, o, stride * i), i16), align=1)
        h = builder.insert_element(h, v, ir.Constant(_I32, i))
    return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), 8)), ir.VectorType(ir.FloatType(), 8))


@intrinsic
def fdot_q8_0_octets(typingctx, src, x, xd, xs16, octets):
    """sum over blocks b < 8 octets of a Q8_0 row (34-byte blocks: fp16 d, 32 int8) of d_b * xd[b] * (codes_b .
    x[32 b:32 b + 32]), eight blocks a step (VNNI only: vpmaddubsw would saturate on the offset codes). The codes
    become unsigned bytes by one xor (code + 128) for vpdpbusd; a tree of shuffles and adds sums each block's
    eight lanes, and 128 * sum(x_b) (from the activations' 16-sums xs16) comes off in integers, so every block's
    sum is the exact integer codes_b . x_b before its one rounding into float, as in the pairs. Against
    fdot_q8_0_pairs this saves the sign transfer to x (vpabsb, vpsignb) and does the scale work once per eight."""
    if not (_byte_array(src) and _byte_array(x) and _float_array(xd) and _int32_array(xs16)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v, xd_ty, xd_v, xs_ty, xs_v, n = (sig.args[0], args[0], sig.args[1], args[1],
                                                                 sig.args[2], args[2], sig.args[3], args[3], args[4])
        f32 = ir.FloatType()
        v8f, v8i = ir.VectorType(f32, 8), ir.VectorType(_I32, 8)
        v16i, v64 = ir.VectorType(_I32, 16), ir.VectorType(_I8, 64)
        flip, zero = ir.Constant(v64, [-128] * 64), ir.Constant(v16i, [0] * 16)

        def fold(a, b, width):
            """Adjacent runs of `width` lanes of a then b, each lane plus its partner `width` lanes on: the sums of
            lane pairs, in block order, in half as many vectors."""
            lo = [i for i in range(32) if i % (2 * width) < width]
            return builder.add(builder.shuffle_vector(a, b, _vec_const(32, lo)),
                               builder.shuffle_vector(a, b, _vec_const(32, [i + width for i in lo])))

        acc = cgutils.alloca_once_value(builder, ir.Constant(v8f, [0.0] * 8))
        with cgutils.for_range(builder, n) as loop:
            q = loop.index
            o = builder.mul(q, ir.Constant(q.type, 272))
            sums = []
            for j in range(4):  # 64 bytes: blocks 2j (lanes 0-7) and 2j + 1 (lanes 8-15)
                ob = _at(builder, o, 68 * j)
                w = builder.shuffle_vector(_load(context, builder, src_ty, src_v, _at(builder, ob, 2), 32),
                                           _load(context, builder, src_ty, src_v, _at(builder, ob, 36), 32),
                                           _vec_const(32, range(64)))
                xv = _load(context, builder, x_ty, x_v, _at(builder, builder.mul(q, ir.Constant(q.type, 256)), 64 * j),
                           64)
                sums.append(_dpbusd(builder, zero, builder.bitcast(builder.xor(w, flip), v16i),
                                    builder.bitcast(xv, v16i), True))
            # 8 lanes a block -> 4 -> 2 -> 1
            pairs = fold(fold(sums[0], sums[1], 4), fold(sums[2], sums[3], 4), 2)
            blocks = _pair_sums(builder, pairs, 16)
            xs = _load_vec(context, builder, xs_ty, xs_v, builder.mul(q, ir.Constant(q.type, 16)), _I32, 16)
            xsum = _pair_sums(builder, xs, 16)
            exact = builder.sub(blocks, builder.mul(xsum, ir.Constant(v8i, [128] * 8)))
            scale8 = builder.fmul(_halves8(context, builder, src_ty, src_v, o, 34),
                                  _load_vec(context, builder, xd_ty, xd_v, builder.mul(q, ir.Constant(q.type, 8)), f32,
                                            8), flags=_FL)
            builder.store(builder.fadd(builder.load(acc), builder.fmul(builder.sitofp(exact, v8f), scale8, flags=_FL),
                                       flags=_FL), acc)
        return _reduce_fadd(builder, builder.load(acc), 8)
    return types.float32(src, x, xd, xs16, octets), codegen


@intrinsic
def fdot_q8_0_row(typingctx, src, x, blocks):
    """sum over the first `blocks` Q8_0 blocks of a row (34 bytes: fp16 d, 32 int8) of d_b * (codes_b .
    x[32 b:32 b + 32]), float32 x: the products in float lanes, scaled by d per block, reduced once
    (_float_lanes_row)."""
    if not (_byte_array(src) and _float_array(x)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v = sig.args[0], args[0], sig.args[1], args[1]

        def terms(b):
            o = builder.mul(b, ir.Constant(b.type, 34))
            codes = _load(context, builder, src_ty, src_v, _at(builder, o, 2), 32)
            lanes = _codes_times_x(context, builder, codes, x_ty, x_v, builder.mul(b, ir.Constant(b.type, 32)))
            return [(lanes, _half_at(context, builder, src_ty, src_v, o))]
        return _float_lanes_row(context, builder, args[2], terms)
    return types.float32(src, x, blocks), codegen


@intrinsic
def fdot_q6_k_row(typingctx, src, x, blocks):
    """sum over the first `blocks` Q6_K blocks of a row of d_b * sum_k scale[k] sum_i (code_i - 32) x_i, float32
    x. Each code times its run's scale is an exact int16 product (|code - 32| <= 32, |scale| <= 128), converted
    once and multiplied with x in float lanes; d per block (_float_lanes_row)."""
    if not (_byte_array(src) and _float_array(x)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v = sig.args[0], args[0], sig.args[1], args[1]
        v16 = ir.VectorType(ir.IntType(16), 32)

        def terms(b):
            o = builder.mul(b, ir.Constant(b.type, 210))
            y = builder.mul(b, ir.Constant(b.type, 256))
            lanes = None
            for half in range(2):
                codes, scales = _q6_half_codes(context, builder, src_ty, src_v, _at(builder, o, 64 * half),
                                               _at(builder, o, 128 + 32 * half), _at(builder, o, 192 + 8 * half))
                for k in range(4):
                    runs = _vec_const(32, [2 * k] * 16 + [2 * k + 1] * 16)
                    scaled = builder.mul(builder.sext(codes[k], v16), builder.shuffle_vector(scales, scales, runs))
                    part = _codes_times_x(context, builder, scaled, x_ty, x_v, _at(builder, y, 128 * half + 32 * k))
                    lanes = part if lanes is None else builder.fadd(lanes, part, flags=_FL)
            return [(lanes, _half_at(context, builder, src_ty, src_v, _at(builder, o, 208)))]
        return _float_lanes_row(context, builder, args[2], terms)
    return types.float32(src, x, blocks), codegen


# Decoders into float32 rows (prefill tiles, scratch rows). Same operations in the same order as ggml's
# dequantize_row_* (a product, or a product minus a product, never fused), so results stay bit-exact.

def _store(context, builder, ary_ty, ary, off, vec):
    data = _data(context, builder, ary_ty, ary)
    builder.store(vec, builder.bitcast(builder.gep(data, [off]), vec.type.as_pointer()), align=4)


def _splat_f(builder, v, n=32):
    vf = ir.VectorType(ir.FloatType(), n)
    first = builder.insert_element(ir.Constant(vf, ir.Undefined), v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, ir.Constant(vf, ir.Undefined), _vec_const(32, [0] * n))


@intrinsic
def dequant_s8_32(typingctx, src, o, d, dst, y):
    """dst[y:y+32] = d * int8(src[o:o+32]) (Q8_0)."""
    if not (_byte_array(src) and _float_array(dst)):
        return None

    def codegen(context, builder, sig, args):
        vf = ir.VectorType(ir.FloatType(), 32)
        q = builder.sitofp(_load(context, builder, sig.args[0], args[0], args[1], 32), vf)
        _store(context, builder, sig.args[3], args[3], args[4], builder.fmul(_splat_f(builder, args[2]), q))
        return context.get_dummy_value()
    return types.none(src, o, types.float32, dst, y), codegen


@intrinsic
def dequant_nibbles_32(typingctx, src, o, d1, m1, d2, m2, dst, y):
    """dst[y:y+32] = d1 * (src[o:o+32] & 15) - m1, dst[y+32:y+64] = d2 * (src[o:o+32] >> 4) - m2 (Q4_K)."""
    if not (_byte_array(src) and _float_array(dst)):
        return None

    def codegen(context, builder, sig, args):
        vf = ir.VectorType(ir.FloatType(), 32)
        q = _load(context, builder, sig.args[0], args[0], args[1], 32)
        lo = builder.uitofp(builder.and_(q, _vec_const(8, [15] * 32)), vf)
        hi = builder.uitofp(builder.lshr(q, _vec_const(8, [4] * 32)), vf)
        for part, (vals, dv, mv) in enumerate(((lo, args[2], args[3]), (hi, args[4], args[5]))):
            row = builder.fsub(builder.fmul(_splat_f(builder, dv), vals), _splat_f(builder, mv))
            _store(context, builder, sig.args[6], args[6], _at(builder, args[7], 32 * part), row)
        return context.get_dummy_value()
    return types.none(src, o, types.float32, types.float32, types.float32, types.float32, dst, y), codegen


@intrinsic
def dequant_q6_half(typingctx, src, ql, qh, sc, d, dst, y):
    """One Q6_K half into dst[y:y+128]: (d * scale) * (code - 32) per 16-run."""
    if not (_byte_array(src) and _float_array(dst)):
        return None

    def codegen(context, builder, sig, args):
        vf = ir.VectorType(ir.FloatType(), 32)
        codes, scales = _q6_half_codes(context, builder, sig.args[0], args[0], args[1], args[2], args[3])
        dsplat = _splat_f(builder, args[4])
        for k in range(4):
            runs = _vec_const(32, [2 * k] * 16 + [2 * k + 1] * 16)
            dl = builder.fmul(dsplat, builder.sitofp(builder.shuffle_vector(scales, scales, runs), vf))
            row = builder.fmul(dl, builder.sitofp(codes[k], vf))
            _store(context, builder, sig.args[5], args[5], _at(builder, args[6], 32 * k), row)
        return context.get_dummy_value()
    return types.none(src, ql, qh, sc, types.float32, dst, y), codegen


def _dequant_block(reader, name):
    """An intrinsic (grid, src, o, d, dst, y): the block at src[o] (its fp16 d given as a float) that
    reader reads as _iq2_xs_blocks does into dst[y:y+256]: per 16 values (d * (0.5 + s) * 0.25) * signed grid
    value, ggml's operations in its order (bit-exact with dequantize_row_iq2_xs), 64 values a step (for IQ2_XS a
    table look-up per group for its signs, 32 values a call, had cost 0.21-0.27 ns per value; 64 a step 0.16)."""
    @intrinsic
    def dequant(typingctx, grid, src, o, d, dst, y):
        if not (_u64_table(grid) and _byte_array(src) and _float_array(dst)):
            return None

        def codegen(context, builder, sig, args):
            grid_ty, grid_v, src_ty, src_v, o_v, d_v, dst_ty, dst_v, y_v = (
                sig.args[0], args[0], sig.args[1], args[1], args[2], args[3], sig.args[4], args[4], args[5])
            f32 = ir.FloatType()
            v4f = ir.VectorType(f32, 4)
            d4 = _shuffle(builder, builder.insert_element(ir.Constant(v4f, ir.Undefined), d_v,
                                                          ir.Constant(_I32, 0)), [0] * 4)
            block, = reader(context, builder, grid_ty, grid_v, [(src_ty, src_v, o_v)])
            for step in range(4):  # 64 values: eight groups, four scale nibbles
                g8, neg, sc4 = block(step)
                values = builder.sitofp(_negate_where(builder, g8, neg), ir.VectorType(f32, 64))
                # (0.5 + s) is (2 s + 1) / 2, exactly: d * it, then * 0.25 as ggml rounds them
                half_odd = builder.fmul(builder.uitofp(sc4, v4f), ir.Constant(v4f, [0.5] * 4))
                db = builder.fmul(builder.fmul(d4, half_odd), ir.Constant(v4f, [0.25] * 4))
                out = builder.fmul(_shuffle(builder, db, [k // 16 for k in range(64)]), values)
                _store(context, builder, dst_ty, dst_v, _at(builder, y_v, 64 * step), out)
            return context.get_dummy_value()
        return types.none(grid, src, o, types.float32, dst, y), codegen
    dequant.__name__ = f"dequant_{name}_block"
    return dequant


# IQ2_XS's blocks, and its planes (quant_planes; their dequant had been a scalar loop: float prompts of the
# synthetic 80B IQ2_XS file 0.50x llama.cpp against 0.90x as IQ2_XS)
dequant_iq2_xs_block = _dequant_block(_iq2_xs_blocks, "iq2_xs")


@intrinsic
def dequant_planes_block(typingctx, src, o, d, dst, y):
    """dst[y:y+256] = the IQ2_XS_PLANES block at src[o] (its fp16 d given as a float) in value order, ggml's
    operations in its order as _dequant_block's: per run (d * (0.5 + s)) * 0.25 times the signed magnitude, the
    signed magnitudes put into value order first (_planes_in_value_order)."""
    if not (_byte_array(src) and _float_array(dst)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, o_v, d_v, dst_ty, dst_v, y_v = sig.args[0], args[0], args[1], args[2], sig.args[3], args[3], \
            args[4]
        f32 = ir.FloatType()
        v16f = ir.VectorType(f32, 16)
        odd = _nibble_odd16(context, builder, src_ty, src_v, o_v, PLANES_SCALES, 8)
        half_odd = builder.fmul(builder.uitofp(odd, v16f), ir.Constant(v16f, [0.5] * 16))
        db = builder.fmul(builder.fmul(_splat_f(builder, d_v, 16), half_odd), ir.Constant(v16f, [0.25] * 16))
        block, = _planes_blocks(context, builder, None, None, [(src_ty, src_v, o_v)])
        values = _planes_in_value_order(builder, [_negate_where(builder, *block(step)) for step in range(4)])
        for j, v in enumerate(values):
            db64 = _shuffle(builder, db, [(64 * j + i) // 16 for i in range(64)])  # value i's run
            _store(context, builder, dst_ty, dst_v, _at(builder, y_v, 64 * j),
                   builder.fmul(db64, builder.sitofp(v, ir.VectorType(f32, 64))))
        return context.get_dummy_value()
    return types.none(src, o, types.float32, dst, y), codegen


order_planes_f32 = _order_planes(ir.FloatType(), "order_planes_f32")


@intrinsic
def fdot_f32_64(typingctx, a, b, n64):
    """sum over i < 64 n64 of a[i] * b[i] (float32 arrays): four 16-lane accumulators, so the sum is bound by
    the loads rather than by the latency of one chain of adds; one reduction at the end."""
    if not (_float_array(a) and _float_array(b)):
        return None

    def codegen(context, builder, sig, args):
        f32 = ir.FloatType()
        v16 = ir.VectorType(f32, 16)
        pa = _data(context, builder, sig.args[0], args[0])
        pb = _data(context, builder, sig.args[1], args[1])
        accs = [cgutils.alloca_once_value(builder, ir.Constant(v16, [0.0] * 16)) for _ in range(4)]
        with cgutils.for_range(builder, args[2]) as loop:
            base = builder.mul(loop.index, ir.Constant(loop.index.type, 64))
            for j in range(4):
                off = _at(builder, base, 16 * j)
                va = builder.load(builder.bitcast(builder.gep(pa, [off]), v16.as_pointer()), align=4)
                vb = builder.load(builder.bitcast(builder.gep(pb, [off]), v16.as_pointer()), align=4)
                builder.store(builder.fadd(builder.load(accs[j]), builder.fmul(va, vb, flags=_FL), flags=_FL), accs[j])
        total = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1]), flags=_FL),
                             builder.fadd(builder.load(accs[2]), builder.load(accs[3]), flags=_FL), flags=_FL)
        return _reduce_fadd(builder, total, 16)
    return types.float32(a, b, n64), codegen


def _half_row_dot(bf16):
    """sum over i < 64 n64 of w[i] * x[i], w the fp16 (bf16=False: vcvtph2ps) or bf16 (bf16=True: the 16 bits moved
    into a float32's high half) values in the bytes src[0:128 n64], x float32; four 16-lane accumulators as in
    fdot_f32_64."""
    @intrinsic
    def dot(typingctx, src, x, n64):
        if not (_byte_array(src) and _float_array(x)) or not (bf16 or HAS_F16C):
            return None

        def codegen(context, builder, sig, args):
            f32 = ir.FloatType()
            v16 = ir.VectorType(f32, 16)
            accs = [cgutils.alloca_once_value(builder, ir.Constant(v16, [0.0] * 16)) for _ in range(4)]
            with cgutils.for_range(builder, args[2]) as loop:
                base = builder.mul(loop.index, ir.Constant(loop.index.type, 64))
                for j in range(4):
                    off = _at(builder, base, 16 * j)
                    at = builder.mul(off, ir.Constant(off.type, 2))
                    if bf16:
                        bits = builder.zext(_load_vec(context, builder, sig.args[0], args[0], at, ir.IntType(16), 16),
                                            ir.VectorType(_I32, 16))
                        w = builder.bitcast(builder.shl(bits, ir.Constant(bits.type, [16] * 16)), v16)
                    else:
                        w = builder.fpext(_load_vec(context, builder, sig.args[0], args[0], at, ir.HalfType(), 16), v16)
                    xv = _load_vec(context, builder, sig.args[1], args[1], off, f32, 16)
                    builder.store(builder.fadd(builder.load(accs[j]), builder.fmul(w, xv, flags=_FL), flags=_FL),
                                  accs[j])
            total = builder.fadd(builder.fadd(builder.load(accs[0]), builder.load(accs[1]), flags=_FL),
                                 builder.fadd(builder.load(accs[2]), builder.load(accs[3]), flags=_FL), flags=_FL)
            return _reduce_fadd(builder, total, 16)
        return types.float32(src, x, n64), codegen
    dot.__name__ = "fdot_bf16_64" if bf16 else "fdot_f16_64"
    return dot


fdot_f16_64, fdot_bf16_64 = _half_row_dot(False), _half_row_dot(True)


def _c_float_array(ty) -> bool:
    """A C-contiguous float32 array of any rank (addressed by flat element offsets)."""
    return isinstance(ty, types.Array) and ty.layout == "C" and ty.dtype == types.float32


def _block_operands(context, builder, sig, args):
    """The operands of a register block of a small product (fdot_nt_*, fmadd_nn_*: arguments a, ao, lda, b, bo,
    ldb, k, c, co, ldc, accumulate): the data pointers of a, b and c, the offsets, strides and length as i64, and
    the accumulate flag."""
    a_v, ao_v, lda_v, b_v, bo_v, ldb_v, k_v, c_v, co_v, ldc_v, acc_v = args
    pa = _data(context, builder, sig.args[0], a_v)
    pb = _data(context, builder, sig.args[3], b_v)
    pc = _data(context, builder, sig.args[7], c_v)
    ints = [builder.sext(v, _I64) if v.type.width < 64 else v for v in (ao_v, lda_v, bo_v, ldb_v, k_v, co_v, ldc_v)]
    return pa, pb, pc, ints, acc_v


def _fdot_nt_block(mr: int, nr: int):
    """An intrinsic for an mr x nr block of C = A B^T: c[co + i ldc + j] (+)= sum_{l < 16 k16} a[ao + i lda + l]
    b[bo + j ldb + l], A's rows and B's rows contiguous. mr x nr accumulators of 16 lanes stay in registers
    across the whole length (4 x 4: 16 of AVX-512's 32, each step 8 loads for 16 multiply-adds, where
    Numba's vectorized 2 x 4 loop takes 6 for 8); one horizontal sum per output at the end."""

    @intrinsic
    def block(typingctx, a, ao, lda, b, bo, ldb, k16, c, co, ldc, accumulate):
        if not (_c_float_array(a) and _c_float_array(b) and _c_float_array(c)):
            return None

        def codegen(context, builder, sig, args):
            pa, pb, pc, ints, acc_v = _block_operands(context, builder, sig, args)
            ao_v, lda_v, bo_v, ldb_v, k16_v, co_v, ldc_v = ints
            f32 = ir.FloatType()
            v16 = ir.VectorType(f32, 16)
            i64 = _I64
            a_rows = [builder.add(ao_v, builder.mul(lda_v, ir.Constant(i64, i))) for i in range(mr)]
            b_rows = [builder.add(bo_v, builder.mul(ldb_v, ir.Constant(i64, j))) for j in range(nr)]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(v16, [0.0] * 16)) for _ in range(nr)]
                    for _ in range(mr)]
            with cgutils.for_range(builder, k16_v) as loop:
                step = builder.mul(builder.sext(loop.index, i64) if loop.index.type.width < 64 else loop.index,
                                   ir.Constant(i64, 16))

                def load(p, row):
                    return builder.load(builder.bitcast(builder.gep(p, [builder.add(row, step)]), v16.as_pointer()),
                                        align=4)
                va = [load(pa, r) for r in a_rows]
                vb = [load(pb, r) for r in b_rows]
                for i in range(mr):
                    for j in range(nr):
                        prod = builder.fmul(va[i], vb[j], flags=_FL)
                        builder.store(builder.fadd(builder.load(accs[i][j]), prod, flags=_FL), accs[i][j])
            for i in range(mr):
                row = builder.add(co_v, builder.mul(ldc_v, ir.Constant(i64, i)))
                for j in range(nr):
                    ptr = builder.gep(pc, [builder.add(row, ir.Constant(i64, j))])
                    total = _reduce_fadd(builder, builder.load(accs[i][j]), 16)
                    old = builder.select(acc_v, builder.load(ptr), ir.Constant(f32, 0.0))
                    builder.store(builder.fadd(old, total), ptr)
            return context.get_dummy_value()
        return types.none(a, ao, lda, b, bo, ldb, k16, c, co, ldc, accumulate), codegen
    return block


# 4 x 4 blocks and the edges of a product whose sides are not multiples of 4.
fdot_nt_4x4, fdot_nt_3x4, fdot_nt_2x4, fdot_nt_1x4 = (_fdot_nt_block(m, 4) for m in (4, 3, 2, 1))
fdot_nt_4x1, fdot_nt_3x1, fdot_nt_2x1, fdot_nt_1x1 = (_fdot_nt_block(m, 1) for m in (4, 3, 2, 1))


def _fmadd_nn_block(mr: int, nv: int):
    """An intrinsic for an mr x (16 nv) block of C = A B: c[co + i ldc + l] (+)= sum_{p < k} a[ao + i lda + p]
    b[bo + p ldb + l] for l < 16 nv, A's rows and B's rows contiguous. Each step broadcasts mr values of A and
    multiply-adds them with nv vectors of one row of B into mr x nv accumulators that stay in registers (4 x 4: 16
    of AVX-512's 32, 8 loads for 16 multiply-adds); each output is summed in the order of p, with no horizontal
    sums at all, which for the short sums of a DeltaNet chunk (k = 64 or 128) had cost as much as the products."""

    @intrinsic
    def block(typingctx, a, ao, lda, b, bo, ldb, k, c, co, ldc, accumulate):
        if not (_c_float_array(a) and _c_float_array(b) and _c_float_array(c)):
            return None

        def codegen(context, builder, sig, args):
            pa, pb, pc, ints, acc_v = _block_operands(context, builder, sig, args)
            ao_v, lda_v, bo_v, ldb_v, k_v, co_v, ldc_v = ints
            v16 = ir.VectorType(ir.FloatType(), 16)
            i64 = _I64
            a_rows = [builder.add(ao_v, builder.mul(lda_v, ir.Constant(i64, i))) for i in range(mr)]
            accs = [[cgutils.alloca_once_value(builder, ir.Constant(v16, [0.0] * 16)) for _ in range(nv)]
                    for _ in range(mr)]

            def vec(p, off):
                return builder.bitcast(builder.gep(p, [off]), v16.as_pointer())
            with cgutils.for_range(builder, k_v) as loop:
                p = loop.index
                b_row = builder.add(bo_v, builder.mul(ldb_v, p))
                vb = [builder.load(vec(pb, builder.add(b_row, ir.Constant(i64, 16 * j))), align=4) for j in range(nv)]
                for i in range(mr):
                    va = _splat_f(builder, builder.load(builder.gep(pa, [builder.add(a_rows[i], p)])), 16)
                    for j in range(nv):
                        prod = builder.fmul(va, vb[j], flags=_FL)
                        builder.store(builder.fadd(builder.load(accs[i][j]), prod, flags=_FL), accs[i][j])
            zero = ir.Constant(v16, [0.0] * 16)
            for i in range(mr):
                row = builder.add(co_v, builder.mul(ldc_v, ir.Constant(i64, i)))
                for j in range(nv):
                    ptr = vec(pc, builder.add(row, ir.Constant(i64, 16 * j)))
                    old = builder.select(acc_v, builder.load(ptr, align=4), zero)
                    builder.store(builder.fadd(old, builder.load(accs[i][j])), ptr, align=4)
            return context.get_dummy_value()
        return types.none(a, ao, lda, b, bo, ldb, k, c, co, ldc, accumulate), codegen
    return block


# 4 x 64 blocks, and the edges of a product whose rows are not a multiple of 4 or columns of 64.
fmadd_nn_4x4, fmadd_nn_4x1, fmadd_nn_1x4, fmadd_nn_1x1 = (_fmadd_nn_block(m, v) for m, v in ((4, 4), (4, 1), (1, 4),
                                                                                             (1, 1)))


def _k2_lanes(context, builder, src_ty, src, o, xq_ty, xq, y, codes_at, sc16, high=None):
    """sum_r sc16[r] (q_r . x_r) over the 16 runs of 16 of a block whose 2-bit codes lie at shifts 0, 2, 4, 6 of the
    32-byte groups at src[o + codes_at] and src[o + codes_at + 32] (Q2_K, Q3_K), as <16 x i32> (<32 x i32> without
    AVX-512BW); high(half, j): <32 x i8> bits ORed onto the codes of shift 2 j (Q3_K's third bit), or None."""
    total = None
    for half in range(2):
        q = _load(context, builder, src_ty, src, _at(builder, o, codes_at + 32 * half), 32)
        codes = [builder.and_(builder.lshr(q, _vec_const(8, [2 * j] * 32)), _vec_const(8, [3] * 32)) for j in range(4)]
        if high is not None:
            codes = [builder.or_(c, high(half, j)) for j, c in enumerate(codes)]
        for j in range(4):
            run = 8 * half + 2 * j
            if HAS_AVX512BW:  # shifts j and j + 1: 64 contiguous activations, four runs, in one zmm
                if j % 2:
                    continue
                x = _load(context, builder, xq_ty, xq, _at(builder, y, 128 * half + 32 * j), 64)
                part = _madd_runs(builder, codes[j], codes[j + 1], x, sc16, run, 16)
            else:
                scale = builder.shuffle_vector(sc16, sc16, _vec_const(32, [run] * 16 + [run + 1] * 16))
                x = _load(context, builder, xq_ty, xq, _at(builder, y, 128 * half + 32 * j), 32)
                part = _scaled_products(builder, codes[j], scale, x)
            total = part if total is None else builder.add(total, part)
    return total


def _q2_k_lanes(context, builder, src_ty, src, o, xq_ty, xq, y, xs_ty, xs, g):
    """The lanes of a Q2_K block (84 bytes at src[o]) times 256 Q8_K codes xq[y:] with their 16-sums at xs[g:],
    before any reduction: (sum_i (sc_i & 15) (q_i . x_i) over <16 x i32> (<32 x i32> without AVX-512BW), (sc_i >> 4)
    sum(x_i) as <16 x i32>) over the 16 runs of 16; 2-bit codes at shifts 0, 2, 4, 6 of 32-byte groups."""
    sb = _load(context, builder, src_ty, src, o, 16)
    sc16 = builder.zext(builder.and_(sb, _vec_const(8, [15] * 16)), ir.VectorType(ir.IntType(16), 16))
    mins = builder.zext(builder.lshr(sb, _vec_const(8, [4] * 16)), ir.VectorType(_I32, 16))
    total = _k2_lanes(context, builder, src_ty, src, o, xq_ty, xq, y, 16, sc16)
    return total, builder.mul(mins, _load_vec(context, builder, xs_ty, xs, g, _I32, 16))


def _q3_k_scales16(context, builder, src_ty, src, o):
    """A Q3_K block's 16 signed 6-bit scales (s - 32) as <16 x i16>, from its 12 bytes at o + 96 (ggml's
    dequantize_row_q3_K): low nibbles of bytes 0-7, then their high nibbles, each ORed with the bit pair 2 (s // 4)
    of byte 8 + s % 4 shifted to bits 4-5, by word shifts of one spread of the bytes. The 16 bytes are read from
    o + 94 so that the load ends with the block (the fp16 d at 108)."""
    w16 = ir.VectorType(ir.IntType(16), 16)
    sb = _load(context, builder, src_ty, src, _at(builder, o, 94), 16)  # scale byte i at lane 2 + i
    low = builder.zext(_shuffle(builder, sb, [2 + i % 8 for i in range(16)]), w16)
    low = builder.and_(builder.lshr(low, ir.Constant(w16, [4 * (i // 8) for i in range(16)])),
                       ir.Constant(w16, [15] * 16))
    top = builder.zext(_shuffle(builder, sb, [10 + i % 4 for i in range(16)]), w16)
    top = builder.and_(builder.lshr(top, ir.Constant(w16, [2 * (i // 4) for i in range(16)])),
                       ir.Constant(w16, [3] * 16))
    return builder.sub(builder.or_(low, builder.shl(top, ir.Constant(w16, [4] * 16))), ir.Constant(w16, [32] * 16))


def _q3_k_high_bits(context, builder, src_ty, src, o):
    """A function (half, j) -> the third code bits of the Q3_K block at src[o] for shift 2 j of 32-byte group half:
    bit 4 half + j of its 32 hm bytes, at bit 2 (<32 x i8>)."""
    hm = _load(context, builder, src_ty, src, o, 32)

    def high(half, j):
        bit = builder.and_(builder.lshr(hm, _vec_const(8, [4 * half + j] * 32)), _vec_const(8, [1] * 32))
        return builder.shl(bit, _vec_const(8, [2] * 32))
    return high


def _q3_k_lanes(context, builder, src_ty, src, o, xq_ty, xq, y, xs_ty, xs, g):
    """The lanes of a Q3_K block (110 bytes at src[o]: 32 bytes of third bits hm, Q2_K's 2-bit code layout from
    byte 32, 12 bytes of scales, fp16 d) times 256 Q8_K codes, as _q2_k_lanes: (sum_r s_r (c_r . x_r), 4 s_r
    sum(x_r)) with c the 3-bit code (2-bit code plus 4 times bit 4 half + j of hm byte l % 32 at shift 2 j), since
    ggml's value is s_r (c - 4) (_q3_k_scales16 for s)."""
    sc16 = _q3_k_scales16(context, builder, src_ty, src, o)
    total = _k2_lanes(context, builder, src_ty, src, o, xq_ty, xq, y, 32, sc16,
                      _q3_k_high_bits(context, builder, src_ty, src, o))
    mins = builder.mul(builder.sext(sc16, ir.VectorType(_I32, 16)), ir.Constant(ir.VectorType(_I32, 16), [4] * 16))
    return total, builder.mul(mins, _load_vec(context, builder, xs_ty, xs, g, _I32, 16))


@intrinsic
def idot_q2_k_block(typingctx, src, o, xq, y, xs16, g, d, dmin):
    """One Q2_K block (84 bytes at src[o], its fp16 d and dmin given as floats) times 256 Q8_K codes xq[y:]
    with their 16-sums at xs16[g:]: d * sum_i (sc_i & 15) (q_i . x_i) - dmin * sum_i (sc_i >> 4) sum(x_i) over
    the 16 runs of 16 (_q2_k_lanes, then one reduction each)."""
    if not (_byte_array(src) and _byte_array(xq) and _int32_array(xs16)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, o_v, xq_ty, xq_v, y_v, xs_ty, xs_v, g_v, d, dmin = _kblock_args(sig, args)
        total, mins = _q2_k_lanes(context, builder, src_ty, src_v, o_v, xq_ty, xq_v, y_v, xs_ty, xs_v, g_v)
        isc = _reduce_add(builder, total, 16 if HAS_AVX512BW else 32)
        return _scales_minus_mins(builder, d, isc, dmin, _reduce_add(builder, mins, 16))
    return types.float32(src, o, xq, y, xs16, g, types.float32, types.float32), codegen


@intrinsic
def fdot_q2_k_blocks(typingctx, src, xq, xd, xs16, blocks):
    """sum over the first `blocks` Q2_K blocks of a row of xd[b] * idot_q2_k_block's sum: _q2_k_lanes in float
    lanes (_k_row_codegen; AVX-512BW only)."""
    if not (_byte_array(src) and _byte_array(xq) and _float_array(xd) and _int32_array(xs16)):
        return None
    return types.float32(src, xq, xd, xs16, blocks), _k_row_codegen(_q2_k_lanes, 84, 80)


@intrinsic
def fdot_q3_k_blocks(typingctx, src, xq, xd, xs16, blocks):
    """sum over the first `blocks` Q3_K blocks of a row of xd[b] d_b sum_r s_r (c_r - 4) . x_r: _q3_k_lanes in
    float lanes (_k_row_codegen; AVX-512BW only)."""
    if not (HAS_AVX512BW and _byte_array(src) and _byte_array(xq) and _float_array(xd) and _int32_array(xs16)):
        return None
    return types.float32(src, xq, xd, xs16, blocks), _k_row_codegen(_q3_k_lanes, 110, 108, dmin=False)


# IQ4_NL's and IQ4_XS's 16 levels (ggml's kvalues_iq4nl): codes 0-7 negative, 8-15 positive.
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_xs_scales8(context, builder, src_ty, src, o):
    """An IQ4_XS block's eight sub-block scales ls - 32 as <8 x float>: the low nibbles from scales_l (bytes 4-7,
    nibble ib % 2 of byte ib // 2), the top two bits from scales_h (bits 2 ib, 2 ib + 1 of the word at byte 2),
    by word shifts."""
    w8 = ir.VectorType(ir.IntType(16), 8)
    head = _load(context, builder, src_ty, src, o, 8)
    low = builder.zext(_shuffle(builder, head, [4 + ib // 2 for ib in range(8)]), w8)
    low = builder.and_(builder.lshr(low, ir.Constant(w8, [4 * (ib % 2) for ib in range(8)])), ir.Constant(w8, [15] * 8))
    sh = builder.bitcast(_shuffle(builder, head, [2, 3]), ir.IntType(16))
    top = builder.and_(builder.lshr(_splat(builder, sh, 8, 16), ir.Constant(w8, [2 * ib for ib in range(8)])),
                       ir.Constant(w8, [3] * 8))
    ls = builder.or_(low, builder.shl(top, ir.Constant(w8, [4] * 8)))
    return builder.sitofp(builder.sub(ls, ir.Constant(w8, [32] * 8)), ir.VectorType(ir.FloatType(), 8))


@intrinsic
def fdot_iq4_xs_blocks(typingctx, src, xq, xd, blocks):
    """sum over the first `blocks` IQ4_XS blocks of a row (136 bytes: fp16 d, scales_h, scales_l[4], qs[128]; sub-block
    ib's 16 bytes hold its values 0-15 in their low nibbles and 16-31 in their high) of xd[b] d sum_ib (ls_ib - 32)
    (levels . x_ib), Q8_K codes xq (VNNI). Per 128 values: the 64 bytes' low and high nibbles look up the levels'
    magnitudes by vpshufb, codes below 8 (the negative levels) negate x under a mask, and vpdpbusd sums them
    exactly, lanes 4 L .. 4 L + 3 holding sub-block 4 h + L; the activations come in the same order by one 16-byte
    interleave of two loads. The lanes go to float once, scaled per sub-block (_float_lanes_row)."""
    if not (HAS_VNNI and _byte_array(src) and _byte_array(xq) and _float_array(xd)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, xq_ty, xq_v, xd_ty, xd_v = sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2]
        v64, v16 = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16)
        zero8 = ir.Constant(v64, [0] * 64)
        magnitudes = _vec_const(8, [abs(IQ4_LEVELS[i % 16]) for i in range(64)])
        chunks = [[16 * c + i for c in (0, 2, 4, 6) for i in range(16)], [16 * c + i for c in (1, 3, 5, 7)
                                                                         for i in range(16)]]

        def terms(b):
            o = builder.mul(b, ir.Constant(b.type, 136))
            y = builder.mul(b, ir.Constant(b.type, 256))
            scale = builder.fmul(_iq4_xs_scales8(context, builder, src_ty, src_v, o),
                                 _splat_f(builder, builder.fmul(_half_at(context, builder, src_ty, src_v, o),
                                                                _elem(context, builder, xd_ty, xd_v, b)), 8),
                                 flags=_FL)
            out = []
            for h in range(2):
                q = _load(context, builder, src_ty, src_v, _at(builder, o, 8 + 64 * h), 64)
                x0 = _load(context, builder, xq_ty, xq_v, _at(builder, y, 128 * h), 64)
                x1 = _load(context, builder, xq_ty, xq_v, _at(builder, y, 128 * h + 64), 64)
                lanes = ir.Constant(v16, [0] * 16)
                for half, codes in enumerate((builder.and_(q, _vec_const(8, [15] * 64)),
                                              builder.lshr(q, _vec_const(8, [4] * 64)))):
                    x = builder.shuffle_vector(x0, x1, _vec_const(32, chunks[half]))
                    mag = _x86(builder, "llvm.x86.avx512.pshuf.b.512", v64, [magnitudes, codes])
                    sx = builder.select(builder.icmp_unsigned("<", codes, _vec_const(8, [8] * 64)),
                                        builder.sub(zero8, x), x)
                    lanes = _dpbusd(builder, lanes, builder.bitcast(mag, v16), builder.bitcast(sx, v16), True)
                out.append((lanes, _shuffle(builder, scale, [4 * h + i // 4 for i in range(16)])))
            return out
        return _float_lanes_row(context, builder, args[3], terms)
    return types.float32(src, xq, xd, blocks), codegen


@intrinsic
def fdot_iq4_xs_row(typingctx, src, x, blocks):
    """sum over the first `blocks` IQ4_XS blocks of a row times float32 x: per sub-block ib of 32 its 16 bytes'
    low and high nibbles look up the levels by a 16-byte vpshufb, sign-extended to 16 float lanes and multiplied by
    x[32 ib:32 ib + 16] and x[32 ib + 16:32 ib + 32]; each sub-block's sum scaled once by d (ls - 32), lanes kept
    across the row (_float_lanes_row; decoding the row first and dotting it had cost 0.34 ns a weight)."""
    if not (_byte_array(src) and _float_array(x)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v = sig.args[0], args[0], sig.args[1], args[1]
        f32 = ir.FloatType()
        v16b, v16i, v16f = ir.VectorType(_I8, 16), ir.VectorType(_I32, 16), ir.VectorType(f32, 16)
        levels = _vec_const(8, list(IQ4_LEVELS))

        def terms(b):
            o = builder.mul(b, ir.Constant(b.type, 136))
            y = builder.mul(b, ir.Constant(b.type, 256))
            dls = builder.fmul(_iq4_xs_scales8(context, builder, src_ty, src_v, o),
                               _splat_f(builder, _half_at(context, builder, src_ty, src_v, o), 8), flags=_FL)
            lanes = None
            for ib in range(8):
                q = _load(context, builder, src_ty, src_v, _at(builder, o, 8 + 16 * ib), 16)
                total = None
                for half, codes in enumerate((builder.and_(q, _vec_const(8, [15] * 16)),
                                              builder.lshr(q, _vec_const(8, [4] * 16)))):
                    w = _x86(builder, "llvm.x86.ssse3.pshuf.b.128", v16b, [levels, codes])
                    xv = _load_vec(context, builder, x_ty, x_v, _at(builder, y, 32 * ib + 16 * half), f32, 16)
                    part = builder.fmul(builder.sitofp(builder.sext(w, v16i), v16f), xv, flags=_FL)
                    total = part if total is None else builder.fadd(total, part, flags=_FL)
                part = builder.fmul(total, _shuffle(builder, dls, [ib] * 16), flags=_FL)
                lanes = part if lanes is None else builder.fadd(lanes, part, flags=_FL)
            return [(lanes, ir.Constant(f32, 1.0))]
        return _float_lanes_row(context, builder, args[2], terms)
    return types.float32(src, x, blocks), codegen


def _pair_nibbles(context, builder, src_ty, src, o, first, stride):
    """The 64 nibbles of two 32-value blocks whose 16 code bytes lie at src[o + first] and src[o + first + stride]
    (byte j's low nibble is value j, its high nibble value j + 16: IQ4_NL, Q5_0) in value order, as <64 x u8>: the
    bytes spread as [q0, q0, q1, q1], the upper copy of each shifted down by a word shift."""
    v64, w32 = ir.VectorType(_I8, 64), ir.VectorType(ir.IntType(16), 32)
    q0 = _load(context, builder, src_ty, src, _at(builder, o, first), 16)
    q1 = _load(context, builder, src_ty, src, _at(builder, o, first + stride), 16)
    spread = builder.shuffle_vector(q0, q1, _vec_const(32, [16 * (c // 2) + i for c in range(4) for i in range(16)]))
    shifted = builder.lshr(builder.bitcast(spread, w32), ir.Constant(w32, [4 * ((w // 8) % 2) for w in range(32)]))
    return builder.and_(builder.bitcast(shifted, v64), _vec_const(8, [15] * 64))


def _iq4_nl_pair_values(context, builder, src_ty, src, o):
    """A pair of IQ4_NL blocks' 64 values (levels, <64 x i8>) at src[o] (18 bytes each: fp16 d, 16 code bytes), in
    value order: the nibbles through the levels by vpshufb."""
    codes = _pair_nibbles(context, builder, src_ty, src, o, 2, 18)
    return _x86(builder, "llvm.x86.avx512.pshuf.b.512", ir.VectorType(_I8, 64),
                [_vec_const(8, list(IQ4_LEVELS) * 4), codes])


def _pair_codes5(context, builder, src_ty, src, o, qh, size):
    """A pair of 5-bit-code blocks' 64 codes (0-31, <64 x u8>) at src[o] (`size` bytes each: the 32 fifth bits at
    byte qh, value j's at bit j, then 16 code bytes), in value order: the two blocks' qh words are one 64-bit mask
    ORing 16 onto the nibbles (Q5_0, Q5_1)."""
    codes = _pair_nibbles(context, builder, src_ty, src, o, qh + 4, size)
    i64 = ir.IntType(64)
    words = [builder.zext(builder.load(_pointer(context, builder, src_ty, src, _at(builder, o, qh + size * h), _I32),
                                       align=1), i64) for h in range(2)]
    bits = builder.bitcast(builder.or_(words[0], builder.shl(words[1], ir.Constant(i64, 32))),
                           ir.VectorType(ir.IntType(1), 64))
    return builder.or_(codes, builder.select(bits, _vec_const(8, [16] * 64), _vec_const(8, [0] * 64)))


def _q5_0_pair_values(context, builder, src_ty, src, o):
    """A pair of Q5_0 blocks' 64 values (code - 16) at src[o] (22 bytes each: fp16 d, qh, 16 code bytes)."""
    return builder.sub(_pair_codes5(context, builder, src_ty, src, o, 2, 22), _vec_const(8, [16] * 64))


def _q5_1_pair_codes(context, builder, src_ty, src, o):
    """A pair of Q5_1 blocks' 64 codes (value d code + m) at src[o] (24 bytes each: fp16 d, fp16 m, qh, codes)."""
    return _pair_codes5(context, builder, src_ty, src, o, 4, 24)


def _q4_0_pair_values(context, builder, src_ty, src, o):
    """A pair of Q4_0 blocks' 64 values (code - 8) at src[o] (18 bytes each: fp16 d, 16 code bytes)."""
    return builder.sub(_pair_nibbles(context, builder, src_ty, src, o, 2, 18), _vec_const(8, [8] * 64))


def _q4_1_pair_codes(context, builder, src_ty, src, o):
    """A pair of Q4_1 blocks' 64 codes (value d code + m) at src[o] (20 bytes each: fp16 d, fp16 m, codes)."""
    return _pair_nibbles(context, builder, src_ty, src, o, 4, 20)


# MXFP4's e2m1 values, doubled to integers (its scale is halved to match: _e8m0_half_at)
FP4_LEVELS = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _mxfp4_pair_values(context, builder, src_ty, src, o):
    """A pair of MXFP4 blocks' 64 doubled e2m1 values at src[o] (17 bytes each: e8m0 exponent, 16 code bytes):
    the nibbles through FP4_LEVELS by vpshufb."""
    codes = _pair_nibbles(context, builder, src_ty, src, o, 1, 17)
    return _x86(builder, "llvm.x86.avx512.pshuf.b.512", ir.VectorType(_I8, 64),
                [_vec_const(8, list(FP4_LEVELS) * 4), codes])


def _e8m0_half_at(context, builder, ary_ty, ary, off):
    """2^(e - 128) for the e8m0 exponent byte e at byte offset `off`, as float32: (e - 1) << 23 as bits, or the
    subnormals 2^-128 and 2^-127 for e = 0 and 1 (MXFP4's scale, halved for FP4_LEVELS)."""
    e = builder.zext(builder.load(_pointer(context, builder, ary_ty, ary, off, _I8)), _I32)
    small = builder.icmp_unsigned("<", e, ir.Constant(_I32, 2))
    bits = builder.select(small, builder.shl(ir.Constant(_I32, 0x00200000), e),
                          builder.shl(builder.sub(e, ir.Constant(_I32, 1)), ir.Constant(_I32, 23)))
    return builder.bitcast(bits, ir.FloatType())


def _pair_int_codegen(size, values, scale=None, min_at=None):
    """The codegen of an integer row dot over pairs of 32-value blocks of `size` bytes with Q8_0 activation codes
    (VNNI): values(context, builder, src_ty, src, o) gives a pair's 64 values in value order, each block's scale d
    at its byte 0 (fp16, or what scale reads: _pair_scales16). Signed values: their magnitudes times x with the
    values' signs moved onto x, one vpdpbusd (lanes 0-7 block 2 p, 8-15 block 2 p + 1, exact), float lanes scaled
    per block by d xd (_float_lanes_row). With an fp16 min m at byte min_at (value d code + m), the codes are
    unsigned and go straight into vpdpbusd; a second one against ones sums x for m xd sum(x)."""
    def codegen(context, builder, sig, args):
        src_ty, src_v, xq_ty, xq_v, xd_ty, xd_v = sig.args[0], args[0], sig.args[1], args[1], sig.args[2], args[2]
        v64, v16 = ir.VectorType(_I8, 64), ir.VectorType(_I32, 16)
        zero, zero16 = ir.Constant(v64, [0] * 64), ir.Constant(v16, [0] * 16)

        def terms(p):
            o = builder.mul(p, ir.Constant(p.type, 2 * size))
            w = values(context, builder, src_ty, src_v, o)
            x = _load(context, builder, xq_ty, xq_v, builder.mul(p, ir.Constant(p.type, 64)), 64)
            d = _pair_scales16(context, builder, src_ty, src_v, o, size, xd_ty, xd_v, p, scale)
            if min_at is None:
                neg = builder.icmp_signed("<", w, zero)
                w, x = builder.select(neg, builder.sub(zero, w), w), builder.select(neg, builder.sub(zero, x), x)
            lanes = _dpbusd(builder, zero16, builder.bitcast(w, v16), builder.bitcast(x, v16), True)
            if min_at is None:
                return [(lanes, d)]
            sums = _dpbusd(builder, zero16, ir.Constant(v16, [0x01010101] * 16), builder.bitcast(x, v16), True)
            return [(lanes, d), (sums, _pair_scales16(context, builder, src_ty, src_v, _at(builder, o, min_at), size,
                                                      xd_ty, xd_v, p))]
        return _float_lanes_row(context, builder, args[3], terms)
    return codegen


def _pair_float_codegen(size, values, scale=None, min_at=None):
    """The codegen of a float row dot over pairs of 32-value blocks of `size` bytes (scale d at byte 0 as in
    _pair_int_codegen), AVX-512BW: values(...) widened to float 16 at a time and multiplied by x, each block's 32
    products scaled once by its d; with a min m at byte min_at, m times x's block sums (xsum32) added; float lanes
    kept across the row (_float_lanes_row)."""
    scale = scale or _half_at

    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v = sig.args[0], args[0], sig.args[1], args[1]
        f32 = ir.FloatType()
        v16i, v16f = ir.VectorType(_I32, 16), ir.VectorType(f32, 16)

        def terms(p):
            o = builder.mul(p, ir.Constant(p.type, 2 * size))
            y = builder.mul(p, ir.Constant(p.type, 64))
            w = values(context, builder, src_ty, src_v, o)
            out = []
            for h in range(2):
                total = None
                for c in range(2):
                    chunk = _shuffle(builder, w, range(32 * h + 16 * c, 32 * h + 16 * c + 16))
                    xv = _load_vec(context, builder, x_ty, x_v, _at(builder, y, 32 * h + 16 * c), f32, 16)
                    part = builder.fmul(builder.sitofp(builder.sext(chunk, v16i), v16f), xv, flags=_FL)
                    total = part if total is None else builder.fadd(total, part, flags=_FL)
                out.append((total, scale(context, builder, src_ty, src_v, _at(builder, o, size * h))))
            if min_at is not None:  # m0 xsum32[2 p], m1 xsum32[2 p + 1] in lanes 0 and 1
                m2 = ir.Constant(ir.VectorType(f32, 2), ir.Undefined)
                for h in range(2):
                    m2 = builder.insert_element(m2, _half_at(context, builder, src_ty, src_v,
                                                             _at(builder, o, min_at + size * h)), ir.Constant(_I32, h))
                xs2 = _load_vec(context, builder, sig.args[2], args[2], builder.mul(p, ir.Constant(p.type, 2)), f32, 2)
                mins = builder.shuffle_vector(builder.fmul(m2, xs2, flags=_FL), ir.Constant(m2.type, [0.0, 0.0]),
                                              _vec_const(32, [0, 1] + [2] * 14))
                out.append((mins, ir.Constant(f32, 1.0)))
            return out
        return _float_lanes_row(context, builder, args[3], terms)
    return codegen


def _pair_dots(size, values, name, scale=None, min_at=None):
    """The integer (Q8_0 activation codes, VNNI) and float (AVX-512BW) row dots over pairs of a 32-value format's
    blocks of `size` bytes: (src, xq, xd, pairs) -> sum over blocks b < 2 pairs of xd[b] (d_b values_b . x_b
    [+ m_b sum x_b]), and (src, x, xsum32, pairs) -> sum of d_b (values_b . x_b) [+ m_b xsum32[b]], x's block sums
    used by the formats with a min only (_pair_int_codegen, _pair_float_codegen)."""
    @intrinsic
    def int_dot(typingctx, src, xq, xd, pairs):
        if not (HAS_VNNI and _byte_array(src) and _byte_array(xq) and _float_array(xd)):
            return None
        return types.float32(src, xq, xd, pairs), _pair_int_codegen(size, values, scale, min_at)

    @intrinsic
    def float_dot(typingctx, src, x, xsum32, pairs):
        if not (HAS_AVX512BW and _byte_array(src) and _float_array(x) and _float_array(xsum32)):
            return None
        return types.float32(src, x, xsum32, pairs), _pair_float_codegen(size, values, scale, min_at)
    int_dot.__name__, float_dot.__name__ = f"fdot_{name}_pairs", f"fdot_{name}_row"
    return int_dot, float_dot


# IQ4_NL and MXFP4: levels by vpshufb; Q4_0, Q5_0: codes - 8, codes - 16; Q4_1, Q5_1: d code + m
fdot_iq4_nl_pairs, fdot_iq4_nl_row = _pair_dots(18, _iq4_nl_pair_values, "iq4_nl")
fdot_mxfp4_pairs, fdot_mxfp4_row = _pair_dots(17, _mxfp4_pair_values, "mxfp4", scale=_e8m0_half_at)
fdot_q4_0_pairs, fdot_q4_0_row = _pair_dots(18, _q4_0_pair_values, "q4_0")
fdot_q5_0_pairs, fdot_q5_0_row = _pair_dots(22, _q5_0_pair_values, "q5_0")
fdot_q4_1_pairs, fdot_q4_1_row = _pair_dots(20, _q4_1_pair_codes, "q4_1", min_at=2)
fdot_q5_1_pairs, fdot_q5_1_row = _pair_dots(24, _q5_1_pair_codes, "q5_1", min_at=2)


@intrinsic
def dequant_q2_32(typingctx, src, qs, shift, dl0, ml0, dl1, ml1, dst, y):
    """dst[y:y+32] = dl * ((src[qs:qs+32] >> shift) & 3) - ml, with (dl0, ml0) for the first 16 values and
    (dl1, ml1) for the next 16 (Q2_K)."""
    if not (_byte_array(src) and _float_array(dst)):
        return None

    def codegen(context, builder, sig, args):
        vf = ir.VectorType(ir.FloatType(), 32)
        q = _load(context, builder, sig.args[0], args[0], args[1], 32)
        codes = builder.uitofp(builder.and_(builder.lshr(q, _splat(builder, args[2], 32)), _vec_const(8, [3] * 32)), vf)
        halves = _vec_const(32, [0] * 16 + [32] * 16)
        dl = builder.shuffle_vector(_splat_f(builder, args[3]), _splat_f(builder, args[5]), halves)
        ml = builder.shuffle_vector(_splat_f(builder, args[4]), _splat_f(builder, args[6]), halves)
        _store(context, builder, sig.args[7], args[7], args[8], builder.fsub(builder.fmul(dl, codes), ml))
        return context.get_dummy_value()
    return types.none(src, qs, shift, types.float32, types.float32, types.float32, types.float32, dst, y), codegen




def _k2_row_codegen(size, codes_at, run_scales, high=None):
    """The codegen of a float row dot over blocks of `size` bytes with Q2_K's code layout (2-bit codes at shifts
    0, 2, 4, 6 of the 32-byte groups at byte codes_at): per run of 16 the weights dl * code - ml formed in vector
    lanes and multiply-added with x, float lanes kept across the row (_float_lanes_row; decoding the row first and
    dotting it had cost 0.26-0.32 ns per weight). run_scales(context, builder, src_ty, src, o) gives dl and ml
    (<16 x float>, one per run); high(context, builder, src_ty, src, o) a function (half, j) -> bits ORed onto
    the codes of shift 2 j, or None."""
    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v = sig.args[0], args[0], sig.args[1], args[1]
        f32 = ir.FloatType()
        v32f = ir.VectorType(f32, 32)

        def terms(b):
            o = builder.mul(b, ir.Constant(b.type, size))
            y = builder.mul(b, ir.Constant(b.type, 256))
            dl, ml = run_scales(context, builder, src_ty, src_v, o)
            bits = None if high is None else high(context, builder, src_ty, src_v, o)
            total = None
            for half in range(2):  # bits 2j..2j+1 of qs byte l (of 32) give weight 128 half + 32 j + l
                q = _load(context, builder, src_ty, src_v, _at(builder, o, codes_at + 32 * half), 32)
                for j in range(4):
                    codes = builder.and_(builder.lshr(q, _vec_const(8, [2 * j] * 32)), _vec_const(8, [3] * 32))
                    if bits is not None:
                        codes = builder.or_(codes, bits(half, j))
                    run = 8 * half + 2 * j
                    lanes = [run] * 16 + [run + 1] * 16
                    w = builder.fsub(builder.fmul(_shuffle(builder, dl, lanes), builder.uitofp(codes, v32f),
                                                  flags=_FL), _shuffle(builder, ml, lanes), flags=_FL)
                    xv = _load_vec(context, builder, x_ty, x_v, _at(builder, y, 128 * half + 32 * j), f32, 32)
                    part = builder.fmul(w, xv, flags=_FL)
                    total = part if total is None else builder.fadd(total, part, flags=_FL)
            return [(_fold16(builder, total), ir.Constant(f32, 1.0))]
        return _float_lanes_row(context, builder, args[2], terms)
    return codegen


def _q2_k_run_scales(context, builder, src_ty, src, o):
    """A Q2_K block's d * (sc & 15) and dmin * (sc >> 4) per run of 16 (one (scale, min) byte each)."""
    v16f = ir.VectorType(ir.FloatType(), 16)
    d, dmin = _half_at(context, builder, src_ty, src, _at(builder, o, 80)), \
        _half_at(context, builder, src_ty, src, _at(builder, o, 82))
    sc = _load(context, builder, src_ty, src, o, 16)
    dl = builder.fmul(_splat_f(builder, d, 16), builder.uitofp(builder.and_(sc, _vec_const(8, [15] * 16)), v16f))
    return dl, builder.fmul(_splat_f(builder, dmin, 16), builder.uitofp(builder.lshr(sc, _vec_const(8, [4] * 16)),
                                                                        v16f))


def _q3_k_run_scales(context, builder, src_ty, src, o):
    """A Q3_K block's d * s and 4 d * s per run of 16 (_q3_k_scales16; the weight is d s (c - 4))."""
    v16f = ir.VectorType(ir.FloatType(), 16)
    dl = builder.fmul(_splat_f(builder, _half_at(context, builder, src_ty, src, _at(builder, o, 108)), 16),
                      builder.sitofp(_q3_k_scales16(context, builder, src_ty, src, o), v16f))
    return dl, builder.fmul(dl, ir.Constant(v16f, [4.0] * 16))


@intrinsic
def fdot_q2_k_row(typingctx, src, x, blocks):
    """sum over the first `blocks` Q2_K blocks (84 bytes) of a row times float32 x: per run of 16 the weights
    (d * (sc & 15)) * code - dmin * (sc >> 4) (_k2_row_codegen)."""
    if not (_byte_array(src) and _float_array(x)):
        return None
    return types.float32(src, x, blocks), _k2_row_codegen(84, 16, _q2_k_run_scales)


@intrinsic
def fdot_q3_k_row(typingctx, src, x, blocks):
    """sum over the first `blocks` Q3_K blocks (110 bytes) of a row times float32 x: per run of 16 the weights
    d s (c - 4), c the 3-bit code (_q3_k_high_bits; _k2_row_codegen)."""
    if not (_byte_array(src) and _float_array(x)):
        return None
    return types.float32(src, x, blocks), _k2_row_codegen(110, 32, _q3_k_run_scales, _q3_k_high_bits)


@intrinsic
def fdot_q2_0_row(typingctx, src, x, blocks):
    """sum over the first `blocks` Q2_0 blocks of a row (18 bytes: fp16 d, then 16 bytes of 2-bit codes, value j
    from bits 2 (j % 4) of byte j // 4) of d * sum (code - 1) * x[64 b + j]: codes spread to 64 lanes by one
    shuffle and a shift per lane, float lanes kept across the row (_float_lanes_row)."""
    if not (_byte_array(src) and _float_array(x)):
        return None

    def codegen(context, builder, sig, args):
        src_ty, src_v, x_ty, x_v = sig.args[0], args[0], sig.args[1], args[1]
        f32 = ir.FloatType()

        def terms(b):
            o = builder.mul(b, ir.Constant(b.type, 18))
            q = _load(context, builder, src_ty, src_v, _at(builder, o, 2), 16)
            spread = builder.shuffle_vector(q, q, _vec_const(32, [j // 4 for j in range(64)]))
            codes = builder.and_(builder.lshr(spread, _vec_const(8, [2 * (j % 4) for j in range(64)])),
                                 _vec_const(8, [3] * 64))
            values = builder.sitofp(builder.sub(codes, _vec_const(8, [1] * 64)), ir.VectorType(f32, 64))
            xv = _load_vec(context, builder, x_ty, x_v, builder.mul(b, ir.Constant(b.type, 64)), f32, 64)
            p = builder.fmul(values, xv, flags=_FL)
            lanes = _fold16(builder, p)
            return [(lanes, _half_at(context, builder, src_ty, src_v, o))]
        return _float_lanes_row(context, builder, args[2], terms)
    return types.float32(src, x, blocks), codegen


def _prefetcher(locality: int):
    """An intrinsic prefetch(src, off, n) asking for the cache lines of src[off:off + n] (a byte array; nothing is
    read or checked) with LLVM's locality hint: 3 into every level (prefetcht0), 2 into the second level and
    beyond (prefetcht1)."""

    @intrinsic
    def prefetch(typingctx, src, off, n):
        if not _byte_array(src):
            return None

        def codegen(context, builder, sig, args):
            i8p = _I8.as_pointer()
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
                                                "llvm.prefetch.p0")
            data = builder.bitcast(_data(context, builder, sig.args[0], args[0]), i8p)
            lines = builder.udiv(builder.add(args[2], ir.Constant(args[2].type, 63)), ir.Constant(args[2].type, 64))
            with cgutils.for_range(builder, lines) as loop:
                line = builder.mul(loop.index, ir.Constant(loop.index.type, 64))
                ptr = builder.gep(data, [builder.add(args[1], line)])
                builder.call(fn, [ptr, ir.Constant(_I32, 0), ir.Constant(_I32, locality), ir.Constant(_I32, 1)])
            return context.get_dummy_value()
        return types.none(src, off, n), codegen
    return prefetch


# The hardware prefetchers stop at each 4 KiB page, so the rows a kernel reaches next are requested ahead. The
# kernels ask into L2 (prefetch_l2): into L1 the requests outnumber its line-fill buffers and stall the kernels'
# own loads (grouped Q8_0 down, 512 experts x 10 tokens: tile decode from RAM 0.19 ns per weight per thread
# asking into L1, 0.094 into L2, 0.046 in cache). The matrix-vector row loops ask into L1 on Intel cores and not at
# all on AMD ones (quant_dispatch.rows_ahead).
prefetch = _prefetcher(3)
prefetch_l2 = _prefetcher(2)


@intrinsic
def load_f16(typingctx, src, off):
    """The fp16 value at byte offset `off` of a byte array, as float32 (one vcvtph2ps; only where HAS_F16C)."""
    if not _byte_array(src):
        return None

    def codegen(context, builder, sig, args):
        return _half_at(context, builder, sig.args[0], args[0], args[1])
    return types.float32(src, off), codegen


@intrinsic
def f32_bits(typingctx, x):
    """The bit pattern of the float32 x, as a uint32 (a register move)."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)
    return types.uint32(x), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the low 32 bits of the integer `bits` (a register move; loops around it
    still vectorize)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        width = args[0].type.width
        bits32 = (builder.trunc(args[0], _I32) if width > 32 else builder.zext(args[0], _I32) if width < 32
                  else args[0])
        return builder.bitcast(bits32, ir.FloatType())
    return types.float32(bits), codegen


# MXCSR bits: flush results that would be subnormal to zero (FTZ, bit 15), read subnormal inputs as zero (DAZ, bit 6).
_FTZ_DAZ = (1 << 15) | (1 << 6)
HAS_MXCSR = platform.machine().lower() in ("x86_64", "amd64")


@intrinsic
def flush_subnormals(typingctx, on):
    """Set this thread's SSE control register to flush subnormal floats to zero (on=True; False clears the two
    bits) or to the value `on` returned by an earlier call (an int), and return the previous value to restore.
    A decay like exp(-100) is subnormal in float32, and every multiply with such a value takes a ~100-cycle
    microcode assist: the DeltaNet rule's decays between far-apart tokens of a chunk ran ~10x slower for it.
    A no-op off x86."""
    if not isinstance(on, (types.Boolean, types.Integer)):
        return None

    def codegen(context, builder, sig, args):
        if not HAS_MXCSR:
            return ir.Constant(ir.IntType(64), 0)
        slot = cgutils.alloca_once(builder, _I32)
        i8p = _I8.as_pointer()
        fnty = ir.FunctionType(ir.VoidType(), [i8p])
        st = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.stmxcsr")
        ld = cgutils.get_or_insert_function(builder.module, fnty, "llvm.x86.sse.ldmxcsr")
        builder.call(st, [builder.bitcast(slot, i8p)])
        old = builder.load(slot)
        if isinstance(sig.args[0], types.Boolean):
            new = builder.select(args[0], builder.or_(old, ir.Constant(_I32, _FTZ_DAZ)),
                                 builder.and_(old, ir.Constant(_I32, ~_FTZ_DAZ & 0xFFFFFFFF)))
        else:
            new = builder.trunc(args[0], _I32)
        builder.store(new, slot)
        builder.call(ld, [builder.bitcast(slot, i8p)])
        return builder.zext(old, ir.IntType(64))
    return types.int64(on), codegen
