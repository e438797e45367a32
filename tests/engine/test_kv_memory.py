"""A CPU KV cache takes resident memory only for the blocks that were written: its
memory is an anonymous mapping (kv_memory.py), read from /proc/self/smaps here."""

from __future__ import annotations

import gc

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.kv_memory import host_available_bytes, host_memory_check, zeroed_kv_tensor
from tests.engine.helpers import assert_all_blocks_free


def _resident_kb(t: torch.Tensor) -> int:
    """Rss of the mapping that holds t's first byte."""
    address = t.data_ptr()
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                start, end = (int(x, 16) for x in head.split("-"))
                inside = start <= address < end
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds the tensor")


def test_zeroed_until_written_and_resident_only_where_written():
    shape = (1024, 4, 2, 2, 16, 64)  # 1024 blocks of 64 KiB in fp32: 64 MiB
    kv = zeroed_kv_tensor(shape, torch.float32, "cpu")
    gc.collect()  # the mapping lives as long as the tensor
    assert kv.shape == shape and kv.dtype == torch.float32 and kv.is_contiguous()
    assert _resident_kb(kv) < 64
    kv[3].fill_(2.5)
    kv[900, 1, 0, 1, 5, 7] = -1.0
    # block 3 and a page of block 900: two 2 MiB huge pages at most, where THP is on
    assert 64 <= _resident_kb(kv) <= 4 * 1024
    # (reads are left until here: this kernel counts read-mapped zero pages in Rss)
    assert kv[3].eq(2.5).all() and kv[900, 1, 0, 1, 5, 7] == -1.0
    assert kv.sum() == 2.5 * kv[3].numel() - 1.0
    assert kv[4:900].eq(0).all()


def test_fp8_and_empty():
    kv = zeroed_kv_tensor((8, 2, 1, 2, 16, 32), torch.float8_e4m3fn, "cpu")
    kv[1] = 1.0
    assert kv.float().sum() == kv[1].numel()
    assert zeroed_kv_tensor((0, 2, 1, 2, 16, 32), torch.bfloat16, "cpu").numel() == 0


def test_engine_kv_cache_resident_only_for_used_blocks(model):
    # a fresh engine: the shared one has written blocks all over its cache by now
    llm = LLM(model)
    kv = llm.engine.runner.kv_cache
    total_kb = kv.numel() * kv.element_size() // 1024
    assert total_kb >= 256 * 1024  # the 1 GiB CPU default, or near it
    try:
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
        assert len(out[0].output.token_ids) == 8
        assert 0 < _resident_kb(kv) < total_kb // 8
        assert_all_blocks_free(llm)
    finally:
        llm.close()


def test_cache_larger_than_the_host_is_refused_at_start(model):
    available = host_available_bytes()
    assert available is not None and available > 0  # Linux: /proc/meminfo
    block = 30 * 2 * 16 * 3 * 64 * 4  # the default model's block in fp32
    too_many = 2 * available // block + 1
    with pytest.raises(ValueError, match=r"--num-kv-blocks / --kv-cache-memory-gb"):
        LLM(model, num_kv_blocks=too_many)
    with pytest.raises(ValueError, match=r"GiB available"):
        host_memory_check(available + (1 << 30), 7)
    host_memory_check(1 << 20, 1)
