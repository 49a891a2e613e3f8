"""Small vector operations written as LLVM IR, for the block dot products (Numba intrinsics).

LLVM does not vectorize the integer dot products of a ggml block as Numba lowers them: every index into
an array is a signed integer with a wraparound select, and the 16/32-value reductions stay scalar (one
movsx/imul/add per weight, ~0.5 ns per weight on a 3 GHz core, a third of what one core reads from RAM).
Each function here loads one run of bytes as a vector, extracts the codes, multiplies them with int8
activations and sums, in one expression the x86 backend lowers to vpmovsx/vpmaddwd (or vpdpbusd where
the CPU has VNNI) and a short horizontal add. The half-float load is one vcvtph2ps instead of a
branchy bit decode; it is exact, as is every integer sum here (|sum| < 2^24).

Arguments are 1-D contiguous uint8/int8 arrays and element offsets into them; nothing is bounds checked
(as Numba's own indexing is not): callers index inside their blocks. Tests compare each function with
numpy on random bytes (tests/test_quant_int.py).
"""

import platform

from llvmlite import binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8 = ir.IntType(8)
_I32 = ir.IntType(32)


def _byte_array(ty) -> bool:
    return (isinstance(ty, types.Array) and ty.ndim == 1 and ty.layout == "C"
            and ty.dtype in (types.uint8, types.int8))


def _pointer(context, builder, ary_ty, ary, off, elem):
    """Pointer to ary[off] as `elem`* (byte arrays only)."""
    data = context.make_array(ary_ty)(context, builder, ary).data
    return builder.bitcast(builder.gep(data, [off]), elem.as_pointer())


def _load(context, builder, ary_ty, ary, off, n):
    vec = ir.VectorType(_I8, n)
    return builder.load(_pointer(context, builder, ary_ty, ary, off, vec), align=1)


def _splat(builder, value, n, width=8):
    """A vector of n copies of an integer scalar (truncated to `width` bits)."""
    ty = ir.IntType(width)
    v = builder.trunc(value, ty) if value.type.width > width else builder.zext(value, ty) \
        if value.type.width < width else value
    vec = ir.VectorType(ty, n)
    undef = ir.Constant(vec, ir.Undefined)
    first = builder.insert_element(undef, v, ir.Constant(_I32, 0))
    return builder.shuffle_vector(first, undef, ir.Constant(ir.VectorType(_I32, n), [0] * n))


def _reduce_dot(builder, codes, signed_codes, x, n):
    """sum(codes * x) in int32: codes <n x i8> (unsigned or signed), x <n x i8> signed."""
    vec32 = ir.VectorType(_I32, n)
    a = builder.sext(codes, vec32) if signed_codes else builder.zext(codes, vec32)
    prod = builder.mul(a, builder.sext(x, vec32))
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_I32, [vec32]),
                                        f"llvm.vector.reduce.add.v{n}i32")
    return builder.call(fn, [prod])


def _make_idot_s8(n):
    @intrinsic
    def idot_s8(typingctx, a, ao, x, xo):
        """sum over i < n of int8(a[ao + i]) * x[xo + i]."""
        if not (_byte_array(a) and _byte_array(x)):
            return None

        def codegen(context, builder, sig, args):
            va = _load(context, builder, sig.args[0], args[0], args[1], n)
            vx = _load(context, builder, sig.args[2], args[2], args[3], n)
            return _reduce_dot(builder, va, True, vx, n)
        return types.int32(a, ao, x, xo), codegen
    return idot_s8


def _make_idot_bits(n):
    @intrinsic
    def idot_bits(typingctx, q, qo, shift, mask, x, xo):
        """sum over i < n of ((q[qo + i] >> shift) & mask) * x[xo + i]: packed 4- or 2-bit codes."""
        if not (_byte_array(q) and _byte_array(x)):
            return None

        def codegen(context, builder, sig, args):
            vq = _load(context, builder, sig.args[0], args[0], args[1], n)
            codes = builder.and_(builder.lshr(vq, _splat(builder, args[2], n)), _splat(builder, args[3], n))
            vx = _load(context, builder, sig.args[4], args[4], args[5], n)
            return _reduce_dot(builder, codes, False, vx, n)
        return types.int32(q, qo, shift, mask, x, xo), codegen
    return idot_bits


def _make_idot_q6(n):
    @intrinsic
    def idot_q6(typingctx, ql, lo, lshift, qh, ho, hshift, x, xo):
        """sum over i < n of (((ql[lo + i] >> lshift) & 15) | (((qh[ho + i] >> hshift) & 3) << 4)) * x[xo + i]:
        Q6_K's 6-bit codes from their low nibble and high 2 bits."""
        if not (_byte_array(ql) and _byte_array(qh) and _byte_array(x)):
            return None

        def codegen(context, builder, sig, args):
            vl = _load(context, builder, sig.args[0], args[0], args[1], n)
            low = builder.and_(builder.lshr(vl, _splat(builder, args[2], n)), ir.Constant(ir.VectorType(_I8, n), 15))
            vh = _load(context, builder, sig.args[3], args[3], args[4], n)
            high = builder.and_(builder.lshr(vh, _splat(builder, args[5], n)), ir.Constant(ir.VectorType(_I8, n), 3))
            codes = builder.or_(low, builder.shl(high, ir.Constant(ir.VectorType(_I8, n), 4)))
            vx = _load(context, builder, sig.args[6], args[6], args[7], n)
            return _reduce_dot(builder, codes, False, vx, n)
        return types.int32(ql, lo, lshift, qh, ho, hshift, x, xo), codegen
    return idot_q6


idot_s8_32 = _make_idot_s8(32)
idot_bits_32 = _make_idot_bits(32)
idot_bits_16 = _make_idot_bits(16)
idot_q6_16 = _make_idot_q6(16)


def _has_f16c() -> bool:
    """Whether LLVM lowers a half -> float conversion to an instruction here (x86 needs F16C; without it
    LLVM would call a runtime helper the JIT may not link)."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return True
    if machine not in ("x86_64", "amd64"):
        return False
    try:
        return bool(llvm.get_host_cpu_features().get("f16c"))
    except Exception:  # noqa: BLE001 - no feature list: callers keep the portable decode
        return False


HAS_F16C = _has_f16c()


@intrinsic
def load_f16(typingctx, src, off):
    """The fp16 value at byte offset `off` of a byte array, as float32 (one vcvtph2ps; only where HAS_F16C)."""
    if not _byte_array(src):
        return None

    def codegen(context, builder, sig, args):
        h = builder.load(_pointer(context, builder, sig.args[0], args[0], args[1], ir.HalfType()), align=1)
        return builder.fpext(h, ir.FloatType())
    return types.float32(src, off), codegen
