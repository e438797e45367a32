"""Runs an LLMEngine on its own thread and lets asyncio code talk to it.

The engine is not thread-safe, so every call into it (add, abort, reserve, admit)
runs on the engine thread between steps. Outputs go back to the event loop through
one asyncio.Queue (or sink) per request (output_streams.py)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from services.common.output_streams import OutputStreams
from services.engine import LLMEngine, RequestOutput
from services.engine.kv_audit import KVAudit

log = logging.getLogger(__name__)

# The leak audit runs on the engine thread between steps this often; GetLoad reports the
# latest one and never waits for a step (a probe waiting for a long step on a starved
# host timed out, and the router took a live worker out of its pool).
AUDIT_INTERVAL_S = 1.0


class EngineLoop(OutputStreams):
    def __init__(self, engine: LLMEngine):
        super().__init__()
        self.engine = engine
        self._commands: queue.Queue[tuple[Callable[[], Any], concurrent.futures.Future]] = (
            queue.Queue()
        )
        self._stop = threading.Event()
        self._closed = False  # the engine thread has ended: it runs no more commands
        self._closing = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.last_audit = KVAudit(0, 0.0)
        self._audited_at = float("-inf")

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._commands.put((lambda: None, concurrent.futures.Future()))
        self._thread.join(timeout)

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn() on the engine thread; its exception is re-raised here. If the caller
        is cancelled before the engine thread gets to it, fn does not run."""
        return await asyncio.wrap_future(self._submit(fn))

    async def call_always(self, fn: Callable[[], Any]) -> Any:
        """Like call(), but fn runs even if the caller is cancelled while waiting:
        for cleanup (freeing blocks) in `finally` blocks of cancellable handlers."""
        return await asyncio.shield(asyncio.wrap_future(self._submit(fn)))

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._closing:
            if self._closed:
                # nothing would ever run it: a caller waiting on it (a handler's cleanup
                # at shutdown) would hang the process's exit
                future.set_exception(RuntimeError("the engine loop has stopped"))
            else:
                self._commands.put((fn, future))
        return future

    async def call_and_publish(self, fn: Callable[[], RequestOutput]) -> RequestOutput:
        """Run fn() on the engine thread and publish the output it returns from there,
        ahead of every later step's outputs. Published after the await instead, it could
        reach the stream behind steps that ran while the caller waited to resume (a
        remote prefill's first token behind the next three: the stream then rewound
        and sent those three again)."""

        def run() -> RequestOutput:
            out = fn()
            self.publish(out)
            return out

        return await self.call(run)

    # -- the engine's commands: what the services ask of it, by name --------------------

    async def add_request(self, key: str, prompt_ids: list[int], params) -> None:
        engine = self.engine
        await self.call(lambda: engine.add_request(key, prompt_ids, params))

    async def abort_request(self, key: str) -> bool:
        """Abort() on a request: False if the engine does not hold it."""
        engine = self.engine
        return await self.call(lambda: engine.abort_request(key))

    async def free_request(self, key: str) -> None:
        """Whatever the request still holds is freed (a prefilled sequence's blocks are
        released, full ones kept as prefix cache); runs even if the caller is cancelled
        while it waits: the `finally` of every request's handler."""
        engine = self.engine
        await self.call_always(lambda: engine.release(key) or engine.abort_request(key))

    async def reserve_remote_kv(self, key: str, prompt_ids: list[int], params):
        engine = self.engine
        return await self.call(lambda: engine.reserve_remote_kv(key, prompt_ids, params))

    async def admit_remote(self, key: str, first_token_id: int, first_logprob, prompt_logprobs):
        """The prompt's KV arrived: the request decodes from its first token, whose
        output reaches the stream ahead of any later step's."""
        engine = self.engine
        return await self.call_and_publish(
            lambda: engine.admit_remote(key, first_token_id, first_logprob, prompt_logprobs)
        )

    async def prefill_locally(self, key: str) -> None:
        engine = self.engine
        await self.call(lambda: engine.prefill_locally(key))

    async def kv_audit(self) -> KVAudit:
        return await self.call(self.engine.kv_audit)

    async def load(self) -> tuple[dict, KVAudit]:
        """Counters and KV audit for GetLoad: while the engine steps, the engine
        thread's latest audit (at most ~1 s old; waiting for the step in progress made
        probes time out on a starved host); idle, exact and answered at once."""
        stats = self.engine.stats()
        if self.engine.has_unfinished_requests():
            return stats, self.last_audit
        return stats, await self.kv_audit()

    def _run(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished_requests()
            self._drain_commands(block)
            self._audit_now_and_then()
            if self._stop.is_set() or not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a broken step must not kill the worker silently
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            self.publish_step(outputs)
        # stopped: run what was asked before (cleanup that frees blocks), refuse the rest
        with self._closing:
            self._closed = True
        self._drain_commands(block=False)

    def _audit_now_and_then(self) -> None:
        now = time.monotonic()
        if now - self._audited_at >= AUDIT_INTERVAL_S:
            try:
                self.last_audit = self.engine.kv_audit()
            except Exception:  # the audit must never take the engine loop down
                log.exception("KV audit failed")
            self._audited_at = now

    def _drain_commands(self, block: bool) -> None:
        try:
            item = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as e:
                    future.set_exception(e)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            self.publish_error(request_id, error)
