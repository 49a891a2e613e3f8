"""Read GGUF v2/v3 files: header, metadata, tensor table; tensor data stays memory-mapped.

The whole file is mapped once, read-only. Metadata is parsed straight out of the mapping with struct and
np.frombuffer (a 150k-token vocabulary opens in a fraction of a second), and every tensor's data is a uint8
view of exactly its bytes in that mapping: nothing is copied. A model split over several files
(name-00001-of-00003.gguf ...) opens as one GGUFFile from any of its shards.

Malformed files raise GGUFError naming the file and the fault; nothing else escapes the parser.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGUF_DEFAULT_ALIGNMENT, GGUF_MAGIC, GGUFValueType, Keys

from .ggml_types import TYPE_SIZES, GGUFError, tensor_nbytes, type_name
from .gguf_split import SPLIT_COUNT, SPLIT_NO, SPLIT_TENSORS_COUNT, shard_path, shard_prefix

__all__ = ["GGUFError", "GGUFFile", "TensorInfo", "open_gguf"]

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS: ggml refuses tensors with more dimensions

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")

# Numeric value types: the struct format of one scalar and the numpy dtype of an array of them.
_NUMERIC: dict[GGUFValueType, tuple[struct.Struct, np.dtype]] = {
    GGUFValueType.UINT8: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.INT8: (struct.Struct("<b"), np.dtype("<i1")),
    GGUFValueType.UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    GGUFValueType.INT16: (struct.Struct("<h"), np.dtype("<i2")),
    GGUFValueType.UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    GGUFValueType.INT32: (struct.Struct("<i"), np.dtype("<i4")),
    GGUFValueType.FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    GGUFValueType.BOOL: (struct.Struct("<B"), np.dtype("<u1")),
    GGUFValueType.UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    GGUFValueType.INT64: (struct.Struct("<q"), np.dtype("<i8")),
    GGUFValueType.FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
_VALUE_TYPES = {int(t): t for t in GGUFValueType}


@dataclass
class TensorInfo:
    """One tensor: name, ggml type, shape in numpy order (GGUF's ne reversed) and its bytes in the file."""

    name: str
    ggml_type: int
    shape: tuple[int, ...]
    data: np.ndarray  # read-only uint8 memmap of exactly this tensor's bytes
    file_path: Path | None = None  # the file (shard) holding the bytes
    file_offset: int = 0  # absolute byte offset of the data in file_path (for unbuffered reads of its rows)

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def row_len(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.row_len if self.row_len else 0

    @property
    def row_bytes(self) -> int:
        block_elems, block_bytes = TYPE_SIZES[self.ggml_type]
        return self.row_len // block_elems * block_bytes


_MADV_POPULATE_READ = 22  # Linux 5.14+: fault a range of a mapping in with one call (mmap lacks the name)
_PAGE = mmap.PAGESIZE


def prefault(tensors: Iterable[TensorInfo], progress: Callable[[int, int], None] | None = None) -> None:
    """Map every page of these tensors into this process now, reading from the drive what the page cache
    lacks (as llama.cpp maps its weights with MAP_POPULATE). Otherwise each page faults on its first use:
    ~1-4 ms per decoded token and layer while the routed experts are still new, for thousands of tokens.
    progress(done_bytes, total_bytes) is called as it goes. Where madvise cannot, one byte per page is read.
    """
    tensors = [t for t in tensors if t.data.size]
    total = sum(t.data.nbytes for t in tensors)
    done = 0
    for t in tensors:
        whole_file = getattr(t.data, "_mmap", None)  # the file's mapping, from offset 0 (_parse_mapping)
        try:
            if whole_file is None:
                raise OSError("not a file mapping")
            first = t.file_offset // _PAGE * _PAGE
            whole_file.madvise(_MADV_POPULATE_READ, first, t.file_offset + t.data.nbytes - first)
        except (OSError, ValueError, AttributeError):
            int(np.asarray(t.data).reshape(-1)[::_PAGE].sum())
        done += t.data.nbytes
        if progress is not None:
            progress(done, total)


def release(tensor: TensorInfo) -> None:
    """Drop the tensor's whole pages from this process's mapping (madvise MADV_DONTNEED), once its bytes are copied
    elsewhere (a repacked tensor): they are clean file pages, so nothing is lost, the page cache may keep them
    and a later read faults them in again. Pages shared with a neighbouring tensor stay. Where madvise cannot,
    nothing happens."""
    whole_file = getattr(tensor.data, "_mmap", None)
    first = -(-tensor.file_offset // _PAGE) * _PAGE
    end = (tensor.file_offset + tensor.data.nbytes) // _PAGE * _PAGE
    if whole_file is None or end <= first:
        return
    try:
        whole_file.madvise(mmap.MADV_DONTNEED, first, end - first)
    except (OSError, ValueError, AttributeError):
        pass


@dataclass
class GGUFFile:
    """An opened GGUF model (one file or all shards of a split model).

    metadata maps each key to str/int/float/bool, list[str] for string arrays, np.ndarray for numeric and
    bool arrays (a list for arrays of arrays). metadata_types gives each key's GGUF value type (for an array,
    the type of its elements), so a file can be rewritten with the same types. Of a split model, path,
    version, alignment and metadata are those of the first shard.
    """

    path: Path
    version: int
    alignment: int
    metadata: dict[str, Any]
    metadata_types: dict[str, GGUFValueType]
    tensors: dict[str, TensorInfo]
    shard_paths: list[Path] = field(default_factory=list)
    # The file mappings; dropped by close(). Tensor views handed out earlier stay valid (they keep their
    # mapping alive) until the caller lets go of them too.
    _maps: list[np.memmap] = field(default_factory=list, repr=False)

    def close(self) -> None:
        self._maps.clear()
        self.tensors = {}

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Parser:
    """Reads one GGUF file's header, metadata and tensor table out of its mapping, checking every bound."""

    def __init__(self, path: Path, buf: mmap.mmap):
        self.path = path
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.section = "header"  # named in "truncated ..." errors

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path}: {what}")

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > self.size:
            raise self.fail(
                f"truncated {self.section}: {n} more bytes needed at offset {self.pos} but the file has "
                f"{self.size} bytes (incomplete download or copy?)"
            )

    def unpack(self, fmt: struct.Struct) -> Any:
        self.need(fmt.size)
        value = fmt.unpack_from(self.buf, self.pos)[0]
        self.pos += fmt.size
        return value

    def string(self) -> str:
        n = self.unpack(_U64)
        self.need(n)
        start = self.pos
        self.pos += n
        try:
            return self.buf[start : self.pos].decode("utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(f"string at offset {start} in the {self.section} is not valid UTF-8 ({e})") from None

    def scalar(self, vtype: GGUFValueType) -> Any:
        """A string, number or bool value."""
        if vtype == GGUFValueType.STRING:
            return self.string()
        fmt, _ = _NUMERIC[vtype]
        value = self.unpack(fmt)
        return bool(value) if vtype == GGUFValueType.BOOL else value

    def value_type(self, key: str) -> GGUFValueType:
        raw = self.unpack(_U32)
        if raw not in _VALUE_TYPES:
            raise self.fail(f"metadata key '{key}' has unknown value type {raw}")
        return _VALUE_TYPES[raw]

    def array(self, key: str) -> tuple[GGUFValueType, Any]:
        """An array value: (element type, list[str] | np.ndarray | list of nested arrays)."""
        item_type = self.value_type(key)
        count = self.unpack(_U64)
        if item_type == GGUFValueType.STRING:
            return item_type, self.string_array(count)
        if item_type == GGUFValueType.ARRAY:
            return item_type, [self.array(key)[1] for _ in range(count)]
        _, dtype = _NUMERIC[item_type]
        self.need(count * dtype.itemsize)
        # A copy: small next to the tensors, and it keeps metadata valid after close().
        values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
        self.pos += count * dtype.itemsize
        return item_type, (values != 0 if item_type == GGUFValueType.BOOL else values)

    def string_array(self, count: int) -> list[str]:
        # The hot loop of opening a model (150k vocabulary tokens + 150k merges): kept to local names.
        buf, size, pos = self.buf, self.size, self.pos
        if count * 8 > size - pos:
            self.need(count * 8)
        unpack_len = _U64.unpack_from
        out: list[str] = [""] * count
        try:
            for i in range(count):
                start = pos + 8
                pos = start + unpack_len(buf, pos)[0]
                if pos > size:
                    break
                out[i] = buf[start:pos].decode("utf-8")
            else:
                self.pos = pos
                return out
        except struct.error:
            pass  # the length field itself ran past the end of the file
        except UnicodeDecodeError as e:
            raise self.fail(f"string in the {self.section} is not valid UTF-8 ({e})") from None
        raise self.fail(f"truncated {self.section}: a string array runs past the end of the file ({size} bytes)")


def _parse_file(path: Path) -> GGUFFile:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 4:
                raise GGUFError(f"{path}: not a GGUF file (only {size} bytes)")
            # Parsed through a plain mmap (its slices are bytes: the fastest way to decode 300k strings);
            # the tensors get their own np.memmap, which outlives this one.
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse_mapping(path, buf)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read GGUF file ({e.strerror or e})") from None


def _parse_mapping(path: Path, buf: mmap.mmap) -> GGUFFile:
    p = _Parser(path, buf)
    magic = p.unpack(_U32)
    if magic != GGUF_MAGIC:
        raise p.fail(f"not a GGUF file (starts with {bytes(buf[:4])!r}, expected b'GGUF')")
    version = p.unpack(_U32)
    if version not in SUPPORTED_VERSIONS:
        hint = " (big-endian file?)" if version & 0xFFFF == 0 else ""
        raise p.fail(f"unsupported GGUF version {version}{hint}; this reader supports versions 2 and 3")
    n_tensors = p.unpack(_U64)
    n_kv = p.unpack(_U64)

    p.section = "metadata"
    metadata: dict[str, Any] = {}
    types: dict[str, GGUFValueType] = {}
    for _ in range(n_kv):
        key = p.string()
        if key in metadata:
            raise p.fail(f"duplicate metadata key '{key}'")
        vtype = p.value_type(key)
        if vtype == GGUFValueType.ARRAY:
            types[key], metadata[key] = p.array(key)
        else:
            types[key], metadata[key] = vtype, p.scalar(vtype)

    alignment = metadata.get(Keys.General.ALIGNMENT, GGUF_DEFAULT_ALIGNMENT)
    if Keys.General.ALIGNMENT in metadata and types[Keys.General.ALIGNMENT] != GGUFValueType.UINT32:
        raise p.fail(f"'{Keys.General.ALIGNMENT}' must be a UINT32, not {types[Keys.General.ALIGNMENT].name}")
    if alignment <= 0 or alignment & (alignment - 1):
        raise p.fail(f"alignment {alignment} is not a power of two")

    p.section = "tensor table"
    table = []
    for _ in range(n_tensors):
        name = p.string()
        n_dims = p.unpack(_U32)
        if n_dims > MAX_DIMS:
            raise p.fail(f"tensor '{name}' has {n_dims} dimensions; ggml supports at most {MAX_DIMS}")
        ne = [p.unpack(_I64) for _ in range(n_dims)]
        ggml_type = p.unpack(_U32)
        offset = p.unpack(_U64)
        table.append((name, ne, ggml_type, offset))

    data_start = -(-p.pos // alignment) * alignment
    mapping = np.memmap(path, dtype=np.uint8, mode="r") if table else None
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, ne, ggml_type, offset in table:
        if name in tensors:
            raise p.fail(f"duplicate tensor name '{name}'")
        if any(d < 0 for d in ne):
            raise p.fail(f"tensor '{name}' has a negative dimension in {ne}")
        if ggml_type not in TYPE_SIZES:
            raise p.fail(f"tensor '{name}' has unknown ggml type {ggml_type}")
        shape = tuple(reversed(ne))
        try:
            nbytes = tensor_nbytes(ggml_type, shape)
        except GGUFError as e:
            raise p.fail(f"tensor '{name}': {e}") from None
        if offset % alignment:
            raise p.fail(f"tensor '{name}' data offset {offset} is not a multiple of the alignment {alignment}")
        start = data_start + offset
        if start + nbytes > p.size:
            raise p.fail(
                f"tensor '{name}' ({type_name(ggml_type)} {shape}) needs bytes {start}..{start + nbytes} but the "
                f"file ends at {p.size}: the file is truncated"
            )
        spans.append((offset, offset + nbytes, name))
        tensors[name] = TensorInfo(name, ggml_type, shape, mapping[start : start + nbytes], path, start)
    spans.sort()
    for (_, end, first), (next_start, _, second) in zip(spans, spans[1:]):
        if next_start < end:
            raise p.fail(f"tensors '{first}' and '{second}' overlap in the data section")

    return GGUFFile(path, version, alignment, metadata, types, tensors, [path], [mapping] if table else [])


def open_gguf(path: str | os.PathLike[str]) -> GGUFFile:
    """Open a GGUF file; for one shard of a split model, open all its shards and merge their tensors."""
    path = Path(path)
    first = _parse_file(path)
    count = _split_number(first, SPLIT_COUNT, default=1)
    if count <= 1:
        return first
    index = _split_number(first, SPLIT_NO, default=None)
    if index >= count:
        raise GGUFError(f"{path}: '{SPLIT_NO}' = {index} but the model has only {count} shards")
    prefix = shard_prefix(path, index, count)
    if prefix is None:
        raise GGUFError(
            f"{path}: is shard {index + 1} of {count} but is not named like '<name>-{index + 1:05d}-of-"
            f"{count:05d}.gguf', so its sibling shards cannot be found"
        )
    shards: list[GGUFFile] = []
    for i in range(count):
        if i == index:
            shards.append(first)
            continue
        sibling = shard_path(prefix, i, count)
        if not sibling.exists():
            raise GGUFError(f"{path}: shard {i + 1} of {count} is missing: {sibling} does not exist")
        shards.append(_parse_file(sibling))
    return _merge_shards(shards, count)


def _split_number(f: GGUFFile, key: str, default: int | None) -> int:
    value = f.metadata.get(key, default)
    if value is None:
        raise GGUFError(f"{f.path}: is part of a split model ('{SPLIT_COUNT}' > 1) but has no '{key}'")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise GGUFError(f"{f.path}: '{key}' must be a non-negative integer, not {value!r}")
    return value


def _merge_shards(shards: list[GGUFFile], count: int) -> GGUFFile:
    expected_total = shards[0].metadata.get(SPLIT_TENSORS_COUNT)
    tensors: dict[str, TensorInfo] = {}
    for i, shard in enumerate(shards):
        meta = shard.metadata
        if meta.get(SPLIT_NO) != i or meta.get(SPLIT_COUNT) != count:
            raise GGUFError(
                f"{shard.path}: expected shard {i + 1} of {count}, but its metadata says "
                f"'{SPLIT_NO}' = {meta.get(SPLIT_NO)}, '{SPLIT_COUNT}' = {meta.get(SPLIT_COUNT)}"
            )
        if meta.get(SPLIT_TENSORS_COUNT) != expected_total:
            raise GGUFError(
                f"{shard.path}: '{SPLIT_TENSORS_COUNT}' = {meta.get(SPLIT_TENSORS_COUNT)} disagrees with the "
                f"first shard's {expected_total}"
            )
        for name, info in shard.tensors.items():
            if name in tensors:
                raise GGUFError(f"{shard.path}: tensor '{name}' already appears in an earlier shard")
            tensors[name] = info
    if expected_total is not None and len(tensors) != expected_total:
        raise GGUFError(
            f"{shards[0].path}: the {count} shards hold {len(tensors)} tensors but '{SPLIT_TENSORS_COUNT}' "
            f"says {expected_total}"
        )
    head = shards[0]
    return GGUFFile(
        head.path,
        head.version,
        head.alignment,
        head.metadata,
        head.metadata_types,
        tensors,
        [s.path for s in shards],
        [m for s in shards for m in s._maps],
    )
