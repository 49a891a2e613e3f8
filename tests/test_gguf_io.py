"""GGUF reader/writer against gguf-py (llama.cpp's own Python GGUF library) and llama.cpp's vocabulary files."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
from assets import fresh_rng, llama_cpp_dir
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from strata_async.io import GGUFError, open_gguf, write_gguf, write_gguf_split
from strata_async.io.ggml_types import Q2_0, TYPE_SIZES, tensor_nbytes, type_name

VOCAB_OPEN_LIMIT_S = 1.0


def assert_matches_gguf_py(path: Path, ours) -> None:
    """Every metadata key, value type and tensor of `ours` equals what gguf.GGUFReader reads from `path`."""
    ref = gguf.GGUFReader(path)
    ref_keys = [k for k in ref.fields if not k.startswith("GGUF.")]
    assert list(ours.metadata) == ref_keys
    for key in ref_keys:
        field = ref.fields[key]
        expected, value = field.contents(), ours.metadata[key]
        if field.types == [V.ARRAY]:  # gguf-py records no element type for an empty array
            assert len(value) == 0 and expected == [], key
            continue
        assert ours.metadata_types[key] == field.types[-1], key
        if field.types[0] == V.ARRAY and field.types[-1] != V.STRING:
            assert isinstance(value, np.ndarray), key
            assert value.tolist() == expected, key
        else:
            assert value == expected and type(value) is type(expected), key
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert mine.ggml_type == int(t.tensor_type)
        assert mine.shape == tuple(reversed(t.shape.tolist()))
        assert mine.data.dtype == np.uint8 and mine.data.nbytes == t.n_bytes
        assert mine.data.tobytes() == t.data.tobytes()


# ---------------------------------------------------------------------------------------------------------------
# ggml type table
# ---------------------------------------------------------------------------------------------------------------


def test_type_table_matches_gguf_py_and_adds_q2_0():
    for t, sizes in gguf.GGML_QUANT_SIZES.items():
        assert TYPE_SIZES[int(t)] == sizes
        assert type_name(int(t)) == t.name
    assert Q2_0 == 42 and TYPE_SIZES[42] == (64, 18) and type_name(42) == "Q2_0"
    assert type_name(Q.Q4_K) == "Q4_K"
    with pytest.raises(GGUFError, match="unknown ggml type 77"):
        type_name(77)


def test_tensor_nbytes_matches_gguf_py():
    rng, seed = fresh_rng()
    for t, (block, _) in gguf.GGML_QUANT_SIZES.items():
        shape = tuple(int(d) for d in rng.integers(1, 5, size=rng.integers(1, 4))) + (block * int(rng.integers(1, 4)),)
        expected = int(np.prod(gguf.quant_shape_to_byte_shape(shape, t)))
        assert tensor_nbytes(int(t), shape) == expected, (t.name, shape, seed)
    assert tensor_nbytes(Q2_0, (3, 128)) == 3 * 2 * 18
    with pytest.raises(GGUFError, match="not a multiple of the Q4_K block size 256"):
        tensor_nbytes(Q.Q4_K, (2, 128))
    with pytest.raises(GGUFError, match="not a multiple of the Q2_0 block size 64"):
        tensor_nbytes(Q2_0, (96,))
    with pytest.raises(GGUFError, match="unknown ggml type"):
        tensor_nbytes(1000, (32,))


# ---------------------------------------------------------------------------------------------------------------
# Reading llama.cpp's files
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # gguf.GGUFReader itself needs ~10 s for this file
def test_qwen2_vocab_opens_fast_and_matches_gguf_py():
    path = llama_cpp_dir() / "models" / "ggml-vocab-qwen2.gguf"
    timings = []
    for _ in range(3):
        start = time.perf_counter()
        f = open_gguf(path)
        timings.append(time.perf_counter() - start)
    assert min(timings) < VOCAB_OPEN_LIMIT_S, timings
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 151936
    assert f.metadata["tokenizer.ggml.token_type"].dtype == np.int32
    assert f.version == 3 and f.alignment == 32 and f.tensors == {}
    assert_matches_gguf_py(path, f)


# ---------------------------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------------------------


def random_string(rng: np.random.Generator) -> str:
    alphabet = "abcXYZ 019_.,\n\t'\"éßñ中文字日本語😀🚀Ġ\u200b"
    return "".join(rng.choice(list(alphabet), size=int(rng.integers(0, 12))))


def random_metadata(rng: np.random.Generator) -> dict:
    """Metadata covering every value type, inferred and explicit."""
    ranges = {V.UINT8: (0, 2**8), V.INT8: (-(2**7), 2**7), V.UINT16: (0, 2**16), V.INT16: (-(2**15), 2**15),
              V.UINT32: (0, 2**32), V.INT32: (-(2**31), 2**31), V.UINT64: (0, 2**64), V.INT64: (-(2**63), 2**63)}
    meta: dict = {"general.architecture": "roundtrip", "general.name": random_string(rng)}
    for vtype, (lo, hi) in ranges.items():
        meta[f"explicit.{vtype.name.lower()}"] = (vtype, int(rng.integers(lo, hi, dtype=np.uint64 if lo == 0 else np.int64)))
        dtype = np.dtype(vtype.name.lower())
        meta[f"array.{vtype.name.lower()}"] = rng.integers(lo, hi, size=int(rng.integers(0, 50)), dtype=dtype)
    meta["explicit.float64"] = (V.FLOAT64, float(rng.standard_normal()))
    meta["explicit.float32_array"] = (V.FLOAT32, rng.standard_normal(7).tolist())
    meta["explicit.int64_array"] = (V.INT64, [1, -5, 2**40])
    meta["inferred.uint32"] = int(rng.integers(0, 2**32))
    meta["inferred.int64"] = -int(rng.integers(1, 2**62))
    meta["inferred.float32"] = float(np.float32(rng.standard_normal()))
    meta["inferred.bool"] = bool(rng.integers(0, 2))
    meta["inferred.string"] = random_string(rng)
    meta["inferred.strings"] = [random_string(rng) for _ in range(int(rng.integers(1, 40)))]
    meta["inferred.ints"] = rng.integers(-1000, 1000, size=9).tolist()
    meta["inferred.floats"] = rng.standard_normal(5).tolist()
    meta["inferred.bools"] = [bool(b) for b in rng.integers(0, 2, size=6)]
    meta["array.float32"] = rng.standard_normal(33).astype(np.float32)
    meta["array.float64"] = rng.standard_normal(3)
    return meta


def random_tensors(rng: np.random.Generator, types: list[int]) -> list[tuple]:
    tensors = []
    for i, t in enumerate(types):
        block = TYPE_SIZES[t][0]
        shape = tuple(int(d) for d in rng.integers(1, 4, size=int(rng.integers(0, 3)))) + (block * int(rng.integers(1, 3)),)
        if t == Q.F32:
            data = rng.standard_normal(shape).astype(np.float32)
        elif t == Q.F16:
            data = rng.standard_normal(shape).astype(np.float16)
        else:  # raw blocks: the io layer moves bytes, it does not interpret them
            data = rng.integers(0, 256, size=tensor_nbytes(t, shape), dtype=np.uint8).tobytes()
        tensors.append((f"blk.{i}.weight_{type_name(t).lower()}", t, shape, data))
    return tensors


def raw_bytes(data) -> bytes:
    return data.tobytes() if isinstance(data, np.ndarray) else bytes(data)


def expected_metadata(value):
    """What reading back `value` (as given to write_gguf) must return."""
    if isinstance(value, tuple) and isinstance(value[0], V):
        vtype, value = value
        if isinstance(value, list):
            return np.asarray(value, dtype=np.dtype(vtype.name.lower()))
        return float(np.float32(value)) if vtype == V.FLOAT32 else value
    if isinstance(value, float):
        return float(np.float32(value))
    if isinstance(value, list) and value and not isinstance(value[0], str):
        return np.asarray(value, dtype=np.float32 if isinstance(value[0], float) else None)
    return value


def check_round_trip(path: Path, metadata: dict, tensors: list[tuple]) -> None:
    f = open_gguf(path)
    assert [k for k in f.metadata if k != "general.alignment"] == list(metadata)
    for key, value in metadata.items():
        got, expected = f.metadata[key], expected_metadata(value)
        if isinstance(expected, np.ndarray):
            assert isinstance(got, np.ndarray) and np.array_equal(got, expected), key
        else:
            assert got == expected and type(got) is type(expected), key
        if isinstance(value, tuple):
            assert f.metadata_types[key] == value[0], key
    assert list(f.tensors) == [t[0] for t in tensors]
    for name, t, shape, data in tensors:
        info = f.tensors[name]
        assert (info.ggml_type, info.shape) == (t, shape)
        assert isinstance(info.data, np.memmap) and not info.data.flags.writeable
        assert info.data.tobytes() == raw_bytes(data)
        assert info.n_rows * info.row_bytes == info.data.nbytes
        assert info.n_elements == int(np.prod(shape))
    f.close()


@pytest.mark.parametrize("alignment", [32, 64])
def test_round_trip_against_gguf_py(tmp_path, alignment):
    rng, seed = fresh_rng()
    types = [Q.F32, Q.F16, Q.Q8_0, Q.Q4_K, Q.Q6_K, Q.IQ2_XS, Q.BF16]
    metadata, tensors = random_metadata(rng), random_tensors(rng, types)
    path = tmp_path / "model.gguf"
    write_gguf(path, metadata, tensors, alignment=alignment)
    check_round_trip(path, metadata, tensors)
    ours = open_gguf(path)
    assert ours.alignment == alignment, seed
    assert ours.metadata.get("general.alignment", 32) == alignment
    assert_matches_gguf_py(path, ours)


def test_nested_arrays_round_trip(tmp_path):
    path = tmp_path / "nested.gguf"
    write_gguf(path, {"nested": [[1, 2, 3], ["a", "bé"], []]}, [])
    value = open_gguf(path).metadata["nested"]
    assert value[0].tolist() == [1, 2, 3] and value[1] == ["a", "bé"] and value[2].size == 0


def test_q2_0_tensors_round_trip(tmp_path):
    rng, seed = fresh_rng()
    rows, row_len = int(rng.integers(1, 9)), 64 * int(rng.integers(1, 5))
    blocks = rng.integers(0, 256, size=(rows, row_len // 64 * 18), dtype=np.uint8)
    path = tmp_path / "q2_0.gguf"
    write_gguf(path, {"general.architecture": "q2"}, [("w", Q2_0, (rows, row_len), blocks)])
    info = open_gguf(path).tensors["w"]
    assert info.ggml_type == Q2_0 and info.shape == (rows, row_len), seed
    assert info.row_bytes == row_len // 64 * 18 and info.n_rows == rows
    assert np.array_equal(info.data.reshape(rows, -1), blocks)
    with pytest.raises(GGUFError, match="block size 64"):
        write_gguf(tmp_path / "bad.gguf", {}, [("w", Q2_0, (2, 96), bytes(2 * 27))])


def test_file_written_by_gguf_py_reads_back(tmp_path):
    rng, seed = fresh_rng()
    path = tmp_path / "gguf_py.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_custom_alignment(64)
    writer.add_uint32("llama.block_count", 7)
    writer.add_float32("llama.rope.freq_base", 10000.5)
    writer.add_bool("tokenizer.ggml.add_bos_token", True)
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "中", "😀"])
    writer.add_array("tokenizer.ggml.scores", [0.5, -1.25])
    writer.add_key_value("custom.u16", 65535, V.UINT16)
    f32 = rng.standard_normal((3, 40)).astype(np.float32)
    q4k = rng.integers(0, 256, size=(2, 144 * 2), dtype=np.uint8)
    writer.add_tensor("f32", f32)
    writer.add_tensor("q4k", q4k, raw_dtype=Q.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = open_gguf(path)
    assert ours.alignment == 64
    assert ours.tensors["q4k"].shape == (2, 512), seed
    assert np.array_equal(ours.tensors["f32"].data.view(np.float32).reshape(3, 40), f32)
    assert ours.metadata["tokenizer.ggml.tokens"] == ["<s>", "a", "中", "😀"]
    assert ours.metadata_types["custom.u16"] == V.UINT16
    assert_matches_gguf_py(path, ours)


# ---------------------------------------------------------------------------------------------------------------
# Split models
# ---------------------------------------------------------------------------------------------------------------


def test_split_round_trip(tmp_path):
    rng, seed = fresh_rng()
    metadata = random_metadata(rng)
    tensors = random_tensors(rng, [Q.F32, Q.Q8_0, Q.Q5_K, Q.Q4_K, Q.F16, Q.IQ4_XS, Q.Q6_K])
    paths = write_gguf_split(tmp_path / "model.gguf", metadata, tensors, max_tensors_per_shard=3)
    assert [p.name for p in paths] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    for shard_no, path in enumerate(paths):
        with open_gguf(path) as f:  # any shard opens the whole model
            assert f.shard_paths == paths and f.path == paths[0], seed
            assert list(f.tensors) == [t[0] for t in tensors]
            for name, _, _, data in tensors:
                assert f.tensors[name].data.tobytes() == raw_bytes(data)
            assert f.metadata["general.architecture"] == "roundtrip"
        shard = gguf.GGUFReader(path)  # the split keys are typed as llama.cpp's gguf-split writes them
        assert shard.fields["split.no"].contents() == shard_no and shard.fields["split.no"].types == [V.UINT16]
        assert shard.fields["split.count"].contents() == 3 and shard.fields["split.count"].types == [V.UINT16]
        assert shard.fields["split.tensors.count"].contents() == 7
        assert shard.fields["split.tensors.count"].types == [V.INT32]
        assert ("general.architecture" in shard.fields) == (shard_no == 0)


def test_split_written_by_gguf_py_reads_back(tmp_path):
    rng, seed = fresh_rng()
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama", split_max_tensors=2)
    arrays = {f"t{i}": rng.standard_normal((2, 8 * (i + 1))).astype(np.float32) for i in range(5)}
    for name, array in arrays.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = open_gguf(tmp_path / "m-00002-of-00003.gguf")
    assert len(f.shard_paths) == 3 and f.metadata["general.architecture"] == "llama", seed
    for name, array in arrays.items():
        assert np.array_equal(f.tensors[name].data.view(np.float32).reshape(array.shape), array)


def split_tensors(n: int) -> list[tuple]:
    return [(f"t{i}", int(Q.F32), (4,), np.arange(4, dtype=np.float32) + i) for i in range(n)]


def test_missing_shard_is_named(tmp_path):
    paths = write_gguf_split(tmp_path / "m", {"general.architecture": "x"}, split_tensors(5), 2)
    paths[1].unlink()
    with pytest.raises(GGUFError, match=r"shard 2 of 3 is missing: .*m-00002-of-00003\.gguf"):
        open_gguf(paths[2])


def test_shard_with_wrong_name_or_counts(tmp_path):
    paths = write_gguf_split(tmp_path / "m", {"general.architecture": "x"}, split_tensors(4), 2)
    renamed = tmp_path / "renamed.gguf"
    paths[0].rename(renamed)
    with pytest.raises(GGUFError, match="not named like"):
        open_gguf(renamed)
    renamed.rename(paths[0])

    def shard(i: int, no: int, total: int, tensors: list) -> None:
        keys = {"split.no": (V.UINT16, no), "split.count": (V.UINT16, 2), "split.tensors.count": (V.INT32, total)}
        write_gguf(paths[i], keys, tensors)

    shard(1, 0, 4, split_tensors(4)[2:])
    with pytest.raises(GGUFError, match="expected shard 2 of 2"):
        open_gguf(paths[0])
    shard(1, 1, 5, split_tensors(4)[2:])
    with pytest.raises(GGUFError, match="disagrees with the first shard"):
        open_gguf(paths[0])
    write_gguf(paths[0], {"split.no": (V.UINT16, 0), "split.count": (V.UINT16, 2),
                          "split.tensors.count": (V.INT32, 5)}, split_tensors(2))
    with pytest.raises(GGUFError, match="hold 4 tensors but 'split.tensors.count' says 5"):
        open_gguf(paths[1])
    shard(1, 1, 5, split_tensors(2))
    with pytest.raises(GGUFError, match="tensor 't0' already appears"):
        open_gguf(paths[0])


# ---------------------------------------------------------------------------------------------------------------
# Malformed files
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def sample(tmp_path) -> tuple[Path, bytes]:
    """A small valid file whose last tensor ends exactly at the end of the file."""
    path = tmp_path / "sample.gguf"
    tensors = [("tensor_a", int(Q.Q8_0), (2, 32), bytes(range(68))),
               ("tensor_b", int(Q.F32), (8, 32), np.linspace(-1, 1, 256, dtype=np.float32))]
    write_gguf(path, {"general.architecture": "bad", "key.a": 1, "key.b": 2, "key.s": ["x", "yz"]}, tensors)
    data = path.read_bytes()
    assert len(data) % 32 == 0 and data.endswith(tensors[1][3].tobytes())
    return path, data


def tensor_field(data: bytes, name: bytes, field: str) -> int:
    """Offset of a field in the tensor-table entry of `name` (entry: len, name, n_dims, ne..., type, offset)."""
    start = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, start)[0]
    return {"n_dims": start, "ne0": start + 4, "type": start + 4 + 8 * n_dims, "offset": start + 8 + 8 * n_dims}[field]


def patched(data: bytes, at: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, at, value)
    return bytes(out)


BAD_FILES = {
    "bad magic": (lambda d: b"GGML" + d[4:], "not a GGUF file"),
    "version 1": (lambda d: patched(d, 4, "<I", 1), "unsupported GGUF version 1"),
    "version 4": (lambda d: patched(d, 4, "<I", 4), "unsupported GGUF version 4"),
    "big-endian": (lambda d: patched(d, 4, ">I", 3), "big-endian"),
    "truncated header": (lambda d: d[:13], "truncated header"),
    "truncated metadata": (lambda d: d[: d.index(b"key.s") + 9], "truncated metadata"),
    "truncated tensor table": (lambda d: d[: d.index(b"tensor_b") + 9], "truncated tensor table"),
    "truncated data": (lambda d: d[:-1], r"tensor 'tensor_b' .* the file is truncated"),
    "unknown value type": (lambda d: patched(d, d.index(b"key.a") + 5, "<I", 99), "'key.a' has unknown value type 99"),
    "duplicate key": (lambda d: d.replace(b"key.b", b"key.a"), "duplicate metadata key 'key.a'"),
    "unknown ggml type": (lambda d: patched(d, tensor_field(d, b"tensor_b", "type"), "<I", 99),
                          "tensor 'tensor_b' has unknown ggml type 99"),
    "misaligned offset": (lambda d: patched(d, tensor_field(d, b"tensor_b", "offset"), "<Q", 80 + 8),
                          "offset 88 is not a multiple of the alignment 32"),
    "overlapping tensors": (lambda d: patched(d, tensor_field(d, b"tensor_b", "offset"), "<Q", 64), "overlap"),
    "duplicate tensor name": (lambda d: d.replace(b"tensor_b", b"tensor_a"), "duplicate tensor name 'tensor_a'"),
    "partial block": (lambda d: patched(d, tensor_field(d, b"tensor_a", "ne0"), "<q", 48),
                      "tensor 'tensor_a': row length 48 .* Q8_0 block size 32"),
    "too many dims": (lambda d: patched(d, tensor_field(d, b"tensor_a", "n_dims"), "<I", 5), "5 dimensions"),
    "empty file": (lambda d: b"", "not a GGUF file"),
}


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_bad_file_is_reported(sample, case):
    path, data = sample
    mutate, message = BAD_FILES[case]
    path.write_bytes(mutate(data))
    with pytest.raises(GGUFError, match=message) as err:
        open_gguf(path)
    assert str(path) in str(err.value)


def test_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="cannot read GGUF file"):
        open_gguf(tmp_path / "nope.gguf")


def test_every_truncation_fails_cleanly(sample):
    path, data = sample
    for n in range(len(data)):
        path.write_bytes(data[:n])
        with pytest.raises(GGUFError):
            open_gguf(path)


def test_random_corruption_never_crashes(sample):
    path, data = sample
    rng, seed = fresh_rng()
    meta_end = tensor_field(data, b"tensor_b", "offset") + 8
    for _ in range(400):
        corrupt = bytearray(data)
        for at in rng.integers(0, meta_end, size=int(rng.integers(1, 4))):
            corrupt[at] = int(rng.integers(0, 256))
        path.write_bytes(bytes(corrupt))
        try:
            open_gguf(path).close()
        except GGUFError:
            pass
        except Exception as e:  # noqa: BLE001 - the point of the test
            pytest.fail(f"seed {seed}: {type(e).__name__} escaped the parser: {e}")


# ---------------------------------------------------------------------------------------------------------------
# Writer checks
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metadata, tensors, message",
    [
        ({}, [("w", int(Q.F32), (2, 4), bytes(31))], "31 bytes of data, but F32 \\(2, 4\\) takes 32"),
        ({}, [("w", int(Q.Q4_K), (2, 128), bytes(144))], "not a multiple of the Q4_K block size 256"),
        ({}, [("w", 99, (32,), bytes(4))], "unknown ggml type 99"),
        ({}, [("w", 0, (1,), bytes(4)), ("w", 0, (1,), bytes(4))], "tensor name 'w' appears twice"),
        ({}, [("x" * 64, 0, (1,), bytes(4))], "1 to 63 bytes"),
        ({"k": object()}, [], "cannot store a value of type object"),
        ({"k": [1, "a"]}, [], "mixing"),
        ({"k": (V.UINT8, 300)}, [], "cannot store 300 as UINT8"),
        ({"k": (V.INT8, [1, 200])}, [], "outside the range of INT8"),
        ({"k": np.zeros((2, 2))}, [], "1-d"),
        ({"general.alignment": 64}, [], "alignment 64 but alignment=32"),
    ],
)
def test_writer_rejects_bad_requests(tmp_path, metadata, tensors, message):
    path = tmp_path / "out.gguf"
    with pytest.raises(GGUFError, match=message):
        write_gguf(path, metadata, tensors)
    assert not path.exists()


def test_writer_inferred_types(tmp_path):
    path = tmp_path / "types.gguf"
    write_gguf(path, {"u32": 2**32 - 1, "i64": 2**32, "neg": -1, "f": 0.1, "b": False, "s": "x",
                      "ints": [1, 2], "bigints": [2**31], "i64arr": np.array([3], dtype=np.int64),
                      "floats": [1, 2.5], "bools": [True], "strs": ["a"], "explicit": (V.ARRAY, ["x"]),
                      "u8s": (V.UINT8, [1, 255])}, [])
    f = open_gguf(path)
    types = f.metadata_types
    assert f.metadata["u8s"].dtype == np.uint8 and f.metadata["explicit"] == ["x"]
    assert types == {"u32": V.UINT32, "i64": V.INT64, "neg": V.INT64, "f": V.FLOAT32, "b": V.BOOL, "s": V.STRING,
                     "ints": V.INT32, "bigints": V.INT64, "i64arr": V.INT64, "floats": V.FLOAT32, "bools": V.BOOL,
                     "strs": V.STRING, "explicit": V.STRING, "u8s": V.UINT8}


def _resident_bytes_of(path: Path) -> int:
    """Bytes of `path` mapped into this process and resident in its page tables (Linux /proc/self/smaps)."""
    total, current = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if fields and "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
            current = line.rstrip().endswith(str(path))
        elif current and line.startswith("Rss:"):
            total += int(fields[1]) * 1024
    return total


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
@pytest.mark.parametrize("madvise", [True, False], ids=["madvise", "touch"])
def test_prefault_maps_the_tensor_pages(tmp_path, monkeypatch, madvise):
    """prefault maps the pages of the tensors it is given into the file's mapping, and only those: with
    MADV_POPULATE_READ, and where the kernel lacks it (the call fails), by reading one byte per page."""
    from strata_async.io import gguf_reader, prefault

    if not madvise:
        monkeypatch.setattr(gguf_reader, "_MADV_POPULATE_READ", -1)  # EINVAL, as on a kernel before 5.14
    path = tmp_path / "model.gguf"
    mib = 1 << 20
    tensors = [(name, Q.F32, (mib,), np.ones(mib, np.float32)) for name in ("wanted", "left")]  # 4 MiB each
    write_gguf(path, {"general.architecture": "roundtrip"}, tensors)
    with open_gguf(path) as f:
        before = _resident_bytes_of(path)
        seen = []
        prefault([f.tensors["wanted"]], progress=lambda done, total: seen.append((done, total)))
        grown = _resident_bytes_of(path) - before
        assert 4 * mib <= grown < 6 * mib  # the tensor's pages (fault-around may add a few neighbours)
        assert seen == [(4 * mib, 4 * mib)]
        assert f.tensors["left"].data.view(np.float32).sum() == mib  # the data reads back unchanged


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="needs Linux's /proc/self/smaps")
def test_load_prefaults_the_weights_unless_lazy(qwen3moe_f32_gguf):
    """load_runtime maps in every page the model computes from (LoadOptions.prefault, the default);
    prefault=False leaves them to fault on first use."""
    import gc

    from strata_async.runtime import LoadOptions, load_runtime

    path = Path(qwen3moe_f32_gguf)
    lazy = load_runtime(path, options=LoadOptions(prefault=False))  # never copies onto huge pages
    lazy_resident = _resident_bytes_of(path)
    weights = sum(info.data.nbytes for info in lazy.gguf.tensors.values())
    lazy.close()
    del lazy
    gc.collect()
    seen = []
    eager = load_runtime(path, options=LoadOptions(progress=lambda done, total: seen.append((done, total)),
                                                   huge_pages="never"))  # the mapping, not copies, holds them
    try:
        assert _resident_bytes_of(path) >= 0.95 * weights
        assert lazy_resident < 0.5 * weights
        assert seen and seen[-1][0] == seen[-1][1] >= 0.95 * weights
    finally:
        eager.close()
