"""GenerateStream: many requests over one gRPC stream, answered once per engine step.

The router opens one such stream per decode worker and sends each request's start and
cancel on it. Outputs do not wake a task per request: the engine loop hands each step's
outputs to this stream's sinks, which write every request's news into the one message
going out next (the Outbox), so the host cost per token is building its protobuf and no
more. A request that fails ends with a GenerateStreamError carrying the status a unary
Generate would have ended with; the stream itself ends when the router half-closes and
its last request is done, and cancelling it (router gone) aborts every request on it.
A draining worker (SIGTERM) refuses new starts with UNAVAILABLE, so the router sends
them elsewhere, and ends the stream once its last request is done: an idle stream
does not hold the shutdown to its drain deadline.

The unary-stream Generate is the same lifecycle with an outbox of its own (serve_one):
one definition of admission, remote prefill, cancellation, errors and freeing."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from itertools import chain

import grpc

from pdpb.v1 import decode_pb2
from services.common.errors import EngineFailedError
from services.common.interceptor import status_of
from services.engine.output_deltas import News

log = logging.getLogger(__name__)

# a router that reads TokenDeltas says so in the GenerateStream call's metadata; one
# that does not (an older router during a rolling upgrade) gets GenerateResponses only
DELTAS_METADATA = ("x-pdserve-token-deltas", "1")
# this worker reads GenerateStreamRequest batches; it says so in its initial metadata,
# so a router sends batches only to a worker that reads them
BATCH_METADATA = ("x-pdserve-batched-requests", "1")

_MAX_RESPONSES_PER_MESSAGE = 4096  # a step's items are small; bounds one message


class _Columns:
    """One message's TokenDeltas while it is being filled: Python lists, turned into
    the message's columns once, when it is taken."""

    __slots__ = ("request_ids", "token_ids", "texts", "items")

    def __init__(self):
        self.request_ids: list[str] = []
        self.token_ids: list[list[int]] = []
        self.texts: list[str] = []
        self.items = 0  # the message's entries, responses and errors (its size bound)

    def write_into(self, deltas: decode_pb2.TokenDeltas) -> None:
        deltas.request_ids.extend(self.request_ids)
        deltas.token_counts.extend(map(len, self.token_ids))
        deltas.token_ids.extend(chain.from_iterable(self.token_ids))
        deltas.text = "".join(self.texts)
        deltas.text_lengths.extend(map(len, self.texts))


