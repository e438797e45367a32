"""The router's side of GenerateStream: every request this router sends one decode
worker shares one gRPC stream, which the worker answers with one message per engine
step (services/decode/mux.py). A request reads its responses from its own queue and
fails like a unary Generate would (WorkerCallError carries the same status code), so
dispatch.py treats both alike.

A request can hand its responses straight to a sink (`stream_to`): the stream's
reader then passes each one on as it parses it, without waking the request's own task
for every token (the router's dispatch does so from the start, so even the first token
goes to the client without that wake-up); errors and the end still reach that task.

The stream opens on the first request and again after it breaks: a broken stream (the
worker died or restarted, the channel closed) ends every request on it with its status,
and the next request opens a new one. Leaving a request early sends its cancel, and the
worker aborts it and frees its blocks."""

from __future__ import annotations

import asyncio
from collections import deque

import grpc

from pdpb.v1 import decode_pb2

_CODES = {code.value[0]: code for code in grpc.StatusCode}
_CLOSE = object()  # ends the request iterator: the router half-closes the stream
_FINISHED = object()  # a request's last response went to its sink: its iteration ends
# this router reads TokenDeltas (services/decode/mux.py's DELTAS_METADATA)
_METADATA = (("x-pdserve-mux", "1"), ("x-pdserve-token-deltas", "1"))
# a worker that reads batched requests says so in its initial metadata (BATCH_METADATA)
_BATCH_METADATA = ("x-pdserve-batched-requests", "1")
# a batch holds at most this many serialized bytes, unless its first message alone
# is larger (the worker takes 64 MB messages)
_MAX_BATCH_BYTES = 4 << 20


