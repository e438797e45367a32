"""Generate and GenerateStream share one request lifecycle (services/decode/mux.py):
Generate is serve_one over it. These check the plumbing with a stand-in lifecycle, no
engine: responses in order, the error after them, cancellation reaching the request's
`finally`, and no last response lost when a request ends while a message is written."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdpb.v1 import decode_pb2
from services.common.errors import EngineFailedError
from services.decode.mux import MuxSession, serve_one


def _request(rid: str) -> decode_pb2.GenerateRequest:
    return decode_pb2.GenerateRequest(request_id=rid)


async def _collect(responses, slow_first: asyncio.Event | None = None):
    got = []
    async for resp in responses:
        got.append(resp)
        if slow_first is not None and len(got) == 1:
            slow_first.set()  # the request goes on (and ends) while this one is written
            await asyncio.sleep(0.05)
    return got


def test_serve_one_yields_every_response_then_raises_the_error():
    async def generate(request, outbox):
        for i in range(3):
            outbox.response(request.request_id).token_ids.append(i)
            await asyncio.sleep(0)
        outbox.response(request.request_id).token_ids.append(3)  # written just before the failure
        raise EngineFailedError("engine failed: boom")

    async def main():
        got = []
        with pytest.raises(EngineFailedError, match="boom"):
            async for resp in serve_one(generate, _request("r")):
                got.append(list(resp.token_ids))
        return got

    assert asyncio.run(main()) == [[0], [1], [2], [3]]


def test_serve_one_keeps_the_last_response_of_a_request_ending_during_a_write():
    async def main():
        written = asyncio.Event()

        async def generate(request, outbox):
            outbox.response(request.request_id).token_ids.append(1)
            await written.wait()
            outbox.response(request.request_id).finish_reason = 1

        got = await _collect(serve_one(generate, _request("r")), written)
        return [(list(r.token_ids), r.finish_reason) for r in got]

    assert asyncio.run(main()) == [([1], 0), ([], 1)]


def test_closing_serve_one_cancels_the_request_and_waits_for_its_cleanup():
    async def main():
        started, cleaned = asyncio.Event(), asyncio.Event()

        async def generate(request, outbox):
            try:
                outbox.response(request.request_id).token_ids.append(1)
                started.set()
                await asyncio.sleep(60)
            finally:
                await asyncio.sleep(0.01)  # freeing blocks takes an engine call
                cleaned.set()

        responses = serve_one(generate, _request("r"))
        first = await anext(responses)
        await responses.aclose()  # the call was cancelled at the yield
        return list(first.token_ids), started.is_set(), cleaned.is_set()

    assert asyncio.run(main()) == ([1], True, True)


def test_mux_keeps_the_last_response_of_a_request_ending_during_a_write():
    """The router half-closes with one request left; it ends while the previous message
    is being written. Its last response still goes out before the stream ends."""

    async def main():
        written = asyncio.Event()

        async def generate(start, outbox):
            outbox.response(start.request_id).token_ids.append(1)
            await written.wait()
            outbox.response(start.request_id).finish_reason = 1

        async def requests():
            start = decode_pb2.GenerateStreamRequest(start=_request("r"))
            yield start

        messages = await _collect(MuxSession(generate).serve(requests()), written)
        return [(list(r.token_ids), r.finish_reason) for m in messages for r in m.responses]

    assert asyncio.run(main()) == [([1], 0), ([], 1)]


def test_mux_reports_a_failed_request_as_its_error():
    async def main():
        async def generate(start, outbox):
            raise ValueError("bad prompt")

        async def requests():
            yield decode_pb2.GenerateStreamRequest(start=_request("r"))

        messages = await _collect(MuxSession(generate).serve(requests()))
        return [(e.request_id, e.code, e.message) for m in messages for e in m.errors]

    code = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert asyncio.run(main()) == [("r", code, "bad prompt")]