class Outbox:
    """The messages not yet written: responses appended in the order they happen.

    A request has at most one response waiting here: while the reader is behind (the
    gRPC write waits on flow control), a request's later news is merged into the
    response already waiting, as vLLM merges the outputs of a slow consumer. Each step
    then costs the router one response per request however far behind it is, instead of
    one per token, and falling behind does not compound.

    With `columns` (the router asked for TokenDeltas), a request's plain news (`delta`:
    tokens and text only) goes into its message's columns instead of a GenerateResponse
    of its own: appended to Python lists here and written as a few repeated fields when
    the message is taken. The reader reads a message's deltas before its responses, so
    a request's response (its last) may follow its delta in the same message."""

    def __init__(self, on_merge: Callable[[], None] | None = None, columns: bool = False):
        self._on_merge = on_merge  # counts merges (the worker's pdserve_merged_responses)
        self._columns_wanted = columns
        self._messages: list[decode_pb2.GenerateStreamResponse] = []
        self._columns: list[_Columns] = []  # one per message
        self._sealed = True  # the last message takes no more (start a new one)
        self._waiting: dict[str, decode_pb2.GenerateResponse] = {}  # request id -> unsent
        self._waiting_deltas: dict[str, tuple[_Columns, int]] = {}  # request id -> its entry
        self.ready = asyncio.Event()

    def response(
        self, request_id: str, token_ids: list[int] = (), text: str = ""
    ) -> decode_pb2.GenerateResponse:
        """This request's response with token_ids and text appended: the one still
        waiting to be written, or a new one in the next message, made with them in one
        call (setting each field after costs a third more per response, one response
        per request per step). The caller adds the rest (ResponseBuilder.fill)."""
        self.ready.set()
        resp = self._waiting.get(request_id)
        if resp is not None:
            if self._on_merge is not None:
                self._on_merge()
            if token_ids:
                resp.token_ids.extend(token_ids)
            if text:
                resp.text += text
            return resp
        message, _ = self._open()
        resp = self._waiting[request_id] = message.responses.add(
            request_id=request_id, token_ids=token_ids, text=text
        )
        return resp

    def delta(self, request_id: str, token_ids: list[int], text: str) -> None:
        """Plain news of a request, neither its first nor its last: a TokenDeltas entry
        where the reader takes columns (merged into the request's entry still waiting),
        else, or while a response of the request waits, its response."""
        if not self._columns_wanted or request_id in self._waiting:
            self.response(request_id, token_ids, text)
            return
        self.ready.set()
        entry = self._waiting_deltas.get(request_id)
        if entry is not None:
            if self._on_merge is not None:
                self._on_merge()
            columns, i = entry
            columns.token_ids[i] = columns.token_ids[i] + token_ids
            columns.texts[i] += text
            return
        _, columns = self._open()
        self._waiting_deltas[request_id] = (columns, len(columns.request_ids))
        columns.request_ids.append(request_id)
        columns.token_ids.append(token_ids)
        columns.texts.append(text)

    def error(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self.ready.set()
        # nothing joins a response before its error
        self._waiting.pop(request_id, None)
        self._waiting_deltas.pop(request_id, None)
        self._open()[0].errors.add(request_id=request_id, code=code.value[0], message=message)

    def seal(self) -> None:
        """Start a new message for what comes next (after a large first response)."""
        self._sealed = True

    def take(self) -> list[decode_pb2.GenerateStreamResponse]:
        self.ready.clear()
        for message, columns in zip(self._messages, self._columns):
            if columns.request_ids:
                columns.write_into(message.deltas)
        messages, self._messages, self._columns, self._sealed = self._messages, [], [], True
        self._waiting.clear()
        self._waiting_deltas.clear()
        return messages

    def _open(self) -> tuple[decode_pb2.GenerateStreamResponse, _Columns]:
        """The message that takes the next item (counted here)."""
        if self._sealed or self._columns[-1].items >= _MAX_RESPONSES_PER_MESSAGE:
            self._messages.append(decode_pb2.GenerateStreamResponse())
            self._columns.append(_Columns())
            self._sealed = False
        columns = self._columns[-1]
        columns.items += 1
        return self._messages[-1], columns


class OutboxSink:
    """One request's outputs (and errors) as responses in the outbox, on the event loop.
    Holds outputs back until the prompt's KV is in place (the builder's timings are set
    then); `done` resolves when the request has sent its last response."""

    def __init__(self, builder, outbox: Outbox):
        self.builder = builder
        self.outbox = outbox
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self._pending: list | None = []

    def put_nowait(self, item) -> None:
        if self._pending is not None:
            self._pending.append(item)
        else:
            self._take(item)

    def start(self) -> None:
        pending, self._pending = self._pending or [], None
        for item in pending:
            self._take(item)

    def _take(self, item) -> None:
        if self.done.done():
            return
        if item.__class__ is News:  # the usual item: first
            sent = self.builder.sent_tokens
            if sent and item.num_token_ids - len(item.new_token_ids) == sent:
                self.builder.fill_news(item, self.outbox)
            else:
                # news carries only what is new: one out of its place would lose or
                # resend tokens, so fail the request
                self.done.set_exception(
                    RuntimeError(
                        f"news of tokens {item.num_token_ids - len(item.new_token_ids)}.."
                        f"{item.num_token_ids} arrived after {sent} were sent"
                    )
                )
        elif isinstance(item, asyncio.CancelledError):  # Abort()
            self.builder.fill_aborted(self.outbox)
            self.done.set_result(False)
        elif isinstance(item, BaseException):
            error = EngineFailedError(f"engine failed: {item}")
            error.__cause__ = item
            self.done.set_exception(error)
        elif item.output.num_token_ids < self.builder.sent_tokens:
            # outputs reach a stream in the order published (EngineLoop.publish): one
            # that goes back would resend tokens the client has, so fail the request
            self.done.set_exception(
                RuntimeError(
                    f"an output with {item.output.num_token_ids} tokens arrived after "
                    f"{self.builder.sent_tokens} were sent"
                )
            )
        else:
            first = self.builder.sent_tokens == 0
            self.builder.fill(item, self.outbox)
            if first and (item.prompt_logprobs is not None or self.builder.request.return_prompt):
                self.outbox.seal()  # a first response can be large: let it go alone
            if item.finished:
                self.done.set_result(True)


async def serve_one(generate, request, on_merge: Callable[[], None] | None = None):
    """Generate: one request on its own stream, run by the same lifecycle as each of
    GenerateStream's (`generate(request, outbox)`). Its responses are yielded one by one
    as they come; its error is raised after them, for the interceptor to turn into the
    call's status. Cancelling the call (caller gone, its deadline) cancels the request,
    whose own `finally` frees its blocks before the call ends."""
    outbox = Outbox(on_merge)
    task = asyncio.create_task(generate(request, outbox), name=f"generate/{request.request_id}")
    task.add_done_callback(lambda _: outbox.ready.set())
    try:
        while True:
            await outbox.ready.wait()
            ended = task.done()  # before taking: see MuxSession.serve
            for message in outbox.take():
                for response in message.responses:
                    yield response
            if ended:
                task.result()
                return
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class MuxSession:
    """One GenerateStream call. `generate(start, outbox)` is the servicer's request
    lifecycle, writing into the outbox through an OutboxSink; `columns`: the router
    reads TokenDeltas (it said so in the call's metadata, DELTAS_METADATA)."""

    def __init__(self, generate, on_merge: Callable[[], None] | None = None, columns: bool = False):
        self._generate = generate
        self.outbox = Outbox(on_merge, columns)
        self.tasks: dict[str, asyncio.Task] = {}
        self.draining = False

    def drain(self) -> None:
        """The worker is stopping: no new requests; end once the last one is done."""
        self.draining = True
        self.outbox.ready.set()

    async def serve(self, request_iterator):
        reader = asyncio.create_task(self._read(request_iterator))
        reader.add_done_callback(lambda _: self.outbox.ready.set())
        try:
            while True:
                await self.outbox.ready.wait()
                # decided before taking: a request that ends while a message is being
                # written leaves its last responses in the outbox for the next round
                ended = reader.done() and (reader.exception() is not None or not self.tasks)
                drained = self.draining and not self.tasks
                for message in self.outbox.take():
                    yield message
                if ended:
                    reader.result()  # a malformed request ends the call with its error
                    return
                if drained:
                    return
        finally:
            reader.cancel()
            tasks = [reader, *self.tasks.values()]
            for task in tasks:
                task.cancel()
            # each request's own `finally` frees its blocks before the call ends
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _read(self, request_iterator) -> None:
        async for message in request_iterator:
            if not message.batch:
                self._handle(message)
                continue
            if message.WhichOneof("kind") is not None:
                raise ValueError("a GenerateStreamRequest has a batch or a kind, not both")
            for entry in message.batch:
                if entry.batch:
                    raise ValueError("a GenerateStreamRequest batch holds no batches")
                self._handle(entry)

    def _handle(self, message) -> None:
        kind = message.WhichOneof("kind")
        if kind == "start":
            self._start(message.start, message.timeout_seconds)
        elif kind == "cancel":
            task = self.tasks.get(message.cancel)
            if task is not None:
                task.cancel()
        else:
            raise ValueError("a GenerateStreamRequest needs start or cancel")

    def _start(self, start, timeout_s: float) -> None:
        rid = start.request_id
        if self.draining:
            self.outbox.error(
                rid, grpc.StatusCode.UNAVAILABLE, "the worker is shutting down (draining)"
            )
            return
        if rid in self.tasks:
            self.outbox.error(
                rid, grpc.StatusCode.ALREADY_EXISTS, f"request {rid} is in flight on this stream"
            )
            return
        task = asyncio.create_task(self._request(start, timeout_s), name=f"mux/{rid}")
        self.tasks[rid] = task

        def finished(_, rid=rid, task=task):
            if self.tasks.get(rid) is task:
                del self.tasks[rid]
            self.outbox.ready.set()

        task.add_done_callback(finished)

    async def _request(self, start, timeout_s: float) -> None:
        rid = start.request_id
        deadline = asyncio.timeout(timeout_s if timeout_s > 0 else None)
        try:
            async with deadline:
                await self._generate(start, self.outbox)
        except TimeoutError as e:
            if deadline.expired():
                self.outbox.error(rid, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
            else:
                self._fail(rid, e)
        except Exception as e:
            self._fail(rid, e)

    def _fail(self, rid: str, error: Exception) -> None:
        code = status_of(error)
        if code == grpc.StatusCode.INTERNAL:
            log.error("GenerateStream failed for request %r", rid, exc_info=error)
            message = f"internal error ({type(error).__name__}): {error}"
        else:
            message = str(error)
        self.outbox.error(rid, code, message)
