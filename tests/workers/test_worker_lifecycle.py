"""Worker lifecycle: metrics endpoint, handshake rejection of an incompatible pair,
graceful shutdown on SIGTERM."""

from __future__ import annotations

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
