"""Weights copied at load into memory on transparent huge pages (runtime/host_memory.py, runtime/weights.py)."""

import mmap
import platform

import numpy as np
import pytest
from parity import prompt_then_tokens

from strata_async.io import open_gguf
from strata_async.runtime import LoadOptions, host_memory, load_runtime, weights
from strata_async.runtime.host_memory import HUGE_PAGE, huge_page_array, huge_pages_advisable
from strata_async.runtime.weights import ROW_TABLES, QTensor

PROMPT = np.array([3, 141, 59, 26, 53, 58, 97, 93, 23, 84, 62, 64, 33])


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside, flags = False, None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(a, 16) for a in head.split("-"))
                inside = start <= address < end
            elif inside and head == "VmFlags:":
                flags = line.split()[1:]
    assert flags is not None, f"no mapping holds {address:#x}"
    return flags


def test_huge_page_array_is_aligned_writable_and_advised():
    a = huge_page_array((3, 1 << 20))
    assert a.shape == (3, 1 << 20) and a.dtype == np.uint8 and a.flags.c_contiguous and a.flags.writeable
    assert a.ctypes.data % HUGE_PAGE == 0
    a[...] = 7
    assert int(a.sum(dtype=np.int64)) == 7 * a.size
    if huge_pages_advisable():
        assert "hg" in _vm_flags(a.ctypes.data)  # MADV_HUGEPAGE on the whole mapping
    empty = huge_page_array((0, 16))
    assert empty.shape == (0, 16)


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or platform.system() != "Linux", reason="Linux's madvise")
def test_huge_pages_are_advisable_unless_the_system_says_never(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    monkeypatch.setattr(host_memory, "THP_SETTING", str(setting))
    for text, advisable in (("always [madvise] never", True), ("[always] madvise never", True),
                            ("always madvise [never]", False)):
        setting.write_text(text + "\n")
        assert host_memory.huge_pages_advisable() is advisable, text
    setting.unlink()  # a kernel without transparent huge pages has no such file
    assert host_memory.huge_pages_advisable() is False


def _tensors(obj, seen=None) -> list[QTensor]:
    """Every QTensor reachable from a model object."""
    seen = set() if seen is None else seen
    if id(obj) in seen or isinstance(obj, (np.ndarray, str, int, float, bytes)) or obj is None:
        return []
    seen.add(id(obj))
    if isinstance(obj, QTensor):
        return [obj]
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else (
        vars(obj).values() if hasattr(obj, "__dict__") else ())
    return [t for v in items for t in _tensors(v, seen)]


@pytest.mark.parametrize("qtype", ["Q4_K_M", "Q8_0"])
def test_huge_page_copies_compute_what_the_mapping_does(quantized, monkeypatch, qtype):
    """A qwen3next loaded with its matrices copied onto huge pages and as mapped: every copy holds the file's bytes
    in memory of its own, and the logits of a prompt and decoded tokens agree to the last bit, float and int8."""
    path = quantized("qwen3next_kquant", qtype)
    monkeypatch.setattr(weights, "HUGE_PAGE", 1)  # copy every matrix, however small: the test model's are
    with open_gguf(path) as f:
        file_bytes = {name: np.asarray(t.data).reshape(-1) for name, t in f.tensors.items()}
        for int8 in (False, True):
            logits = {}
            for mode in ("always", "never"):
                rt = load_runtime(path, quantized_activations=int8, options=LoadOptions(huge_pages=mode))
                held = [t for t in _tensors(rt.model) if t.name in file_bytes]
                copied = [t for t in held if not np.shares_memory(t.data, rt.gguf.tensors[t.name].data)]
                if mode == "never":
                    assert not copied
                else:
                    assert {t.name for t in copied} == {t.name for t in held} - ROW_TABLES and copied
                    for t in copied:
                        assert t.data.ctypes.data % HUGE_PAGE == 0
                        np.testing.assert_array_equal(t.data.reshape(-1), file_bytes[t.name])
                logits[mode] = prompt_then_tokens(rt, PROMPT)
            assert np.isfinite(logits["never"]).all() and np.ptp(logits["never"]) > 0
            np.testing.assert_array_equal(logits["always"], logits["never"])


def test_huge_page_policy(qwen3next_f32_gguf):
    with open_gguf(qwen3next_f32_gguf) as f:
        size = weights.held_bytes(f, False)
        copies = weights.copies_to_huge_pages
        assert copies(f, "never", False, ram=1 << 40) is False
        assert copies(f, "always", False, ram=1) is True
        assert copies(f, "auto", False, ram=int(size / 0.8) + 1) is huge_pages_advisable()
        assert copies(f, "auto", False, ram=int(size / 0.8) - 1) is False
        assert copies(f, "auto", False, prefault=False, ram=1 << 40) is False  # lazily mapped weights stay mapped
        with pytest.raises(ValueError, match="lazily mapped"):
            copies(f, "always", False, prefault=False)
        with pytest.raises(ValueError, match="auto, always, never"):
            copies(f, "yes", False)


def test_huge_pages_choices_are_the_weight_store_modes():
    from strata_async.cli import HUGE_PAGE_MODES

    assert HUGE_PAGE_MODES == weights.HUGE_PAGE_MODES
