"""Where each request's outputs go: a queue (or sink) on the event loop that opened
it. The engine's side (its thread, or the thread reading the engine process's pipe)
publishes; outputs reach a stream in the order they are published."""

from __future__ import annotations

import asyncio

from services.engine import RequestOutput


class OutputStreams:
    def __init__(self):
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}

    def open_stream(self, request_id: str, sink=None) -> asyncio.Queue:
        """Where request_id's outputs and errors go, on the calling event loop: a new
        queue, or `sink`, anything with put_nowait (the multiplexed stream turns each
        output into its response right there, without waking a task per request)."""
        q = asyncio.Queue() if sink is None else sink
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    def publish(self, out: RequestOutput) -> None:
        """Hand an output to its request's stream, from any thread. Outputs reach a
        stream in the order they are published."""
        target = self._streams.get(out.request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, out)

    def publish_step(self, outputs: list[RequestOutput]) -> None:
        """Hand one step's outputs to their streams with one wake-up per event loop (a
        wake-up per output is a syscall and a loop iteration each, per stream per
        token)."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                loop, q = target
                batches.setdefault(loop, []).append((q, out))
        for loop, items in batches.items():
            loop.call_soon_threadsafe(_deliver, items)

    def publish_error(self, request_id: str, error: BaseException) -> None:
        """Wake a request's stream with an error (from any thread)."""
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, error)

    def fail_streams(self, error: BaseException) -> None:
        """Wake every open stream with `error` (from any thread): the engine thread
        cannot be relied on to (e.g. stuck in a collective with a dead rank)."""
        for request_id in list(self._streams):
            self.publish_error(request_id, error)


def _deliver(items: list) -> None:
    for q, out in items:
        q.put_nowait(out)
