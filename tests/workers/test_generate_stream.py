"""GenerateStream: many requests over one gRPC stream (the router's way to a decode
worker). Real prefill and decode processes over Mooncake TCP; every answer equals the
colocated engine's, and cancellations, errors, deadlines and a vanished caller leave
no block held, with the decode worker's engine on a thread or in its own process."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from pdpb.v1 import common_pb2, decode_pb2, decode_pb2_grpc
from services.engine import SamplingParams
from tests.workers.procs import worker_pair
from tests.workers.test_disaggregated import expected, prompt_set

MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["engine thread", "engine process"])
def pair(model, request):
    # the decode worker's engine on a thread of its own, or in its own process
    # (--engine-process): the same answers, cancellations and frees either way
    decode_args = ("--engine-process",) if request.param == "engine process" else ()
    with worker_pair(model, decode_args=decode_args) as workers:
        yield workers


def _start(rid, prompt, prefill=None, max_tokens=MAX_TOKENS, timeout=60.0, **params):
    gen = decode_pb2.GenerateRequest(
        request_id=rid,
        token_ids=common_pb2.TokenIds(ids=prompt),
        sampling_params=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0, **params),
        prefill_address=prefill.address if prefill else "",
    )
    return decode_pb2.GenerateStreamRequest(start=gen, timeout_seconds=timeout)


class Stream:
    """One GenerateStream call: send starts and cancels, collect per request. With
    `deltas` it asks for TokenDeltas (as the router does) and reads their columns
    here, by the proto's own rule, not through the router's reader."""

    def __init__(self, decode, deltas=False):
        self.channel = grpc.aio.insecure_channel(decode.address)
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.tokens: dict[str, list[int]] = {}
        self.texts: dict[str, str] = {}
        self.finals: dict[str, decode_pb2.GenerateResponse] = {}
        self.errors: dict[str, decode_pb2.GenerateStreamError] = {}
        self.messages = 0
        self.delta_entries = 0
        self.first_token = asyncio.Event()

        async def requests():
            while (m := await self.outgoing.get()) is not None:
                yield m

        stub = decode_pb2_grpc.DecodeServiceStub(self.channel)
        metadata = (("x-pdserve-token-deltas", "1"),) if deltas else None
        self.call = stub.GenerateStream(requests(), metadata=metadata)

    def _news(self, rid, token_ids, text):
        assert rid not in self.finals  # nothing after the last response
        self.tokens.setdefault(rid, []).extend(token_ids)
        self.texts[rid] = self.texts.get(rid, "") + text
        if token_ids:
            self.first_token.set()

    async def read_until(self, done, timeout=60.0):
        if done(self):
            return
        async with asyncio.timeout(timeout):
            async for message in self.call:
                self.messages += 1
                d = message.deltas  # read first: a request's deltas precede its responses
                t = c = 0
                for rid, n, length in zip(d.request_ids, d.token_counts, d.text_lengths):
                    assert rid in self.tokens  # never a request's first response
                    self._news(rid, d.token_ids[t : t + n], d.text[c : c + length])
                    t, c = t + n, c + length
                    self.delta_entries += 1
                assert (t, c) == (len(d.token_ids), len(d.text))
                for resp in message.responses:
                    self._news(resp.request_id, resp.token_ids, resp.text)
                    if resp.finish_reason:
                        self.finals[resp.request_id] = resp
                for err in message.errors:
                    self.errors[err.request_id] = err
                if done(self):
                    return

    async def close(self):
        self.outgoing.put_nowait(None)
        await self.channel.close()


@pytest.mark.parametrize("deltas", [False, True], ids=["responses", "token deltas"])
def test_many_requests_on_one_stream_equal_the_colocated_engine(pair, colocated, deltas):
    prefill, decode = pair
    prompts = prompt_set(colocated.tokenizer)
    outs = colocated.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    refs = [o.output.token_ids for o in outs]

    async def run():
        s = Stream(decode, deltas)
        for i, p in enumerate(prompts):  # half through the prefill worker, half local
            s.outgoing.put_nowait(_start(f"r{i}", p, prefill if i % 2 else None))
        await s.read_until(lambda s: len(s.finals) == len(prompts))
        await s.close()
        return s

    s = asyncio.run(run())
    assert not s.errors
    assert [s.tokens[f"r{i}"] for i in range(len(prompts))] == refs
    assert [s.texts[f"r{i}"] for i in range(len(prompts))] == [o.output.text for o in outs]
    for i, p in enumerate(prompts):
        assert s.finals[f"r{i}"].usage.prompt_tokens == len(p)
    # the plain middle of each output goes as columns only where the caller asked
    if deltas:
        assert s.delta_entries > 0
    else:
        assert s.delta_entries == 0
    # one message per step carries every request's token: far fewer than one per token
    assert s.messages < sum(map(len, refs))
    prefill.wait_all_blocks_free()
    decode.wait_all_blocks_free()


@pytest.mark.parametrize("deltas", [False, True], ids=["responses", "token deltas"])
def test_errors_cancels_and_deadlines_stay_with_their_request(pair, colocated, deltas):
    prefill, decode = pair
    prompt = colocated.tokenizer.encode("The capital of France is")
    (ref,) = expected(colocated, [prompt], MAX_TOKENS)

    async def run():
        s = Stream(decode, deltas)
        s.outgoing.put_nowait(_start("long", prompt, prefill, max_tokens=4000, ignore_eos=True))
        s.outgoing.put_nowait(_start("late", prompt, max_tokens=4000, ignore_eos=True, timeout=1))
        s.outgoing.put_nowait(_start("bad", [10**9]))  # a token id outside the vocabulary
        s.outgoing.put_nowait(_start("ok", prompt, prefill))
        s.outgoing.put_nowait(_start("ok", prompt))  # the same id again while in flight
        await s.read_until(lambda s: "ok" in s.finals and "long" in s.tokens)
        s.outgoing.put_nowait(decode_pb2.GenerateStreamRequest(cancel="long"))
        await s.read_until(lambda s: "late" in s.errors)
        await s.close()
        return s

    start = time.monotonic()
    s = asyncio.run(run())
    assert s.tokens["ok"] == ref
    assert s.errors["bad"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "vocabulary" in s.errors["bad"].message or "token" in s.errors["bad"].message
    assert s.errors["ok"].code == grpc.StatusCode.ALREADY_EXISTS.value[0]
    assert s.errors["late"].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
    assert "long" not in s.finals and "long" not in s.errors  # cancelled: nothing more
    assert time.monotonic() - start < 30
    prefill.wait_all_blocks_free()
    decode.wait_all_blocks_free()


def test_a_vanished_caller_frees_every_request(pair, colocated):
    prefill, decode = pair
    prompt = colocated.tokenizer.encode("Write a haiku about autumn leaves:")

    async def run():
        s = Stream(decode)
        for i in range(6):
            args = dict(max_tokens=4000, ignore_eos=True)
            s.outgoing.put_nowait(_start(f"v{i}", prompt, prefill if i % 2 else None, **args))
        await s.read_until(lambda s: len(s.tokens) == 6)
        # a load report may be the engine process's last status (up to ~1 s old) while
        # a step on a busy host holds the question back: wait for it to count all six
        deadline = time.monotonic() + 10
        while (running := decode.load().num_running) != 6 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert running == 6
        s.call.cancel()  # the router went away without a word
        await s.close()

    asyncio.run(run())
    prefill.wait_all_blocks_free()
    report = decode.wait_all_blocks_free()
    assert report.num_running == 0 and report.num_free_blocks == report.num_total_blocks


def test_batched_starts_and_cancels_equal_single_messages(pair, colocated):
    prefill, decode = pair
    prompts = [colocated.tokenizer.encode(t) for t in ("Paris is", "Count: one, two", "Hi")]
    refs = expected(colocated, prompts, MAX_TOKENS)

    async def run():
        s = Stream(decode, deltas=True)
        initial = await s.call.initial_metadata()
        s.outgoing.put_nowait(
            decode_pb2.GenerateStreamRequest(
                batch=[
                    _start("p0", prompts[0], prefill),
                    _start("p1", prompts[1]),
                    _start("long", prompts[2], prefill, max_tokens=4000, ignore_eos=True),
                ]
            )
        )
        await s.read_until(lambda s: "long" in s.tokens)
        cancel = decode_pb2.GenerateStreamRequest(cancel="long")
        s.outgoing.put_nowait(
            decode_pb2.GenerateStreamRequest(batch=[cancel, _start("p2", prompts[2], prefill)])
        )
        await s.read_until(lambda s: {"p0", "p1", "p2"} <= s.finals.keys())
        await s.close()
        return s, tuple(initial)

    s, initial = asyncio.run(run())
    assert ("x-pdserve-batched-requests", "1") in initial
    assert [s.tokens[r] for r in ("p0", "p1", "p2")] == refs
    assert "long" not in s.finals and "long" not in s.errors  # cancelled: nothing more
    prefill.wait_all_blocks_free()
    decode.wait_all_blocks_free()


@pytest.mark.parametrize("bad", ["kind and batch", "nested batch"])
def test_a_malformed_batch_ends_the_stream_with_invalid_argument(pair, colocated, bad):
    prefill, decode = pair
    start = _start("m0", colocated.tokenizer.encode("Hello"), prefill)
    if bad == "kind and batch":
        message = decode_pb2.GenerateStreamRequest(cancel="m0", batch=[start])
    else:
        inner = decode_pb2.GenerateStreamRequest(batch=[start])
        message = decode_pb2.GenerateStreamRequest(batch=[inner])

    async def run():
        s = Stream(decode)
        s.outgoing.put_nowait(message)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await s.read_until(lambda s: False, timeout=30)
        await s.close()
        return e.value

    error = asyncio.run(run())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "batch" in error.details()
    prefill.wait_all_blocks_free()
    decode.wait_all_blocks_free()