class WorkerCallError(Exception):
    """A request ended with a status: the worker's, the stream's, or its deadline."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class MalformedDeltas(Exception):
    """A TokenDeltas message whose columns do not add up (a worker bug)."""


class TokenDelta:
    """A request's entry of a TokenDeltas message: reads like the GenerateResponse it
    stands for, one with new tokens and text and nothing else (the worker never sends a
    request's first or last response, or one with logprobs, as a delta)."""

    __slots__ = ("token_ids", "text")
    finish_reason = 0
    logprobs = ()
    prompt_token_ids = ()
    prompt_logprobs = ()
    prompt_text = ""

    def __init__(self, token_ids: list[int], text: str):
        self.token_ids = token_ids
        self.text = text

    def HasField(self, name: str) -> bool:  # noqa: N802 (the protobuf method's name)
        return False

    def WhichOneof(self, name: str) -> None:  # noqa: N802
        return None


class _Outgoing:
    """The stream's requests, as gRPC reads them. An iterator object, not an async
    generator: one left suspended when the call ends is dropped without a finalizer
    running on a loop that may be closed by then.

    gRPC writes one message at a time and each write costs the router's event loop
    about as much as the rest of a request's start (docs/performance.md, issue 20), so
    to a worker that reads batches, whatever queued up meanwhile goes as one message."""

    def __init__(self, queue: asyncio.Queue):
        self._queue = queue
        self.batching = False  # set once the worker's initial metadata says it may
        self.batches = 0  # messages that carried a batch
        self._closing = False
        self._held = None  # a message that did not fit the last batch: the next one's first

    def __aiter__(self):
        return self

    async def __anext__(self):
        message, self._held = self._held, None
        if message is None:
            if self._closing:
                raise StopAsyncIteration
            message = await self._queue.get()
            if message is _CLOSE:
                raise StopAsyncIteration
        queue = self._queue
        if not self.batching or queue.empty():
            return message
        batch, size = [message], message.ByteSize()
        while not queue.empty():
            more = queue.get_nowait()
            if more is _CLOSE:
                self._closing = True  # after this batch
                break
            more_size = more.ByteSize()
            if size + more_size > _MAX_BATCH_BYTES:
                # the next message starts the next batch: a batch is never larger than
                # the cap or its first message, whichever is more (the worker's limit
                # holds for every message a single request would have sent)
                self._held = more
                break
            batch.append(more)
            size += more_size
        if len(batch) == 1:
            return message
        self.batches += 1
        return decode_pb2.GenerateStreamRequest(batch=batch)


class _Session:
    """One GenerateStream call and the requests on it."""

    def __init__(self, stub, metadata):
        self.outgoing: asyncio.Queue = asyncio.Queue()
        self.requests: dict[str, MuxedRequest] = {}
        self._writer = _Outgoing(self.outgoing)
        self.call = stub.GenerateStream(self._writer, metadata=metadata)
        self.closed: WorkerCallError | None = None
        self.reader = asyncio.create_task(self._read(), name="generate-stream")

    async def _read(self) -> None:
        error = WorkerCallError(grpc.StatusCode.CANCELLED, "the router closed the stream")
        try:
            # an older worker sends it with its first response, not at once: until
            # then, requests go one per message
            initial = await self.call.initial_metadata()
            self._writer.batching = _BATCH_METADATA in tuple(initial or ())
            async for message in self.call:
                if message.deltas.request_ids:
                    self._read_deltas(message.deltas)
                for resp in message.responses:
                    r = self.requests.get(resp.request_id)
                    if r is not None:
                        r.deliver(resp)
                for err in message.errors:
                    r = self.requests.get(err.request_id)
                    if r is not None:
                        code = _CODES.get(err.code, grpc.StatusCode.UNKNOWN)
                        r.deliver(WorkerCallError(code, err.message))
            error = WorkerCallError(grpc.StatusCode.UNAVAILABLE, "the worker ended the stream")
        except grpc.aio.AioRpcError as e:
            error = WorkerCallError(e.code(), e.details() or "")
        except MalformedDeltas as e:
            error = WorkerCallError(grpc.StatusCode.INTERNAL, str(e))
        finally:
            self.close(error)

    def _read_deltas(self, deltas: decode_pb2.TokenDeltas) -> None:
        """Each request's entry of the columns, as a TokenDelta, in order."""
        rids, counts, lengths = deltas.request_ids, deltas.token_counts, deltas.text_lengths
        token_ids, text = list(deltas.token_ids), deltas.text
        if not (
            len(rids) == len(counts) == len(lengths)
            and sum(counts) == len(token_ids)
            and sum(lengths) == len(text)
        ):
            raise MalformedDeltas(
                f"malformed TokenDeltas from the worker: {len(rids)} request ids, "
                f"{len(counts)} token counts summing to {sum(counts)} for "
                f"{len(token_ids)} tokens, {len(lengths)} text lengths summing to "
                f"{sum(lengths)} for {len(text)} characters"
            )
        requests = self.requests
        t = c = 0
        for rid, n, length in zip(rids, counts, lengths):
            r = requests.get(rid)
            if r is not None:
                r.deliver(TokenDelta(token_ids[t : t + n], text[c : c + length]))
            t += n
            c += length

    def close(self, error: WorkerCallError | None) -> None:
        """No new requests here; the ones on it end with `error`."""
        self.closed = error or WorkerCallError(grpc.StatusCode.UNAVAILABLE, "stream closed")
        self.outgoing.put_nowait(_CLOSE)  # ends gRPC's task reading our requests
        for r in self.requests.values():
            r.deliver(self.closed)
        self.requests.clear()


class DecodeMux:
    """One worker's shared stream, opened on demand."""

    def __init__(self, stub):
        self._stub = stub
        self._session: _Session | None = None

    def open(self, gen: decode_pb2.GenerateRequest, timeout: float) -> MuxedRequest:
        session = self._session
        if session is None or session.closed is not None:
            session = self._session = _Session(self._stub, _METADATA)
        return MuxedRequest(session, gen, timeout)

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            session.outgoing.put_nowait(_CLOSE)
            session.call.cancel()
            await asyncio.gather(session.reader, return_exceptions=True)


class MuxedRequest:
    """`async for resp in request` until its last response; raises WorkerCallError.
    `cancel()` (always call it, like a unary call's) tells the worker to drop it.
    `stream_to(sink)`: the responses after those already read go to sink(resp) as they
    arrive, in order, the last one included; the iteration then yields nothing more
    and ends after the last response (or raises the error)."""

    def __init__(self, session: _Session, gen, timeout: float):
        self._session = session
        self._rid = gen.request_id
        self._items: deque = deque()  # responses and errors for the iteration
        self._waiter: asyncio.Future | None = None
        self._sink = None
        self._finished = False
        self.completed = False  # the last response arrived (through the sink or not)
        # one timer per request, not a timeout per response: at the deadline the
        # request's queue gets the error, after whatever already arrived
        self._timer = asyncio.get_running_loop().call_later(max(0.0, timeout), self._expire)
        session.requests[self._rid] = self
        session.outgoing.put_nowait(
            decode_pb2.GenerateStreamRequest(start=gen, timeout_seconds=timeout)
        )

    def __aiter__(self):
        return self

    async def __anext__(self) -> decode_pb2.GenerateResponse:
        if self._finished:
            raise StopAsyncIteration
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self._items.popleft()
        if isinstance(item, WorkerCallError):
            self._end()
            raise item
        if item is _FINISHED:
            self.completed = True
            self._end()
            raise StopAsyncIteration
        if item.finish_reason:
            self.completed = True
            self._end()
        return item

    def deliver(self, item) -> None:
        """A response or a WorkerCallError for this request, from the stream."""
        if self._sink is not None and not isinstance(item, WorkerCallError):
            self._sink(item)
            if item.finish_reason:
                self._put(_FINISHED)
        else:
            self._put(item)

    def _put(self, item) -> None:
        if isinstance(item, WorkerCallError) or item is _FINISHED:
            # nothing passes the end: a response after it (one the worker sent as the
            # router's deadline fired) stays unread, as it would without a sink
            self._sink = None
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def stream_to(self, sink) -> None:
        """From now on responses go to sink(resp). Those already queued go first, in
        order, up to an error, which stays queued for the iteration to raise; nothing
        is passed on after an error or the last response."""
        items = self._items
        while items:
            if isinstance(items[0], WorkerCallError) or items[0] is _FINISHED:
                return  # the iteration ends there; nothing after it is passed on
            item = items.popleft()
            sink(item)
            if item.finish_reason:
                self._put(_FINISHED)
                return
        if not self._finished:
            self._sink = sink

    def cancel(self) -> None:
        session = self._session
        if session.requests.pop(self._rid, None) is not None and not self._finished:
            if session.closed is None:
                session.outgoing.put_nowait(decode_pb2.GenerateStreamRequest(cancel=self._rid))
        self._end()

    def _expire(self) -> None:
        if not self._finished:
            self._put(WorkerCallError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"))

    def _end(self) -> None:
        self._finished = True
        self._timer.cancel()
