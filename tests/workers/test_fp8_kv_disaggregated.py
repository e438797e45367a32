"""FP8 KV acceptance (issue 14, item 2) through real worker processes on loopback over
Mooncake TCP: prefill and decode workers with an FP8 KV cache equal the colocated
FP8-KV engine token for token and move a quarter of the fp32 bytes (half of bf16's); a
pair whose KV dtypes differ is refused at the handshake with FAILED_PRECONDITION naming
the field, and a request sent through it gets that error (no hang, no silent local
recompute); every block is free again afterwards."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdpb.v1 import decode_pb2, decode_pb2_grpc
from services.engine import LLM, SamplingParams
from tests.workers.procs import start_worker
from tests.workers.test_disaggregated import generate

BLOCK = 16
FP8_BLOCK_BYTES = 30 * 2 * BLOCK * 3 * 64 * 1  # SmolLM2: 30 layers, 3 KV heads x 64, 1 byte


@pytest.fixture(scope="module")
def workers(model):
    fp8 = ("--kv-cache-dtype", "fp8")
    specs = [
        # a small chunk budget: the long prompt prefills in chunks
        ("prefill", (*fp8, "--max-num-batched-tokens", "64")),
        ("decode", fp8),
        ("decode", ()),  # KV in the model's dtype: cannot pair with the FP8 prefill worker
    ]
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start_worker, role, *args, model=model) for role, args in specs]
    started = [f.result() for f in futures if f.exception() is None]
    try:
        if len(started) < len(specs):
            raise next(f.exception() for f in futures if f.exception() is not None)
        yield tuple(started)
    finally:
        for w in started:
            w.stop()


def test_fp8_kv_disaggregated_equals_colocated_fp8(workers, model):
    prefill, decode, _ = workers
    colocated = LLM(model, kv_cache_dtype="fp8", num_kv_blocks=64)
    tok = colocated.tokenizer
    prompts = [
        tok.encode("The capital of France is"),
        tok.encode(" ".join(f"w{i}" for i in range(90))),  # several blocks, chunked
    ]
    refs = [
        o.output.token_ids
        for o in colocated.generate(prompts, SamplingParams(temperature=0, max_tokens=10))
    ]
    before = prefill.load()
    for prompt, ref in zip(prompts, refs):
        tokens, last = generate(decode, prompt, prefill, max_tokens=10)
        assert tokens == ref
        assert not last.timings.prefill_fallback
    after = prefill.load()
    assert after.kv_transfers_ok - before.kv_transfers_ok == len(prompts)
    # each prompt's blocks travel once, one byte per element
    blocks = sum(-(-len(p) // BLOCK) for p in prompts)
    assert after.kv_transfer_bytes - before.kv_transfer_bytes == blocks * FP8_BLOCK_BYTES
    for w in (prefill, decode):
        report = w.wait_all_blocks_free()
        assert report.num_free_blocks == report.num_total_blocks, w.role


def test_a_pair_with_different_kv_dtypes_is_refused(workers):
    prefill, _, auto_decode = workers
    with auto_decode.channel() as ch:
        with pytest.raises(grpc.RpcError) as err:
            decode_pb2_grpc.DecodeServiceStub(ch).AddPrefillPeer(
                decode_pb2.AddPrefillPeerRequest(prefill_address=prefill.address), timeout=30
            )
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = err.value.details()
    assert "dtype" in details and "float8_e4m3fn" in details and "k_scales" in details
    # a request through the refused pair: the same error, not a hang or a local recompute
    transfers = prefill.load().kv_transfers_ok
    with pytest.raises(grpc.RpcError) as err:
        generate(auto_decode, list(range(200, 240)), prefill, max_tokens=4, timeout=60)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "dtype" in err.value.details()
    assert prefill.load().kv_transfers_ok == transfers
    for w in (prefill, auto_decode):
        report = w.wait_all_blocks_free()
        assert report.num_free_blocks == report.num_total_blocks, w.role
