"""The ggml tensor types a GGUF file may hold: block geometry, names and byte sizes.

The table comes from gguf-py's constants (the same numbers ggml uses) plus Q2_0 (ggml type 42), which
gguf-py does not know yet.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType


class GGUFError(ValueError):
    """A GGUF file (or a request to write one) is malformed; the message names the file and the fault.

    Defined here, the leaf of the io package, because tensor_nbytes raises it too; gguf_reader re-exports it.
    """


# Q2_0: blocks of 64 weights, 18 bytes each: fp16 scale d, then 16 bytes of 2-bit codes (low bits first);
# weight = (code - 1) * d.
Q2_0 = 42
Q2_0_BLOCK = (64, 18)

# ggml type id -> (weights per block, bytes per block), for every type ggml can store in a file.
TYPE_SIZES: dict[int, tuple[int, int]] = {int(t): sizes for t, sizes in GGML_QUANT_SIZES.items()}
if TYPE_SIZES.setdefault(Q2_0, Q2_0_BLOCK) != Q2_0_BLOCK:
    raise ImportError(f"gguf-py describes ggml type {Q2_0} as {TYPE_SIZES[Q2_0]}, expected Q2_0 {Q2_0_BLOCK}")

_TYPE_NAMES: dict[int, str] = {int(t): t.name for t in GGMLQuantizationType}
_TYPE_NAMES.setdefault(Q2_0, "Q2_0")


def type_name(ggml_type: int) -> str:
    """Name of a ggml type as ggml prints it ("F32", "Q4_K", "Q2_0"); GGUFError for an unknown id."""
    try:
        return _TYPE_NAMES[int(ggml_type)]
    except KeyError:
        raise GGUFError(
            f"unknown ggml type {ggml_type}; known types are {sorted(TYPE_SIZES)}"
        ) from None


def tensor_nbytes(ggml_type: int, shape: Sequence[int]) -> int:
    """Bytes a tensor of this type and shape (numpy order, last = row length) occupies.

    Raises GGUFError for an unknown type, a negative dimension, or a row length that is not a whole number
    of blocks (ggml cannot store such a row).
    """
    if int(ggml_type) not in TYPE_SIZES:
        type_name(ggml_type)  # raises with the list of known types
    block_elems, block_bytes = TYPE_SIZES[int(ggml_type)]
    dims = [int(d) for d in shape]
    if any(d < 0 for d in dims):
        raise GGUFError(f"tensor shape {tuple(dims)} has a negative dimension")
    row_len = dims[-1] if dims else 1
    if row_len % block_elems:
        raise GGUFError(
            f"row length {row_len} of shape {tuple(dims)} is not a multiple of the {type_name(ggml_type)} "
            f"block size {block_elems}"
        )
    return math.prod(dims) // block_elems * block_bytes
