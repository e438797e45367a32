"""Acceptance of the workers issue: real prefill and decode processes on loopback, the
real Mooncake engine over TCP, compared token for token with the colocated engine."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.engine import SamplingParams
from tests.workers.procs import start_worker, worker_pair

BLOCK = 16
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pair(model):
    # A small chunk budget on the prefill side makes long prompts chunked.
    with worker_pair(model, prefill_args=("--max-num-batched-tokens", "64")) as workers:
        yield workers


def generate(decode, prompt_ids, prefill=None, max_tokens=MAX_TOKENS, timeout=120, **params):
    req = decode_pb2.GenerateRequest(
        request_id=f"t-{time.monotonic_ns()}",
        token_ids=common_pb2.TokenIds(ids=prompt_ids),
        sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **params),
        prefill_address=prefill.address if prefill else "",
    )
    tokens, last = [], None
    with decode.channel() as ch:
        for resp in decode_pb2_grpc.DecodeServiceStub(ch).Generate(req, timeout=timeout):
            tokens.extend(resp.token_ids)
            last = resp
    return tokens, last


def prompt_set(tok):
    texts = [
        "Hi",
        "The capital of France is",
        "Write a haiku about autumn leaves:",
        "Explain photosynthesis to a child. " * 4,
        " ".join(f"w{i}" for i in range(90)),
    ]
    prompts = [tok.encode(t) for t in texts]
    prompts.append(tok.encode(" ".join(str(i) for i in range(200)))[:BLOCK])  # exactly 1 block
    prompts.append(tok.encode(" ".join(str(i) for i in range(200)))[: 3 * BLOCK])  # 3 blocks
    prompts.append(tok.encode(" ".join(str(i) for i in range(200)))[: 3 * BLOCK + 1])
    return prompts


def expected(colocated, prompts, max_tokens=MAX_TOKENS):
    outs = colocated.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens))
    return [o.output.token_ids for o in outs]


def test_disaggregated_equals_colocated(pair, colocated):
    prefill, decode = pair
    prompts = prompt_set(colocated.tokenizer)
    assert min(map(len, prompts)) < BLOCK and max(map(len, prompts)) > 64  # 1 block .. chunked
    refs = expected(colocated, prompts)
    before = prefill.load().kv_transfers_ok
    for prompt, ref in zip(prompts, refs):
        tokens, last = generate(decode, prompt, prefill)
        assert tokens == ref
        assert last.usage.prompt_tokens == len(prompt)
        assert last.usage.completion_tokens == len(ref)
        assert not last.timings.prefill_fallback
    assert prefill.load().kv_transfers_ok - before == len(prompts)
    # The same long prompt again: the decode worker caches its prefix, so only the
    # last block travels.
    long_prompt = max(prompts, key=len)
    bytes_before = prefill.load().kv_transfer_bytes
    tokens, last = generate(decode, long_prompt, prefill)
    assert tokens == refs[prompts.index(long_prompt)]
    assert last.usage.cached_tokens == (len(long_prompt) - 1) // BLOCK * BLOCK
    sent = prefill.load().kv_transfer_bytes - bytes_before
    block_bytes = 30 * 2 * BLOCK * 3 * 64 * 4  # SmolLM2 fp32
    assert sent == block_bytes * (-(-len(long_prompt) // BLOCK) - last.usage.cached_tokens // BLOCK)
    for w in pair:
        report = w.wait_all_blocks_free()
        assert report.num_free_blocks == report.num_total_blocks


def test_32_concurrent_requests(pair, colocated):
    prefill, decode = pair
    prompts = [
        colocated.tokenizer.encode(f"Request {i}: tell me about the number {i * 7}.")
        for i in range(32)
    ]
    refs = expected(colocated, prompts)
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda p: generate(decode, p, prefill)[0], prompts))
    assert results == refs
    for w in pair:
        report = w.wait_all_blocks_free()
        assert report.num_free_blocks == report.num_total_blocks


def test_bad_input_is_invalid_argument(pair):
    _, decode = pair
    cases = [
        dict(prompt_ids=[], max_tokens=4),
        dict(prompt_ids=[1, 2], max_tokens=4, top_p=1.5),
        dict(prompt_ids=[10**8], max_tokens=4),
        dict(prompt_ids=[5] * 10, max_tokens=10**6),
    ]
    for case in cases:
        with pytest.raises(grpc.RpcError) as err:
            generate(decode, case.pop("prompt_ids"), pair[0], **case)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


def _cancel_after(decode, prompt, prefill, when, max_tokens, delay=0.5):
    req = decode_pb2.GenerateRequest(
        request_id=f"cancel-{time.monotonic_ns()}",
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0, ignore_eos=True
        ),
        prefill_address=prefill.address,
    )
    with decode.channel() as ch:
        call = decode_pb2_grpc.DecodeServiceStub(ch).Generate(req, timeout=120)
        if when == "prefill":
            threading.Timer(delay, call.cancel).start()
            with pytest.raises(grpc.RpcError) as err:
                for _ in call:
                    pass
            assert err.value.code() == grpc.StatusCode.CANCELLED
        else:
            got = 0
            for resp in call:
                got += len(resp.token_ids)
                if got >= 3:
                    call.cancel()
                    break


@pytest.mark.parametrize(
    "when, delay",
    [("prefill", 0.02), ("prefill", 0.2), ("prefill", 0.5), ("prefill", 1.0), ("decode", None)],
)
def test_cancel_frees_blocks_on_both_workers(pair, when, delay):
    prefill, decode = pair
    # ~1500 tokens prefilled in 64-token chunks: seconds of work to cancel in the middle of;
    # several delays hit different moments (before the Prefill call, in it, in the engine)
    long_prompt = [(i * 37) % 40000 + 100 for i in range(1500)]
    prompt = long_prompt if when == "prefill" else long_prompt[:40]
    _cancel_after(decode, prompt, prefill, when, max_tokens=200, delay=delay)
    time.sleep(0.2)
    for w in pair:
        report = w.wait_all_blocks_free(timeout=1.0)
        assert report.num_free_blocks == report.num_total_blocks, f"{w.role} leaked blocks"
        assert report.num_running == 0 and report.num_waiting == 0


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_killed_mid_transfer(model, colocated, policy):
    # Injected fault: the prefill worker writes half of the blocks, then pauses; it is
    # killed in that pause, with a transfer half done.
    prefill = start_worker("prefill", model=model, env={"PDSERVE_FAULT_PAUSE_MID_TRANSFER_S": "30"})
    decode = start_worker("decode", "--prefill-failure-policy", policy, model=model)
    try:
        prompt = [(i * 37) % 40000 + 100 for i in range(300)]
        ref = expected(colocated, [prompt], max_tokens=8)[0]

        def kill_mid_transfer():
            if prefill.wait_for_log("pausing", timeout=60):
                os.kill(prefill.proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_mid_transfer)
        killer.start()
        if policy == "recompute":
            tokens, last = generate(decode, prompt, prefill, max_tokens=8)
            assert tokens == ref
            assert last.timings.prefill_fallback
            assert decode.load().prefill_fallbacks == 1
        else:
            with pytest.raises(grpc.RpcError) as err:
                generate(decode, prompt, prefill, max_tokens=8)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "prefill worker" in err.value.details()
        killer.join()
        assert prefill.proc.wait(10) == -signal.SIGKILL  # it really died mid-transfer
        assert decode.healthy()
        report = decode.wait_all_blocks_free()
        assert report.num_free_blocks == report.num_total_blocks
        # still serving: a local (colocated) request works
        tokens, _ = generate(decode, prompt[:20], None, max_tokens=4)
        assert tokens == expected(colocated, [prompt[:20]], max_tokens=4)[0]
    finally:
        prefill.stop()
        decode.stop()


def test_prefill_timeout_recomputes_and_stops_the_late_writer(model, colocated):
    # The prefill worker stalls mid-transfer (injected) past the decode worker's deadline:
    # the decode worker aborts it (so nothing lands in its blocks later) and recomputes.
    prefill = start_worker("prefill", model=model, env={"PDSERVE_FAULT_PAUSE_MID_TRANSFER_S": "60"})
    decode = start_worker("decode", "--prefill-timeout", "8", model=model)
    try:
        block_bytes = 30 * 2 * BLOCK * 3 * 64 * 4
        # First contact (handshake, first prefill) out of the way with a one-block
        # prompt, which the fault leaves whole: on a loaded machine it alone can take
        # seconds, and the first half below must land before the decode deadline.
        warm = [(i * 7) % 40000 + 100 for i in range(BLOCK - 4)]
        assert (
            generate(decode, warm, prefill, max_tokens=2)[0]
            == expected(colocated, [warm], max_tokens=2)[0]
        )
        assert prefill.load().kv_transfer_bytes == block_bytes
        prompt = [(i * 41) % 40000 + 100 for i in range(200)]
        start = time.monotonic()
        tokens, last = generate(decode, prompt, prefill, max_tokens=8)
        assert tokens == expected(colocated, [prompt], max_tokens=8)[0]
        assert last.timings.prefill_fallback
        assert prefill.wait_for_log("pausing 60.0s mid-transfer", 1), prefill.log[-20:]
        assert time.monotonic() - start < 40  # not waiting out the 60 s stall
        for w in (prefill, decode):
            report = w.wait_all_blocks_free()
            assert report.num_free_blocks == report.num_total_blocks, w.role
        # only the first half was written; the aborted second half never was
        assert prefill.healthy()
        half = (len(prompt) // BLOCK + 1) // 2 * block_bytes
        assert prefill.load().kv_transfer_bytes == block_bytes + half
    finally:
        prefill.stop()
        decode.stop()


def test_direct_write_mode_over_tcp(model, colocated):
    """--transfer-write-mode direct (the nvlink_intra default) reaches the connector and
    works in the real service: concurrent requests, the KV written from the handlers'
    own threads after the first contact, the colocated engine's tokens."""
    prefill = start_worker("prefill", "--transfer-write-mode", "direct", model=model)
    decode = start_worker("decode", model=model)
    try:
        assert prefill.wait_for_log("writes='direct'", 10), prefill.log[-20:]
        assert decode.wait_for_log("writes='thread'", 10), decode.log[-20:]  # tcp default
        prompts = [
            colocated.tokenizer.encode(f"Direct write {i}: count to {i + 3}.") for i in range(8)
        ]
        refs = expected(colocated, prompts)
        assert generate(decode, prompts[0], prefill)[0] == refs[0]  # first contact
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda p: generate(decode, p, prefill)[0], prompts))
        assert results == refs
        report = prefill.load()
        assert report.kv_transfers_ok == 9 and report.kv_transfers_failed == 0
        for w in (prefill, decode):
            r = w.wait_all_blocks_free()
            assert r.num_free_blocks == r.num_total_blocks
    finally:
        prefill.stop()
        decode.stop()


