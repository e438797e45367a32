"""Worker lifecycle: metrics endpoint, handshake rejection of an incompatible pair,
graceful shutdown on SIGTERM (unary calls and request streams)."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import urllib.request

import grpc
import pytest

from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from tests.workers.procs import start_worker
from tests.workers.test_disaggregated import generate
from tests.workers.test_generate_stream import Stream, _start


def _metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _metrics_port(worker) -> int:
    line = next(line for line in worker.log if '"ready"' in line)
    return json.loads(line.split(" ", 1)[1])["metrics_port"]


def test_metrics_and_incompatible_pair(model):
    prefill = start_worker("prefill", "--metrics-port", "0", model=model)
    # Same model, different block size: the KV layouts cannot be paired.
    odd_decode = start_worker("decode", "--block-size", "32", model=model)
    decode = start_worker("decode", "--metrics-port", "0", model=model)
    try:
        with odd_decode.channel() as ch:
            with pytest.raises(grpc.RpcError) as err:
                decode_pb2_grpc.DecodeServiceStub(ch).AddPrefillPeer(
                    decode_pb2.AddPrefillPeerRequest(prefill_address=prefill.address), timeout=30
                )
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "block_size" in err.value.details()

        with decode.channel() as ch:
            resp = decode_pb2_grpc.DecodeServiceStub(ch).AddPrefillPeer(
                decode_pb2.AddPrefillPeerRequest(prefill_address=prefill.address), timeout=30
            )
        assert resp.session_id
        tokens, _ = generate(decode, list(range(200, 260)), prefill, max_tokens=4)
        assert len(tokens) == 4
        text = _metrics(_metrics_port(prefill))
        assert 'pdserve_kv_transfers_total{outcome="ok"} 1.0' in text
        assert "pdserve_kv_transfer_bytes_total" in text
        text = _metrics(_metrics_port(decode))
        assert 'pdserve_worker_requests_total{outcome="ok"} 1.0' in text
        assert "pdserve_merged_responses_total" in text  # the router-behind signal
        assert "pdserve_detokenizer_fallbacks_total 0.0" in text  # the Rust stream held
    finally:
        for w in (prefill, odd_decode, decode):
            w.stop()


def test_sigterm_drains_in_flight_requests(model):
    decode = start_worker("decode", "--drain-timeout", "20", model=model)
    try:
        req = decode_pb2.GenerateRequest(
            request_id="draining",
            token_ids=common_pb2.TokenIds(ids=list(range(300, 320))),
            sampling_params=common_pb2.SamplingParams(
                max_tokens=48, temperature=0, ignore_eos=True
            ),
        )
        received, last = [], None
        with decode.channel() as ch:
            for resp in decode_pb2_grpc.DecodeServiceStub(ch).Generate(req, timeout=60):
                received.extend(resp.token_ids)
                last = resp
                if len(received) == 2:
                    threading.Thread(target=decode.proc.send_signal, args=(signal.SIGTERM,)).start()
        assert len(received) == 48  # the in-flight request finished
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert decode.proc.wait(30) == 0
    finally:
        decode.stop()


def test_new_requests_are_refused_while_draining(model):
    decode = start_worker("decode", "--drain-timeout", "5", model=model)
    try:
        long_req = decode_pb2.GenerateRequest(
            request_id="long",
            token_ids=common_pb2.TokenIds(ids=list(range(300, 320))),
            sampling_params=common_pb2.SamplingParams(
                max_tokens=2000, temperature=0, ignore_eos=True
            ),
        )
        with decode.channel() as ch:
            stream = decode_pb2_grpc.DecodeServiceStub(ch).Generate(long_req, timeout=60)
            next(stream)
            decode.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(grpc.RpcError) as err:
                generate(decode, [5, 6, 7], max_tokens=2, timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            # after the drain deadline the long request is cut off, not left hanging
            with pytest.raises(grpc.RpcError):
                for _ in stream:
                    pass
        assert decode.proc.wait(30) == 0
        # its cleanup ran before the engine stopped: no "engine loop has stopped" error
        time.sleep(0.5)  # the log reader's last lines
        errors = [line for line in decode.log if " ERROR " in line or "Traceback" in line]
        assert not errors, errors
        assert decode.wait_for_log("cancelled 1 call(s) past the drain", 5)
    finally:
        decode.stop()


def test_an_idle_request_stream_does_not_hold_the_drain(model):
    """A router's GenerateStream stays open between requests. On SIGTERM the worker
    finishes the request on it, refuses a new start with UNAVAILABLE (the router sends
    it elsewhere), ends the stream once it is idle and exits without waiting out the
    drain deadline."""
    decode = start_worker("decode", "--drain-timeout", "60", model=model)

    async def scenario():
        stream = Stream(decode)
        try:
            stream.outgoing.put_nowait(
                _start("long", list(range(300, 320)), max_tokens=64, ignore_eos=True)
            )
            await stream.read_until(lambda s: len(s.tokens.get("long", [])) >= 2)
            decode.proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(decode.wait_for_log, "draining for up to 60s", 10)
            stream.outgoing.put_nowait(_start("late", [5, 6, 7], max_tokens=2))
            await stream.read_until(lambda s: "late" in s.errors and "long" in s.finals)
            # the worker ends the call: the iteration stops with no error
            await stream.read_until(lambda s: False, timeout=20)
            return stream
        finally:
            await stream.close()

    try:
        started = time.monotonic()
        stream = asyncio.run(scenario())
        assert stream.errors["late"].code == grpc.StatusCode.UNAVAILABLE.value[0]
        assert "draining" in stream.errors["late"].message
        assert len(stream.tokens["long"]) == 64  # the request in flight finished
        assert stream.finals["long"].finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert decode.proc.wait(30) == 0
        assert time.monotonic() - started < 30  # not the 60 s drain deadline
        assert not decode.wait_for_log("past the drain", 0.5)
    finally:
        decode.stop()
