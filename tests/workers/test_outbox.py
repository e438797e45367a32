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
from services.engine.output_deltas import News
from services.engine.outputs import CompletionOutput
from services.engine.sequence import Logprob

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


def _read(messages):
    """Every request's (tokens, text) in reading order: each message's TokenDeltas
    columns first, then its responses; and which requests came as deltas."""
    news, via_deltas = [], set()
    for m in messages:
        d = m.deltas
        assert len(d.request_ids) == len(d.token_counts) == len(d.text_lengths)
        t = c = 0
        for rid, n, length in zip(d.request_ids, d.token_counts, d.text_lengths):
            news.append((rid, list(d.token_ids[t : t + n]), d.text[c : c + length], 0))
            via_deltas.add(rid)
            t, c = t + n, c + length
        assert (t, c) == (len(d.token_ids), len(d.text))
        news += [(r.request_id, list(r.token_ids), r.text, r.finish_reason) for r in m.responses]
    return news, via_deltas


def test_columns_carry_the_plain_middle_and_merge_while_the_reader_is_behind():
    async def run():
        counted = []
        outbox = Outbox(on_merge=lambda: counted.append(1), columns=True)
        a, b = _sink("a", outbox), _sink("b", outbox)
        a.put_nowait(_output("a", [5], "x"))  # first: a response (the prompt's place)
        b.put_nowait(_output("b", [7], "p"))
        news, via_deltas = _read(outbox.take())
        assert news == [("a", [5], "x", 0), ("b", [7], "p", 0)] and not via_deltas
        a.put_nowait(_output("a", [5, 6], "xé"))  # a multi-byte character's length
        b.put_nowait(_output("b", [7, 8], "pq"))
        a.put_nowait(_output("a", [5, 6, 9], "xéz"))  # merged into a's waiting entry
        assert len(counted) == 1
        (message,) = outbox.take()
        assert list(message.deltas.request_ids) == ["a", "b"] and not message.responses
        assert list(message.deltas.text_lengths) == [2, 1]
        news, _ = _read([message])
        assert news == [("a", [6, 9], "éz", 0), ("b", [8], "q", 0)]
        # the last response follows a waiting delta in the same message, read after it
        a.put_nowait(_output("a", [5, 6, 9, 4], "xézw"))
        a.put_nowait(_output("a", [5, 6, 9, 4, 3], "xézwv", finish="length"))
        news, via_deltas = _read(outbox.take())
        assert news == [("a", [4], "w", 0), ("a", [3], "v", common_pb2.FINISH_REASON_LENGTH)]
        assert via_deltas == {"a"} and a.done.result() is True
        # an error drops the waiting entry's place for merging; it is read after it
        b.put_nowait(_output("b", [7, 8, 1], "pqr"))
        outbox.error("b", grpc.StatusCode.INTERNAL, "boom")
        messages = outbox.take()
        assert _read(messages)[0] == [("b", [1], "r", 0)]
        assert [e.request_id for m in messages for e in m.errors] == ["b"]

    asyncio.run(run())


def test_without_columns_the_middle_goes_as_responses():
    async def run():
        outbox = Outbox()  # Generate's, and a router that did not ask for columns
        a = _sink("a", outbox)
        a.put_nowait(_output("a", [5], "x"))
        outbox.take()
        a.put_nowait(_output("a", [5, 6], "xy"))
        (message,) = outbox.take()
        assert not message.HasField("deltas")
        assert [(list(r.token_ids), r.text) for r in message.responses] == [([6], "y")]

    asyncio.run(run())


def test_logprobs_requests_never_go_as_columns():
    async def run():
        outbox = Outbox(columns=True)
        request = decode_pb2.GenerateRequest(request_id="a")
        params = SamplingParams(max_tokens=3, logprobs=0)
        sink = OutboxSink(ResponseBuilder(None, "a", request, PROMPT, params), outbox)
        sink.start()
        lps = [{5: Logprob(-0.5, 1, "x")}, {6: Logprob(-0.25, 1, "y")}]
        for n in (1, 2):
            completion = CompletionOutput(0, "xy"[:n], [5, 6][:n], logprobs=lps[:n])
            sink.put_nowait(RequestOutput("a", PROMPT, [completion], finished=False))
            (message,) = outbox.take()
            assert not message.deltas.request_ids
            assert [lp.token_id for r in message.responses for lp in r.logprobs] == [4 + n]

    asyncio.run(run())


def test_news_goes_as_columns_and_news_out_of_place_fails_the_request():
    async def run():
        outbox = Outbox(columns=True)
        a, b = _sink("a", outbox), _sink("b", outbox)
        for sink, rid in ((a, "a"), (b, "b")):
            sink.put_nowait(_output(rid, [5], "x"))  # the first output: a response
        outbox.take()
        a.put_nowait(News("a", [6, 7], "yz", 3))
        b.put_nowait(News("b", [8], "w", 3))  # tokens 2..3 after 1 sent: one is missing
        news, via_deltas = _read(outbox.take())
        assert news == [("a", [6, 7], "yz", 0)] and via_deltas == {"a"}
        assert "news of tokens 2..3 arrived after 1 were sent" in str(b.done.exception())
        a.put_nowait(_output("a", [5, 6, 7, 9], "xyzv", finish="stop"))  # the whole output
        (last,) = [r for m in outbox.take() for r in m.responses]
        assert (list(last.token_ids), last.text, last.usage.completion_tokens) == ([9], "v", 4)

    asyncio.run(run())