def test_duplicate_request_id_from_two_callers(pair, colocated):
    """Two routers that send one request id at once: the second is refused with
    ALREADY_EXISTS and the first runs to the end, untouched (its stream is not replaced,
    its blocks are not freed)."""
    prefill, decode = pair
    prompt = colocated.tokenizer.encode("Tell me a long story about a lighthouse keeper.")
    n = 160  # long enough to still run when the second call arrives
    ref = colocated.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    )[0].output.token_ids

    def request(rid):
        return decode_pb2.GenerateRequest(
            request_id=rid,
            token_ids=common_pb2.TokenIds(ids=prompt),
            sampling_params=common_pb2.SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
            prefill_address=prefill.address,
        )

    with decode.channel() as ch1, decode.channel() as ch2:
        first = decode_pb2_grpc.DecodeServiceStub(ch1).Generate(request("dup"), timeout=120)
        got = list(next(first).token_ids)  # the first request is in flight
        with pytest.raises(grpc.RpcError) as err:
            for _ in decode_pb2_grpc.DecodeServiceStub(ch2).Generate(request("dup"), timeout=60):
                pass
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS, err.value.details()
        for resp in first:
            got.extend(resp.token_ids)
            assert resp.request_id == "dup"  # the caller's id, not the worker's own key
    assert got == ref
    # once it is done the id is free again
    assert generate(decode, prompt, prefill, max_tokens=4, ignore_eos=True)[0] == ref[:4]
    for w in pair:
        report = w.wait_all_blocks_free()
        assert report.num_free_blocks == report.num_total_blocks
