"""The worker's end of its engine process (engine_core.py): the same commands and
streams as EngineLoop, so the services do not know which one runs their engine.

A thread reads the pipe: each step's deltas become RequestOutputs again
(output_deltas.py) and go to their streams with one wake-up per event loop; replies
resolve their callers' futures on the same loop, after any output sent before them.
If the engine process ends unasked (killed, crashed, a tensor-parallel rank died),
every stream and waiting call fails with WorkerFailed and `on_death` takes the worker
down, as a dead rank does in-process."""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import multiprocessing
import threading
from collections.abc import Callable

from kvtransfer import KVAgentInfo
from services.common.engine_core import run as run_engine_core
from services.common.errors import WorkerFailed
from services.common.output_streams import OutputStreams
from services.engine import EngineConfig
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.kv_audit import KVAudit
from services.engine.output_deltas import DeltaDecoder, engine_makes_text
from services.engine.request_checks import RequestChecks
from services.engine.structured import Grammars
from services.models.loader import load_hf_config, resolve_model_path
from services.models.tokenizer import eos_token_ids, load_tokenizer

log = logging.getLogger(__name__)
_STOP_TIMEOUT_S = 10.0
LOAD_WAIT_S = 0.25


class EngineCoreClient(OutputStreams):
    def __init__(self, engine_config: EngineConfig, settings, on_death, on_gc_pause=None):
        """on_death(reason): the engine process ended unasked (from the reader thread).
        on_gc_pause(generation, seconds): each of its collector's pauses, reported about
        once a second."""
        super().__init__()
        self._config = engine_config
        self._settings = settings
        self._on_death = on_death
        self._on_gc_pause = on_gc_pause
        self._process = None
        self._conn = None
        self._send_lock = threading.Lock()
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._ids = itertools.count()
        self._decoder = DeltaDecoder()
        self._tokenizer = None  # detokenizes requests without stop strings (use_tokenizer)
        self.num_detokenizer_fallbacks = 0
        self._status: dict | None = None  # the engine process's latest status report
        self._stopping = False
        self.kv: EngineProcessKV | None = None

    # -- life -----------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the engine process; it loads while the caller does its own start-up
        (wait_ready() then waits for it)."""
        mp = multiprocessing.get_context("spawn")
        ours, theirs = mp.Pipe()
        # not a daemon: its tensor-parallel ranks are processes of its own
        self._process = mp.Process(
            target=run_engine_core,
            args=(theirs, self._config, self._settings, logging.getLogger().level),
            name="pdserve-engine-core",
        )
        self._process.start()
        theirs.close()
        self._conn = ours

    def wait_ready(self) -> dict:
        """Blocking: wait until the spawned engine is ready; returns what it reported
        (phases, warmup, max_model_len, ...)."""
        ours = self._conn
        try:
            message = ours.recv()
        except EOFError:
            self._process.join(5)
            raise RuntimeError(
                f"the engine process exited (code {self._process.exitcode}) while starting"
            ) from None
        if message[0] == "failed":
            log.error("engine process start-up failed:\n%s", message[2])
            self._process.join(10)
            raise RuntimeError(f"the engine process failed to start: {message[1]}")
        ready = message[1]
        agents = [KVAgentInfo.from_dict(a) for a in ready["rank_agents"]]
        self.kv = EngineProcessKV(self, agents)
        threading.Thread(target=self._read, name="engine-core-reader", daemon=True).start()
        log.info("engine process %d ready", self._process.pid)
        return ready

    def stop(self, timeout: float = _STOP_TIMEOUT_S) -> None:
        """What was sent before runs (cleanup that frees blocks); then it ends."""
        self._stopping = True
        if self._process is None:
            return
        try:
            self._send(("call", -1, "stop", ()))
        except WorkerFailed:
            pass
        self._process.join(timeout)
        if self._process.is_alive():
            log.warning("the engine process did not stop within %.0fs: terminating it", timeout)
            self._process.kill()
            self._process.join(5)
        self._conn.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    # -- the engine's commands (EngineLoop's, by name) -----------------------------------

    def use_tokenizer(self, tokenizer) -> None:
        """The worker's tokenizer: the text of a request without stop strings is made
        here, off the engine's step (output_deltas.py)."""
        self._tokenizer = tokenizer

    def _expect(self, key: str, params) -> None:
        if self._tokenizer is not None and not engine_makes_text(params):
            detok = IncrementalDetokenizer(self._tokenizer, params, self._count_fallback)
            self._decoder.expect(key, detok)

    def _count_fallback(self) -> None:
        self.num_detokenizer_fallbacks += 1

    async def add_request(self, key: str, prompt_ids: list[int], params) -> None:
        if params.structured_output is not None:
            # compiled on the engine process's helper thread first: not between steps
            await self._call("compile_grammar", params.structured_output)
        self._expect(key, params)
        await self._call("add_request", key, prompt_ids, params)

    async def abort_request(self, key: str) -> bool:
        return await self._call("abort_request", key)

    async def free_request(self, key: str) -> None:
        self._decoder.forget(key)
        await self._call("free_request", key, always=True)

    async def reserve_remote_kv(self, key: str, prompt_ids: list[int], params):
        self._expect(key, params)
        return await self._call("reserve_remote_kv", key, prompt_ids, params)

    async def admit_remote(self, key: str, first_token_id: int, first_logprob, prompt_logprobs):
        await self._call("admit_remote", key, first_token_id, first_logprob, prompt_logprobs)

    async def prefill_locally(self, key: str) -> None:
        await self._call("prefill_locally", key)

    async def load(self) -> tuple[dict, KVAudit]:
        """Counters and KV audit for GetLoad, asked between two steps; while a long step
        holds the question back past LOAD_WAIT_S, the engine process's latest status
        (at most ~1 s old) instead: a probe that waits behind a step on a starved host
        times out, and the router takes a live worker out of its pool."""
        call = asyncio.ensure_future(self._call("load"))
        status = self._status
        if status is None:  # nothing reported yet
            stats, audit = await call
        else:
            try:
                stats, audit = await asyncio.wait_for(asyncio.shield(call), LOAD_WAIT_S)
            except TimeoutError:
                call.add_done_callback(_ignore_result)
                stats, audit = status["stats"], status["audit"]
        # the fallbacks of the detokenizers on both sides
        fallbacks = stats["detokenizer_fallbacks"] + self.num_detokenizer_fallbacks
        return {**stats, "detokenizer_fallbacks": fallbacks}, audit

    async def add_kv_peer(self, info: KVAgentInfo, rank_agents: list[KVAgentInfo]) -> None:
        await self._call("add_kv_peer", info.to_dict(), [a.to_dict() for a in rank_agents])

    def status(self) -> dict | None:
        return self._status

    # -- the pipe -------------------------------------------------------------------

    async def _call(self, name: str, *args, always: bool = False):
        """Run a command in the engine process. always: wait for it through a
        cancellation (cleanup in `finally` blocks); either way it is sent at once and
        runs."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        call_id = next(self._ids)
        self._calls[call_id] = (loop, future)
        try:
            self._send(("call", call_id, name, args))
        except WorkerFailed:
            self._calls.pop(call_id, None)
            raise
        return await (asyncio.shield(future) if always else future)

    def _send(self, message) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, ValueError) as e:  # closed: the process is gone
            raise WorkerFailed(f"the engine process is gone ({e})") from None

    def _read(self) -> None:
        reason = None
        try:
            while reason is None:
                reason = self._take(self._conn.recv())
        except (EOFError, OSError):
            self._process.join(5)
            reason = f"the engine process exited (code {self._process.exitcode})"
        if self._stopping:
            return
        log.error("%s", reason)
        error = WorkerFailed(reason)
        self.fail_streams(error)
        calls, self._calls = self._calls, {}
        for loop, future in calls.values():
            loop.call_soon_threadsafe(_settle, future, False, error)
        self._on_death(reason)

    def _take(self, message) -> str | None:
        kind = message[0]
        if kind == "out":
            streams, decoder = self._streams, self._decoder
            outputs = []
            for delta in message[1]:
                if delta[0] in streams:
                    outputs.append(decoder.decode(delta))
                else:  # its stream closed: nobody reads it
                    decoder.forget(delta[0])
            self.publish_step(outputs)
        elif kind == "reply":
            _, call_id, ok, value = message
            target = self._calls.pop(call_id, None)
            if target is not None:
                loop, future = target
                loop.call_soon_threadsafe(_settle, future, ok, value)
        elif kind == "error":
            self._decoder.forget(message[1])
            self.publish_error(message[1], message[2])
        elif kind == "status":
            self._status = status = message[1]
            if self._on_gc_pause is not None:
                for generation, seconds in status["gc_pauses"]:
                    self._on_gc_pause(generation, seconds)
        elif kind == "dead":
            return message[1]
        return None


def _ignore_result(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()  # retrieved: a late failure is not "never retrieved"


def _settle(future: asyncio.Future, ok: bool, value) -> None:
    if future.done():  # its caller was cancelled
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


class EngineProcessKV:
    """The worker's view of the engine process's KV transfer engine: its agents (fixed
    at start-up) and counters (from its status reports); peers are added over there."""

    def __init__(self, client: EngineCoreClient, rank_agents: list[KVAgentInfo]):
        self._client = client
        self.rank_agents = rank_agents

    def agent_info(self) -> KVAgentInfo:
        return self.rank_agents[0]

    def stats(self) -> dict[str, float]:
        status = self._client.status()
        return dict(status["kv"]) if status is not None else {}

    def close(self) -> None:
        pass  # the engine process closes its own


def request_checks_for(engine_config: EngineConfig) -> Callable[[int], RequestChecks]:
    """The engine's request checks without its model, for a worker whose engine runs in
    another process: loaded while that process loads the model (the tokenizer and the
    transformers import take seconds), completed with the engine's max_model_len."""
    path = resolve_model_path(
        engine_config.model, engine_config.revision, engine_config.download_dir
    )
    hf_config = load_hf_config(path)
    tokenizer = load_tokenizer(path)
    grammars = Grammars(tokenizer, hf_config.vocab_size, eos_token_ids(path, tokenizer, hf_config))
    return functools.partial(
        RequestChecks, tokenizer, hf_config.vocab_size, grammars, engine_config.scheduling_policy
    )
