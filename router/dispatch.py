"""Sending one request's choices to workers: pair choice, retries, cancellation.

Each choice (prompt x n) runs as its own task that picks a (decode, prefill) pair,
sends it over the decode worker's shared GenerateStream (mux.py) and puts the
responses into a queue the HTTP handler reads. A worker that fails before the choice's
first token is replaced by another pair (up to max_retries times); after the first
token the failure ends the choice with an error. Leaving the run (finished, failed or
the client went away) cancels every task, which cancels its request on the stream, so
the workers abort it and free its blocks."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import grpc

from pdpb.v1 import decode_pb2
from router import structured
from router.errors import RETRYABLE, APIError, from_grpc, unavailable
from router.metrics import RouterMetrics
from router.mux import WorkerCallError
from router.pairing import Avoid, choose_pair
from router.policies import make_policy
from router.protocol import GenerationRequest
from router.registry import Worker, WorkerRegistry
from router.request_id import RequestLog
from router.responses import FINISH_REASONS

_EVENT_MARGIN_S = 5.0
_OVERDUE = object()  # queued by the run's timer when it is past its deadline + margin


@dataclass
class Event:
    index: int
    resp: decode_pb2.GenerateResponse | None = None
    error: APIError | None = None
    decode: Worker | None = None
    prefill: Worker | None = None


class Dispatcher:
    def __init__(self, registry: WorkerRegistry, metrics: RouterMetrics):
        self.registry = registry
        self.config = registry.config
        self.metrics = metrics
        self.decode_policy = make_policy(self.config.decode_policy)
        self.prefill_policy = make_policy(self.config.prefill_policy)
        self._active: set[str] = set()  # worker-side request ids in flight

    def run(
        self,
        req: GenerationRequest,
        request_id: str,
        log: RequestLog,
        worker_model: str | None,
        model_name: str = "",
    ) -> GenerationRun:
        return GenerationRun(self, req, request_id, log, worker_model, model_name)


class GenerationRun:
    """`async with dispatcher.run(...) as run: async for event in run.events(): ...`"""

    def __init__(self, dispatcher, req, request_id, log, worker_model, model_name=""):
        self.d = dispatcher
        self.model_name = model_name  # the vllm: metrics' model_name label
        self.last_token_at: dict[int, float] = {}
        self.req = req
        self.request_id = request_id
        self.log = log
        self.worker_model = worker_model
        self.started_at = time.monotonic()
        self.deadline = self.started_at + dispatcher.config.request_timeout
        # unbounded: the decode streams' reader puts into it synchronously (mux.py's
        # stream_to); a request holds at most its own tokens' responses
        self.queue: asyncio.Queue[Event] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.first_token_at: dict[int, float] = {}
        self._itl = None  # the inter-token latency histogram's child for model_name
        self._overdue = False
        self._timer: asyncio.TimerHandle | None = None
        self.pairs: dict[int, str] = {}  # choice -> "decode<-prefill" of its last attempt
        # A client may reuse an X-Request-Id; worker-side ids must be unique.
        base = request_id
        if base in dispatcher._active:
            base = f"{request_id}.{uuid.uuid4().hex[:8]}"
        self.base_id = base

    async def __aenter__(self) -> GenerationRun:
        self.d._active.add(self.base_id)
        # one timer for the run, not a timeout per event (a task and a timer per token)
        self._timer = asyncio.get_running_loop().call_at(
            self.deadline + _EVENT_MARGIN_S, self._past_deadline
        )
        self.tasks = [
            asyncio.create_task(self._guarded_choice(i), name=f"{self.request_id}/{i}")
            for i in range(self.req.num_choices)
        ]
        return self

    async def _guarded_choice(self, index: int) -> None:
        """A choice always ends with an event: an exception in it (a value the worker
        request cannot hold, a bug) ends the choice with an error instead of leaving
        events() waiting for it."""
        try:
            await self._choice(index)
        except asyncio.CancelledError:
            raise
        except (ValueError, TypeError) as e:  # building the worker request refused a value
            self.log.warning("choice %d: the worker request cannot be built: %s", index, e)
            await self.queue.put(Event(index, error=APIError(400, f"invalid request: {e}")))
        except Exception:
            self.log.exception("choice %d failed inside the router", index)
            await self.queue.put(
                Event(index, error=APIError(500, f"internal router error ({self.request_id})"))
            )

    def _past_deadline(self) -> None:
        self._overdue = True
        if self.queue.empty():  # wake events() if it waits; else it sees the flag
            self.queue.put_nowait(_OVERDUE)

    def has_event(self) -> bool:
        """Whether events() has its next event at hand (a writer may batch until not)."""
        return not self.queue.empty()

    async def __aexit__(self, *exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.d._active.discard(self.base_id)

    async def events(self):
        """Every choice's responses and errors, as they come, until all have ended."""
        left = self.req.num_choices
        while left:
            # every choice ends by the request deadline (its gRPC call carries it); the
            # margin only guards against a choice that never reports, which is a bug:
            # past it, what has arrived is still passed on, then the run ends
            if self._overdue and self.queue.empty():
                self.log.error("%d choice(s) never reported by the request deadline", left)
                yield Event(
                    -1,
                    error=unavailable(
                        f"the request did not complete within {self.d.config.request_timeout:g}s"
                    ),
                )
                return
            ev = await self.queue.get()
            if ev is _OVERDUE:
                continue
            now = time.monotonic()
            if ev.resp is not None:
                self._observe_tokens(ev.index, ev.resp, now)
            if ev.error is not None or ev.resp.finish_reason:
                left -= 1
                if ev.resp is not None:
                    self._observe_final(ev.index, ev.resp, now)
            yield ev
        e2e = time.monotonic() - self.started_at
        self.d.metrics.e2e.observe(e2e)
        self.d.metrics.vllm.e2e.labels(self.model_name).observe(e2e)

    def _observe_tokens(self, index: int, resp, now: float) -> None:
        vllm = self.d.metrics.vllm
        if index not in self.first_token_at:
            self.first_token_at[index] = now
            self.d.metrics.ttft.observe(now - self.started_at)
            vllm.ttft.labels(self.model_name).observe(now - self.started_at)
        elif resp.token_ids:
            # a response may carry several tokens: each gets an equal share of the gap
            n = len(resp.token_ids)
            itl = self._itl
            if itl is None:  # the labelled child, looked up once per request
                itl = self._itl = vllm.itl.labels(self.model_name)
            for _ in range(n):
                itl.observe((now - self.last_token_at[index]) / n)
        if resp.token_ids:
            self.last_token_at[index] = now

    def _observe_final(self, index: int, resp, now: float) -> None:
        m = self.d.metrics
        usage = resp.usage
        m.generation_tokens.inc(usage.completion_tokens)
        vllm, name = m.vllm, self.model_name
        vllm.generation_tokens.labels(name).inc(usage.completion_tokens)
        vllm.success.labels(name, FINISH_REASONS.get(resp.finish_reason, "stop")).inc()
        if index % self.req.n == 0:
            m.prompt_tokens.inc(usage.prompt_tokens)
            vllm.prompt_tokens.labels(name).inc(usage.prompt_tokens)
        if usage.completion_tokens > 1:
            m.tpot.observe((now - self.first_token_at[index]) / (usage.completion_tokens - 1))
        if resp.HasField("timings"):
            m.observe_timings(resp.timings)

    def _worker_id(self, index: int, attempt: int) -> str:
        rid = self.base_id if self.req.num_choices == 1 else f"{self.base_id}-{index}"
        return rid if attempt == 0 else f"{rid}-r{attempt}"

    async def _choice(self, index: int) -> None:
        req, cfg, registry = self.req, self.d.config, self.d.registry
        prompt = req.prompts[index // req.n]
        key = prompt.prefix_key()
        avoid = Avoid()
        error: APIError | None = None
        for attempt in range(cfg.max_retries + 1):
            pair = choose_pair(
                registry.usable_pairs(self.worker_model),
                key,
                self.d.decode_policy,
                self.d.prefill_policy,
                avoid,
            )
            if pair is None:
                error = error or unavailable(
                    "no healthy decode worker is available"
                    if registry.colocated
                    else "no healthy pair of prefill and decode workers is available"
                )
                break
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                break
            decode, prefill = pair
            gen = decode_pb2.GenerateRequest(
                request_id=self._worker_id(index, attempt),
                sampling_params=req.sampling_params(index),
                prefill_address=prefill.address,
                # the prompt's ids: echo of a token-id prompt, and its length for
                # continuous usage stats
                return_prompt=(req.echo and prompt.text is None) or req.continuous_usage,
                **prompt.to_pb_fields(),
            )
            code, details, started = await self._attempt(index, gen, decode, prefill, remaining)
            if code is None:
                return
            self.log.warning(
                "choice %d attempt %d on decode %s / prefill %s failed: %s: %s",
                index,
                attempt,
                decode.address,
                prefill.address or "local",
                code.name,
                details,
            )
            if code == grpc.StatusCode.UNAVAILABLE:
                registry.kick()  # is the worker gone? find out now, not at the next probe
            error = structured.name_field(
                from_grpc(code, details, cfg.retry_after), details, req.structured_param
            )
            if started or code not in RETRYABLE:
                break
            avoid.add(decode.address, prefill.address)
            if attempt < cfg.max_retries:
                self.d.metrics.retries.labels(code.name).inc()
        if error is None or (time.monotonic() >= self.deadline and error.status == 503):
            error = unavailable(
                f"the request did not complete within {cfg.request_timeout:g}s"
                + (f" ({error.message})" if error else "")
            )
        await self.queue.put(Event(index, error=error))

    async def _attempt(self, index, gen, decode: Worker, prefill: Worker, timeout: float):
        """One Generate call. Returns (None, "", True) when the choice finished, else the
        failure (code, details, whether a token was already passed on)."""
        self.pairs[index] = f"{decode.address}<-{prefill.address or 'local'}"
        self.log.debug(
            "choice %d -> decode %s, prefill %s (worker request id %s)",
            index,
            decode.address,
            prefill.address or "local",
            gen.request_id,
        )
        metrics = self.d.metrics
        metrics.worker_started(decode)
        metrics.worker_started(prefill)
        prefilling = True
        started = False
        call = decode.mux.open(gen, timeout)

        def passed_on(resp) -> None:
            # called by the stream's reader as it parses each response (mux.py), the first
            # included: no wake-up of this task per token, none before the first
            nonlocal prefilling, started
            if prefilling:
                metrics.worker_done(prefill)
                prefilling = False
            started = True
            self.queue.put_nowait(Event(index, resp=resp, decode=decode, prefill=prefill))

        call.stream_to(passed_on)
        try:
            async for _ in call:  # only the end or an error: the responses went to passed_on
                pass
            if call.completed:
                return None, "", True
            return grpc.StatusCode.UNAVAILABLE, "the worker ended the stream unfinished", started
        except (grpc.aio.AioRpcError, WorkerCallError) as e:
            return e.code(), e.details(), started
        finally:
            call.cancel()
            metrics.worker_done(decode)
            if prefilling:
                metrics.worker_done(prefill)
