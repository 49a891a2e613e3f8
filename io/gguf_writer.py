"""Write GGUF v3 files (and split models the way llama.cpp's gguf-split lays them out).

Everything is checked before the file is opened (value types, tensor sizes against shape and type, names),
so a bad request leaves no half-written file behind. Tensor data is written straight from the caller's
buffers, without copies.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType, Keys

from .ggml_types import GGUFError, tensor_nbytes, type_name
from .gguf_split import SPLIT_COUNT, SPLIT_KEYS, SPLIT_NO, SPLIT_TENSORS_COUNT, shard_path

__all__ = ["write_gguf", "write_gguf_split"]

GGUF_VERSION = 3

# A tensor to write: (name, ggml type, shape in numpy order, raw bytes as bytes/bytearray/memoryview/ndarray).
TensorSpec = tuple[str, int, Sequence[int], Any]

_SCALAR_FORMATS: dict[GGUFValueType, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<B"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
_DTYPE_TYPES: dict[np.dtype, GGUFValueType] = {
    np.dtype(np.uint8): GGUFValueType.UINT8,
    np.dtype(np.int8): GGUFValueType.INT8,
    np.dtype(np.uint16): GGUFValueType.UINT16,
    np.dtype(np.int16): GGUFValueType.INT16,
    np.dtype(np.uint32): GGUFValueType.UINT32,
    np.dtype(np.int32): GGUFValueType.INT32,
    np.dtype(np.float32): GGUFValueType.FLOAT32,
    np.dtype(np.bool_): GGUFValueType.BOOL,
    np.dtype(np.uint64): GGUFValueType.UINT64,
    np.dtype(np.int64): GGUFValueType.INT64,
    np.dtype(np.float64): GGUFValueType.FLOAT64,
}
_TYPE_DTYPES = {t: d.newbyteorder("<") for d, t in _DTYPE_TYPES.items()}
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


def _encode_string(value: str | bytes) -> bytes:
    raw = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return _U64.pack(len(raw)) + raw


def _infer_item_type(key: str, items: Sequence[Any]) -> GGUFValueType:
    if isinstance(items, np.ndarray):
        if items.ndim != 1 or items.dtype not in _DTYPE_TYPES:
            raise GGUFError(f"metadata '{key}': cannot store a {items.ndim}-d {items.dtype} array (1-d numeric only)")
        return _DTYPE_TYPES[items.dtype]
    if not items:
        return GGUFValueType.INT32  # an empty array: any element type reads back as empty
    if all(isinstance(v, (str, bytes)) for v in items):
        return GGUFValueType.STRING
    if all(isinstance(v, (bool, np.bool_)) for v in items):
        return GGUFValueType.BOOL
    if all(isinstance(v, (list, tuple, np.ndarray)) for v in items):
        return GGUFValueType.ARRAY
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in items):
        return GGUFValueType.INT32 if all(-(2**31) <= v < 2**31 for v in items) else GGUFValueType.INT64
    if all(isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) for v in items):
        return GGUFValueType.FLOAT32
    raise GGUFError(f"metadata '{key}': cannot store a list mixing {sorted({type(v).__name__ for v in items})}")


def _infer_scalar_type(key: str, value: Any) -> GGUFValueType:
    if isinstance(value, (str, bytes)):
        return GGUFValueType.STRING
    if isinstance(value, (bool, np.bool_)):
        return GGUFValueType.BOOL
    if isinstance(value, np.generic) and value.dtype in _DTYPE_TYPES:
        return _DTYPE_TYPES[value.dtype]
    if isinstance(value, int):
        return GGUFValueType.UINT32 if 0 <= value < 2**32 else GGUFValueType.INT64
    if isinstance(value, float):
        return GGUFValueType.FLOAT32
    raise GGUFError(f"metadata '{key}': cannot store a value of type {type(value).__name__}")


def _encode_array(key: str, item_type: GGUFValueType, items: Any) -> bytes:
    head = _U32.pack(item_type) + _U64.pack(len(items))
    if item_type == GGUFValueType.STRING:
        if not all(isinstance(v, (str, bytes)) for v in items):
            raise GGUFError(f"metadata '{key}': a STRING array must hold only strings")
        return head + b"".join(_encode_string(v) for v in items)
    if item_type == GGUFValueType.ARRAY:
        return head + b"".join(_encode_array(key, _infer_item_type(key, v), v) for v in items)
    if item_type not in _TYPE_DTYPES:
        raise GGUFError(f"metadata '{key}': {item_type!r} is not an element type")
    values = np.asarray(items)
    if values.ndim != 1 or values.dtype.kind not in "biuf":
        raise GGUFError(f"metadata '{key}': a {item_type.name} array needs a flat list of numbers")
    dtype = _TYPE_DTYPES[item_type]
    if values.size and values.dtype.kind in "iu" and dtype.kind in "iu":
        info = np.iinfo(dtype)
        if values.min() < info.min or values.max() > info.max:
            raise GGUFError(f"metadata '{key}': values outside the range of {item_type.name}")
    return head + values.astype(dtype, copy=False).tobytes()


def _encode_value(key: str, value: Any) -> bytes:
    """Type tag + payload of one metadata value (see write_gguf for the typing rules)."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], GGUFValueType):
        vtype, value = value
        if isinstance(value, (list, tuple, np.ndarray)):
            item_type = _infer_item_type(key, value) if vtype == GGUFValueType.ARRAY else vtype
            return _U32.pack(GGUFValueType.ARRAY) + _encode_array(key, item_type, value)
    elif isinstance(value, (list, tuple, np.ndarray)):
        return _U32.pack(GGUFValueType.ARRAY) + _encode_array(key, _infer_item_type(key, value), value)
    else:
        vtype = _infer_scalar_type(key, value)
    if vtype == GGUFValueType.STRING:
        if not isinstance(value, (str, bytes)):
            raise GGUFError(f"metadata '{key}': STRING value must be str, got {type(value).__name__}")
        return _U32.pack(vtype) + _encode_string(value)
    if vtype == GGUFValueType.ARRAY:
        raise GGUFError(f"metadata '{key}': ARRAY needs a list or 1-d ndarray value")
    try:
        number = float(value) if vtype in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64) else int(value)
        return _U32.pack(vtype) + _SCALAR_FORMATS[vtype].pack(number)
    except (struct.error, TypeError, ValueError) as e:
        raise GGUFError(f"metadata '{key}': cannot store {value!r} as {vtype.name} ({e})") from None


