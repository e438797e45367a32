"""The router's shared stream to a decode worker (router/mux.py) against a real decode
worker: answers equal the colocated engine, a cancelled request is freed on the worker
within a second while the others go on, a deadline ends only its request, and a broken
stream fails its requests with a status dispatch.py retries while the next request
opens a new stream; after `stream_to` the responses reach the sink in order, the last
one ends the iteration, and an error still reaches the iteration after what arrived
before it. Without a worker: queued starts go in batches that keep under their byte
cap."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from router.mux import DecodeMux, TokenDelta, WorkerCallError
from services.engine import SamplingParams
from tests.workers.procs import start_worker


@pytest.fixture(scope="module")
def decode(model):
    worker = start_worker("decode", model=model)
    yield worker
    worker.stop()


def _gen(rid, prompt, max_tokens=8, **params):
    return decode_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **params),
    )


def _prompts_and_refs(colocated, texts, max_tokens=8):
    prompts = [colocated.tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    return prompts, [o.output.token_ids for o in colocated.generate(prompts, params)]


async def _collect(request):
    tokens = []
    try:
        async for resp in request:
            tokens.extend(resp.token_ids)
    finally:
        request.cancel()
    return tokens


def test_requests_share_a_stream_and_end_alone(decode, colocated):
    prompts, refs = _prompts_and_refs(colocated, ("Hi there", "One two three", "Paris is"))

    async def run():
        async with grpc.aio.insecure_channel(decode.address) as channel:
            mux = DecodeMux(decode_pb2_grpc.DecodeServiceStub(channel))
            endless = mux.open(_gen("endless", prompts[0], 4000, ignore_eos=True), 60)
            first = await endless.__anext__()
            assert first.token_ids
            late = mux.open(_gen("late", prompts[0], 4000, ignore_eos=True), 0.5)
            answers = await asyncio.gather(
                *(_collect(mux.open(_gen(f"a{i}", p), 60)) for i, p in enumerate(prompts))
            )
            with pytest.raises(WorkerCallError) as late_error:
                await _collect(late)
            endless.cancel()  # leaving early: the worker drops it
            decode.wait_all_blocks_free(timeout=1.0)
            session = mux._session
            await mux.close()
            return answers, late_error.value, session

    answers, late_error, session = asyncio.run(run())
    assert answers == refs
    assert late_error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert session.closed is not None and not session.requests


def test_requests_opened_together_go_as_one_batch_and_answer_alike(decode, colocated):
    texts = ["Hi there", "One two three", "Paris is", "The sky", "Once upon a time"]
    prompts, refs = _prompts_and_refs(colocated, texts * 4)

    async def run():
        async with grpc.aio.insecure_channel(decode.address) as channel:
            mux = DecodeMux(decode_pb2_grpc.DecodeServiceStub(channel))
            first = mux.open(_gen("first", prompts[0]), 60)
            await first.__anext__()  # the worker's initial metadata has arrived by now
            writer = mux._session._writer
            assert writer.batching  # this worker reads batches
            # opened in one go: the writer wakes once, with all of them queued
            requests = [mux.open(_gen(f"b{i}", p), 60) for i, p in enumerate(prompts)]
            answers = await asyncio.gather(*(_collect(r) for r in requests))
            await _collect(first)
            decode.wait_all_blocks_free(timeout=1.0)
            batches = writer.batches
            await mux.close()
            return answers, batches

    answers, batches = asyncio.run(run())
    assert answers == refs
    assert batches >= 1


def test_a_broken_stream_fails_its_requests_and_the_next_opens_another(decode, colocated):
    prompt = colocated.tokenizer.encode("Count: one, two")
    (ref,) = [
        o.output.token_ids
        for o in colocated.generate([prompt], SamplingParams(temperature=0, max_tokens=8))
    ]

    async def run():
        async with grpc.aio.insecure_channel(decode.address) as channel:
            mux = DecodeMux(decode_pb2_grpc.DecodeServiceStub(channel))
            doomed = [mux.open(_gen(f"d{i}", prompt, 4000, ignore_eos=True), 60) for i in range(3)]
            await doomed[0].__anext__()
            broken = mux._session
            broken.call.cancel()  # the stream breaks under them (as when a worker dies)
            errors = []
            for request in doomed:
                with pytest.raises(WorkerCallError) as e:
                    await _collect(request)
                errors.append(e.value.code())
            tokens = await _collect(mux.open(_gen("after", prompt), 60))
            assert mux._session is not broken
            await mux.close()
            return errors, tokens

    errors, tokens = asyncio.run(run())
    assert errors == [grpc.StatusCode.CANCELLED] * 3
    assert tokens == ref
    decode.wait_all_blocks_free(timeout=1.0)


async def _until_queued(request, n, timeout=30.0):
    """Wait, without reading, until the request holds n undelivered items."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while len(request._items) < n:
        assert loop.time() < end, f"only {len(request._items)} items arrived"
        await asyncio.sleep(0.01)


