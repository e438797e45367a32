"""Abort on the prefill worker answers the call it stops: a Prefill call whose caller
still waits ends with CANCELLED ("aborted"), at once, rather than with no status (the
handler ending cancelled reads to gRPC as a caller gone away), which left the caller
waiting out its deadline. Real prefill and decode processes; each Prefill is held in
the injected stall before it is computed (PDSERVE_FAULT_STALL_BEFORE_PREFILL_S)."""

from __future__ import annotations

import re
import threading
import time

import grpc
import pytest

from kvtransfer.faults import STALL_BEFORE_PREFILL_ENV
from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from tests.workers.procs import start_worker
from tests.workers.test_disaggregated import expected, generate

BLOCK = 16  # the workers' default block size
STALL_S = 60.0  # as long as the callers' deadlines: an unanswered call waits it out
QUICK_S = 10.0  # "at once", with room for a loaded CI machine


@pytest.fixture(scope="module")
def pair(model):
    workers = []
    try:
        workers.append(
            start_worker("prefill", model=model, env={STALL_BEFORE_PREFILL_ENV: str(STALL_S)})
        )
        workers.append(start_worker("decode", model=model))
        yield tuple(workers)
    finally:
        for w in workers:
            w.stop()


@pytest.fixture(scope="module")
def session(pair) -> str:
    prefill, decode = pair
    with decode.channel() as ch:
        req = decode_pb2.AddPrefillPeerRequest(prefill_address=prefill.address)
        return decode_pb2_grpc.DecodeServiceStub(ch).AddPrefillPeer(req, timeout=60).session_id


def _free_blocks(pair) -> list[int]:
    return [w.load().num_free_blocks for w in pair]


def _stalled_key(prefill, since: int, timeout: float = 30.0) -> str:
    """The id of the request the prefill worker started stalling after log line `since`."""
    pattern = re.compile(r"stalling request (\S+) ")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in prefill.log[since:]:
            if m := pattern.search(line):
                return m.group(1)
        time.sleep(0.02)
    raise AssertionError(f"no Prefill stalled:\n{''.join(prefill.log[-20:])}")


def test_an_aborted_prefill_call_ends_cancelled_at_once(pair, session):
    prefill, decode = pair
    start = _free_blocks(pair)
    prompt = list(range(100, 140))
    req = prefill_pb2.PrefillRequest(
        request_id="abort-me",
        prompt_token_ids=prompt,
        sampling_params=common_pb2.SamplingParams(max_tokens=4, temperature=0),
        decode_session_id=session,
        block_ids=list(range(-(-len(prompt) // BLOCK))),
    )
    with prefill.channel() as ch:
        stub = prefill_pb2_grpc.PrefillServiceStub(ch)
        since = len(prefill.log)
        call = stub.Prefill.future(req, timeout=STALL_S)
        assert _stalled_key(prefill, since) == "abort-me"
        started = time.monotonic()
        assert stub.Abort(common_pb2.AbortRequest(request_id="abort-me"), timeout=30).found
        error = call.exception(timeout=QUICK_S)  # grpc.FutureTimeoutError: no status came
        waited = time.monotonic() - started
    assert error is not None and error.code() == grpc.StatusCode.CANCELLED, error
    assert "aborted" in error.details()
    assert waited < QUICK_S, f"answered {waited:.1f}s after Abort"
    for w in pair:
        w.wait_all_blocks_free(timeout=5.0)
    assert _free_blocks(pair) == start


def test_an_aborted_remote_prefill_is_recomputed_without_waiting(pair, colocated):
    """Through the decode worker: its Prefill call, aborted on the prefill worker, comes
    back CANCELLED and the decode worker recomputes the prompt (policy `recompute`)
    then, rather than after its 60 s prefill timeout."""
    prefill, decode = pair
    start = _free_blocks(pair)
    prompt = colocated.tokenizer.encode("The capital of France is")
    since = len(prefill.log)
    result: dict = {}

    def run():
        started = time.monotonic()
        result["tokens"], result["last"] = generate(decode, prompt, prefill, timeout=STALL_S)
        result["seconds"] = time.monotonic() - started

    caller = threading.Thread(target=run)
    caller.start()
    key = _stalled_key(prefill, since)  # the decode worker's own id for the request
    with prefill.channel() as ch:
        stub = prefill_pb2_grpc.PrefillServiceStub(ch)
        assert stub.Abort(common_pb2.AbortRequest(request_id=key), timeout=30).found
    caller.join(STALL_S + 10)
    assert not caller.is_alive() and "tokens" in result
    assert result["tokens"] == expected(colocated, [prompt])[0]
    assert result["last"].timings.prefill_fallback
    assert result["seconds"] < STALL_S / 2, f"answered after {result['seconds']:.1f}s"
    for w in pair:
        w.wait_all_blocks_free(timeout=5.0)
    assert _free_blocks(pair) == start
