"""The GenerateStream outbox merges a request's news while its reader is behind: the
responses not yet written hold every token and all the text, in order, once each, and
the finish (reason, usage) rides on the merged response. Real ResponseBuilder and
OutboxSink over real engine outputs; no worker process needed."""

from __future__ import annotations

import asyncio

import grpc

from pdpb.v1 import common_pb2, decode_pb2
from services.decode.mux import Outbox, OutboxSink
from services.decode.responses import ResponseBuilder
from services.engine import RequestOutput, SamplingParams
from services.engine.outputs import CompletionOutput

PROMPT = [11, 12, 13]


def _output(rid, tokens, text, finish=None):
    completion = CompletionOutput(0, text, list(tokens), finish_reason=finish)
    return RequestOutput(rid, PROMPT, [completion], finished=finish is not None)


def _sink(rid, outbox):
    request = decode_pb2.GenerateRequest(request_id=rid, token_ids=common_pb2.TokenIds(ids=PROMPT))
    builder = ResponseBuilder(None, rid, request, PROMPT, SamplingParams(max_tokens=3))
    sink = OutboxSink(builder, outbox)
    sink.start()
    return sink


def _responses(messages):
    return [r for m in messages for r in m.responses]


def test_a_reader_behind_gets_one_response_per_request_with_all_news():
    async def run():
        counted = []
        outbox = Outbox(on_merge=lambda: counted.append(1))  # the worker's metric's inc
        a, b = _sink("a", outbox), _sink("b", outbox)
        a.put_nowait(_output("a", [5], "x"))
        b.put_nowait(_output("b", [7], "p"))
        a.put_nowait(_output("a", [5, 6], "xy"))  # the reader has not taken: merged
        b.put_nowait(_output("b", [7, 8], "pq"))
        assert len(counted) == 2
        first = _responses(outbox.take())
        assert [(r.request_id, list(r.token_ids), r.text) for r in first] == [
            ("a", [5, 6], "xy"),
            ("b", [7, 8], "pq"),
        ]
        assert not any(r.finish_reason for r in first)
        # taken: the next news opens a new response, holding only what is new
        a.put_nowait(_output("a", [5, 6, 9], "xyz", finish="length"))
        (last,) = _responses(outbox.take())
        assert (list(last.token_ids), last.text) == ([9], "z")
        assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
        assert last.usage.completion_tokens == 3 and last.usage.prompt_tokens == 3
        assert a.done.done() and a.done.result() is True and not b.done.done()
        # the finish can also ride on a response still waiting
        b.put_nowait(_output("b", [7, 8, 4], "pqr"))
        b.put_nowait(_output("b", [7, 8, 4, 3], "pqrs", finish="stop"))
        (merged,) = _responses(outbox.take())
        assert (list(merged.token_ids), merged.text) == ([4, 3], "rs")
        assert merged.finish_reason == common_pb2.FINISH_REASON_STOP
        assert merged.usage.completion_tokens == 4
        assert len(counted) == 3

    asyncio.run(run())


def test_an_error_is_not_merged_into_and_ends_the_waiting_response():
    async def run():
        counted = []
        outbox = Outbox(on_merge=lambda: counted.append(1))
        a = _sink("a", outbox)
        a.put_nowait(_output("a", [5], "x"))
        outbox.error("a", grpc.StatusCode.INTERNAL, "boom")
        messages = outbox.take()
        assert [list(r.token_ids) for r in _responses(messages)] == [[5]]
        assert [(e.request_id, e.message) for m in messages for e in m.errors] == [("a", "boom")]
        assert counted == []

    asyncio.run(run())


def test_an_output_that_goes_back_fails_the_request_instead_of_resending_tokens():
    async def run():
        outbox = Outbox()
        a = _sink("a", outbox)
        a.put_nowait(_output("a", [5, 6, 7], "xyz"))
        a.put_nowait(_output("a", [5], "x"))  # out of order: its tokens were all sent
        a.put_nowait(_output("a", [5, 6, 7, 8], "xyzw", finish="length"))
        assert [list(r.token_ids) for r in _responses(outbox.take())] == [[5, 6, 7]]
        assert a.done.done()
        assert "1 tokens arrived after 3 were sent" in str(a.done.exception())

    asyncio.run(run())