def test_stream_to_passes_responses_on_in_order_and_ends_with_the_last(decode, colocated):
    prompt = colocated.tokenizer.encode("The capital of France")
    (ref,) = [
        o.output.token_ids
        for o in colocated.generate([prompt], SamplingParams(temperature=0, max_tokens=24))
    ]

    async def run():
        async with grpc.aio.insecure_channel(decode.address) as channel:
            mux = DecodeMux(decode_pb2_grpc.DecodeServiceStub(channel))
            request = mux.open(_gen("sunk", prompt, 24), 60)
            first = await request.__anext__()
            tokens = list(first.token_ids)
            await _until_queued(request, 3)  # some arrive before the sink is set
            finals, kinds = [], [type(first)]

            def sink(resp):
                tokens.extend(resp.token_ids)
                finals.append(resp.finish_reason)
                kinds.append(type(resp))

            request.stream_to(sink)
            rest = [resp async for resp in request]  # nothing but the end
            request.cancel()
            await mux.close()
            return tokens, finals, rest, request.completed, kinds

    tokens, finals, rest, completed, kinds = asyncio.run(run())
    assert tokens == ref
    assert rest == [] and completed
    assert finals[-1] and not any(finals[:-1])  # the last response, once, at the end
    # the first and last as GenerateResponses, the middle as the worker's TokenDeltas
    response = decode_pb2.GenerateResponse
    assert kinds[0] is response and kinds[-1] is response
    assert TokenDelta in kinds[1:-1]
    decode.wait_all_blocks_free(timeout=1.0)


def test_an_error_after_queued_responses_still_reaches_the_iteration(decode, colocated):
    prompt = colocated.tokenizer.encode("Count: one, two")

    async def run():
        async with grpc.aio.insecure_channel(decode.address) as channel:
            mux = DecodeMux(decode_pb2_grpc.DecodeServiceStub(channel))
            request = mux.open(_gen("late", prompt, 4000, ignore_eos=True), 1.0)
            first = await request.__anext__()
            # unread, responses queue up and then the deadline's error behind them
            await _until_queued(request, 2)
            while not isinstance(request._items[-1], WorkerCallError):
                await asyncio.sleep(0.01)
            # the router's timer and the worker's own deadline may both have queued an
            # error: what counts is what arrived before the first one
            items = list(request._items)
            queued = next(i for i, item in enumerate(items) if isinstance(item, WorkerCallError))
            sunk = []
            request.stream_to(sunk.append)
            await asyncio.sleep(0.2)  # what the worker still sends stays behind the error
            with pytest.raises(WorkerCallError) as e:
                await request.__anext__()
            request.cancel()
            await mux.close()
            return first, sunk, queued, e.value.code(), request.completed

    first, sunk, queued, code, completed = asyncio.run(run())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and not completed
    assert len(sunk) == queued >= 2  # every response before the error, none after
    assert first.token_ids and all(r.token_ids for r in sunk)
    decode.wait_all_blocks_free(timeout=1.0)


class _BrokenColumns:
    """A fault injected on purpose: a stream whose TokenDeltas do not add up."""

    def __init__(self, message):
        self.message = message

    def GenerateStream(self, requests, metadata=None):  # noqa: N802 (the stub's name)
        return self

    async def initial_metadata(self):
        return ()  # an older worker's: no batches

    def __aiter__(self):
        return self._messages()

    async def _messages(self):
        yield self.message
        await asyncio.sleep(3600)

    def cancel(self):
        pass


def test_columns_that_do_not_add_up_fail_the_requests_with_internal():
    first = decode_pb2.GenerateResponse(request_id="r", token_ids=[5], text="a")
    bad = decode_pb2.TokenDeltas(request_ids=["r"], token_counts=[2], token_ids=[6], text="b")
    bad.text_lengths.append(1)
    message = decode_pb2.GenerateStreamResponse(responses=[first], deltas=bad)

    async def run():
        # the columns are checked before anything in the message is passed on
        mux = DecodeMux(_BrokenColumns(message))
        request = mux.open(decode_pb2.GenerateRequest(request_id="r"), 60)
        with pytest.raises(WorkerCallError) as e:
            await _collect(request)
        await mux.close()
        return e.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "malformed TokenDeltas" in error.details()
    assert "summing to 2 for 1 tokens" in error.details()


def test_a_batch_stays_under_its_byte_cap_unless_one_message_is_larger(monkeypatch):
    # what queues up while a write is in flight goes as batches of at most the cap; a
    # message that would push a batch past it starts the next one, so a batch is never
    # larger than a single request's own message would have been (the worker's limit)
    from router import mux

    monkeypatch.setattr(mux, "_MAX_BATCH_BYTES", 3000)

    def start(rid, text_bytes):
        gen = decode_pb2.GenerateRequest(request_id=rid, text="x" * text_bytes)
        return decode_pb2.GenerateStreamRequest(start=gen)

    async def batches_of(messages):
        queue = asyncio.Queue()
        for m in messages:
            queue.put_nowait(m)
        queue.put_nowait(mux._CLOSE)
        outgoing = mux._Outgoing(queue)
        outgoing.batching = True
        sent = [m async for m in outgoing]
        ids = [
            [s.start.request_id for s in m.batch] if m.batch else [m.start.request_id] for m in sent
        ]
        return ids, [m.ByteSize() for m in sent]

    sizes = {"a": 1000, "b": 1000, "c": 1500, "d": 5000, "e": 10, "f": 10}
    ids, byte_sizes = asyncio.run(batches_of([start(r, n) for r, n in sizes.items()]))
    # a + b fit; c would pass the cap; c alone (d would); d alone (over the cap by
    # itself); e + f together after it
    assert ids == [["a", "b"], ["c"], ["d"], ["e", "f"]]
    assert all(n <= 3000 + 64 for n in byte_sizes[:2])  # batch framing: a few bytes
    assert byte_sizes[2] > 5000  # the large message went, alone