@dataclass
class _Tensor:
    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: memoryview  # flat bytes
    offset: int = 0  # within the data section


def _prepare_tensor(spec: TensorSpec) -> _Tensor:
    name, ggml_type, shape, data = spec
    shape = tuple(int(d) for d in shape)
    if not name or len(name.encode("utf-8")) >= 64:
        raise GGUFError(f"tensor name {name!r} must be 1 to 63 bytes (ggml's limit)")
    if not 1 <= len(shape) <= 4:
        raise GGUFError(f"tensor '{name}': shape {shape} must have 1 to 4 dimensions")
    try:
        nbytes = tensor_nbytes(ggml_type, shape)
    except GGUFError as e:
        raise GGUFError(f"tensor '{name}': {e}") from None
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    view = memoryview(data).cast("B")
    if view.nbytes != nbytes:
        raise GGUFError(
            f"tensor '{name}': {view.nbytes} bytes of data, but {type_name(ggml_type)} {shape} takes {nbytes}"
        )
    return _Tensor(name, int(ggml_type), shape, view)


def _pad(f: BinaryIO, written: int, alignment: int) -> int:
    gap = -written % alignment
    f.write(b"\0" * gap)
    return written + gap


def write_gguf(
    path: str | os.PathLike[str],
    metadata: Mapping[str, Any],
    tensors: Iterable[TensorSpec],
    alignment: int = GGUF_DEFAULT_ALIGNMENT,
) -> None:
    """Write a GGUF v3 file.

    Metadata values are typed as follows: an explicit (GGUFValueType, value) tuple is written as that type
    (for a list or ndarray value the type names the elements; GGUFValueType.ARRAY lets them be inferred);
    otherwise str -> STRING, bool -> BOOL, int -> UINT32 when 0 <= v < 2**32 else INT64, float -> FLOAT32,
    numpy scalars and 1-d ndarrays by their dtype, list[str] -> STRING array, list[bool] -> BOOL array,
    list[int] -> INT32 array (INT64 when a value needs it), list of floats -> FLOAT32 array, list of lists
    -> array of arrays. An alignment other than 32 is recorded as general.alignment.

    tensors: (name, ggml type, shape in numpy order, raw bytes); the byte count must match shape and type.
    """
    if alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: alignment {alignment} is not a power of two")
    items = dict(metadata)
    if Keys.General.ALIGNMENT in items:
        stored = items[Keys.General.ALIGNMENT]
        stored = stored[1] if isinstance(stored, tuple) else stored
        if int(stored) != alignment:
            raise GGUFError(f"{path}: metadata says alignment {stored} but alignment={alignment} was asked for")
    if alignment != GGUF_DEFAULT_ALIGNMENT or Keys.General.ALIGNMENT in items:
        items[Keys.General.ALIGNMENT] = (GGUFValueType.UINT32, alignment)
    try:
        encoded_kv = [_encode_string(key) + _encode_value(key, value) for key, value in items.items()]
        prepared = [_prepare_tensor(spec) for spec in tensors]
    except GGUFError as e:
        raise GGUFError(f"{path}: {e}") from None
    names = [t.name for t in prepared]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise GGUFError(f"{path}: tensor name '{dup}' appears twice")

    table = []
    offset = 0
    for t in prepared:
        t.offset = offset
        offset += -(-t.data.nbytes // alignment) * alignment
        ne = tuple(reversed(t.shape))
        table.append(
            _encode_string(t.name)
            + _U32.pack(len(ne))
            + struct.pack(f"<{len(ne)}q", *ne)
            + _U32.pack(t.ggml_type)
            + _U64.pack(t.offset)
        )

    with open(path, "wb") as f:
        header = _U32.pack(GGUF_MAGIC) + _U32.pack(GGUF_VERSION) + _U64.pack(len(prepared)) + _U64.pack(len(items))
        written = f.write(header)
        for chunk in encoded_kv + table:
            written += f.write(chunk)
        written = _pad(f, written, alignment)
        for t in prepared:
            written = _pad(f, written + f.write(t.data), alignment)


def write_gguf_split(
    prefix: str | os.PathLike[str],
    metadata: Mapping[str, Any],
    tensors: Iterable[TensorSpec],
    max_tensors_per_shard: int,
    alignment: int = GGUF_DEFAULT_ALIGNMENT,
) -> list[Path]:
    """Write a model as shards "<prefix>-0000K-of-0000N.gguf" of at most max_tensors_per_shard tensors each.

    As llama.cpp's gguf-split does: the first shard carries all the metadata, every shard carries split.no
    (UINT16), split.count (UINT16) and split.tensors.count (INT32). A prefix ending in ".gguf" loses that
    extension. split.* keys already in metadata are replaced. Returns the shard paths.
    """
    if max_tensors_per_shard < 1:
        raise GGUFError(f"max_tensors_per_shard must be at least 1, got {max_tensors_per_shard}")
    prefix = str(prefix)
    if prefix.endswith(".gguf"):
        prefix = prefix[: -len(".gguf")]
    specs = list(tensors)
    count = max(1, -(-len(specs) // max_tensors_per_shard))
    if count > 0xFFFF:
        raise GGUFError(f"{prefix}: {count} shards exceed the UINT16 split.count")
    common = {k: v for k, v in metadata.items() if k not in SPLIT_KEYS}
    paths = []
    for i in range(count):
        split_keys = {
            SPLIT_NO: (GGUFValueType.UINT16, i),
            SPLIT_COUNT: (GGUFValueType.UINT16, count),
            SPLIT_TENSORS_COUNT: (GGUFValueType.INT32, len(specs)),
        }
        shard_meta = {**common, **split_keys} if i == 0 else split_keys
        path = shard_path(prefix, i, count)
        write_gguf(path, shard_meta, specs[i * max_tensors_per_shard : (i + 1) * max_tensors_per_shard], alignment)
        paths.append(path)
    return paths
