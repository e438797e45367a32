"""The engine in a process of its own (--engine-process), as vLLM's EngineCore: the
model, the KV cache, the scheduler and the KV transfer engine live here, and the worker
process keeps gRPC, the response building and the metrics. The two no longer share one
GIL, so at hundreds of streams the Python each side spends per token runs side by
side instead of one after the other.

One duplex pipe joins them. The worker sends commands by name (COMMANDS); this
process runs them between steps, in the order sent, and answers each. It sends each
step's outputs as one message of deltas (output_deltas.py), and a status (counters, a
KV audit) every AUDIT_INTERVAL_S and whenever it falls idle. Replies and outputs share
the pipe, so an output sent before a reply reaches the worker before it (admit_remote's
first token before the call returns, as EngineLoop.call_and_publish). The worker's end
is engine_client.py."""

from __future__ import annotations

import concurrent.futures
import logging
import os
import pickle
import signal
import threading
import time
import traceback

from kvtransfer import KVAgentInfo
from pdpb.heap import GCPauses, freeze_startup_heap
from services.common.engine_loop import AUDIT_INTERVAL_S
from services.common.engine_setup import load_engine
from services.engine.startup import StartupPhases

log = logging.getLogger(__name__)

# commands the worker may send; "compile_grammar" runs on a helper thread (compiling a
# grammar can take seconds: not between two steps), the others on the engine's loop
COMMANDS = (
    "add_request",
    "abort_request",
    "free_request",
    "reserve_remote_kv",
    "admit_remote",
    "prefill_locally",
    "load",
    "add_kv_peer",
    "compile_grammar",
    "stop",
)


def portable(error: BaseException) -> BaseException:
    """error itself if it survives the pipe, else a RuntimeError naming it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def run(conn, engine_config, settings, log_level: int) -> None:
    """The engine process's entry point (multiprocessing, spawned)."""
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s engine-core %(name)s: %(message)s"
    )
    # the worker decides when this process ends (a stop command, or its end of the pipe
    # closing): a Ctrl-C or SIGTERM to the process group must not end it mid-drain
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    phases = StartupPhases()
    try:
        engine, connector, warmup = load_engine(engine_config, settings, phases)
    except BaseException as e:
        conn.send(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))
        raise SystemExit(1) from None
    try:
        engine.delta_outputs = True  # deltas; text only where stop strings need it
        core = EngineCore(conn, engine, connector)
        frozen = freeze_startup_heap()
        core.gc_pauses.install()  # reported with each status (the worker's metrics)
        conn.send(
            (
                "ready",
                dict(
                    phases=dict(phases.durations),
                    warmup=warmup,
                    max_model_len=engine.max_model_len,
                    rank_agents=[a.to_dict() for a in connector.rank_agents],
                    gc_frozen_objects=frozen,
                ),
            )
        )
        core.run()
    finally:
        connector.close()
        engine.close()


class EngineCore:
    def __init__(self, conn, engine, connector):
        self.conn = conn
        self.engine = engine
        self.connector = connector
        self._send_lock = threading.Lock()
        self._ended = False
        self._audited_at = float("-inf")
        self._last_audit = None
        self._changed = True  # a step or a command ran since the last status
        self.gc_pauses = GCPauses()
        self._helpers = concurrent.futures.ThreadPoolExecutor(2, "engine-core-helper")
        self._handlers = {name: getattr(self, "_" + name) for name in COMMANDS}
        if engine.runner.ranks is not None:
            engine.runner.ranks.watch(self._rank_died)

    def send(self, message) -> None:
        with self._send_lock:
            self.conn.send(message)

    def run(self) -> None:
        engine = self.engine
        while not self._ended:
            self._report()  # what the last step or commands changed
            try:
                self._take_commands(block=not engine.has_unfinished_requests())
            except (EOFError, OSError):
                log.warning("the worker's end of the pipe closed: the engine process ends")
                return
            if self._ended or not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a broken step must not end the engine silently
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            if outputs:
                self.send(("out", outputs))
            self._changed = True
        self._helpers.shutdown(wait=False, cancel_futures=True)

    def _take_commands(self, block: bool) -> None:
        conn = self.conn
        if not conn.poll(0.5 if block else 0):
            return
        self._changed = True
        while True:
            self._command(*conn.recv())
            if self._ended or not conn.poll(0):
                return

    def _command(self, kind: str, call_id: int, name: str, args: tuple) -> None:
        handler = self._handlers.get(name) if kind == "call" else None
        if handler is None:
            self._reply(call_id, False, ValueError(f"unknown engine command {kind} {name!r}"))
        elif name == "compile_grammar":
            self._helpers.submit(self._answer, call_id, handler, args)
        else:
            self._answer(call_id, handler, args)

    def _answer(self, call_id: int, handler, args: tuple) -> None:
        try:
            result = handler(*args)
        except BaseException as e:
            self._reply(call_id, False, portable(e))
        else:
            self._reply(call_id, True, result)

    def _reply(self, call_id: int, ok: bool, value) -> None:
        if call_id >= 0:  # a stop is not answered
            self.send(("reply", call_id, ok, value))

    def _report(self) -> None:
        """A status (counters, KV audit, collector pauses) every AUDIT_INTERVAL_S and
        whenever the engine falls idle: what GetLoad answers with while a step holds the
        "load" command back (the audit walks every block: not for every probe)."""
        now = time.monotonic()
        busy = self.engine.has_unfinished_requests()
        fell_idle = self._changed and not busy
        if not fell_idle and now - self._audited_at < AUDIT_INTERVAL_S:
            return
        self._changed = False
        try:
            self._last_audit = self.engine.kv_audit()
            self._audited_at = now
            status = dict(
                stats=self.engine.stats(),
                audit=self._last_audit,
                kv=self.connector.stats(),
                gc_pauses=self.gc_pauses.drain(),
            )
        except Exception:  # the audit must never take the engine loop down
            log.exception("status report failed")
            return
        self.send(("status", status))

    def _fail_all(self, error: Exception) -> None:
        error = portable(error)
        for request_id in list(self.engine.requests):
            self.engine.abort_request(request_id)
            self.send(("error", request_id, error))

    def _rank_died(self, rank: int, exitcode) -> None:
        """From the ranks' watcher thread: the engine thread may be stuck in a
        collective, so tell the worker and end here."""
        reason = f"tensor-parallel rank {rank} died (exit code {exitcode})"
        log.error("%s: the engine process ends", reason)
        try:
            self.send(("dead", reason))
        finally:
            os._exit(1)

    # -- the commands -------------------------------------------------------------------

    def _add_request(self, key, prompt_ids, params) -> None:
        self.engine.add_request(key, prompt_ids, params)

    def _abort_request(self, key) -> bool:
        return self.engine.abort_request(key)

    def _free_request(self, key) -> None:
        self.engine.release(key) or self.engine.abort_request(key)

    def _reserve_remote_kv(self, key, prompt_ids, params):
        return self.engine.reserve_remote_kv(key, prompt_ids, params)

    def _admit_remote(self, key, first_token_id, first_logprob, prompt_logprobs) -> None:
        delta = self.engine.admit_remote(key, first_token_id, first_logprob, prompt_logprobs)
        self.send(("out", [delta]))  # ahead of the reply and any step's

    def _prefill_locally(self, key) -> None:
        self.engine.prefill_locally(key)

    def _load(self):
        """Counters now; a KV audit now when idle, else the latest (at most ~1 s old)."""
        engine = self.engine
        if engine.has_unfinished_requests() and self._last_audit is not None:
            return engine.stats(), self._last_audit
        return engine.stats(), engine.kv_audit()

    def _add_kv_peer(self, info: dict, rank_agents: list[dict]) -> None:
        self.connector.add_peer(
            KVAgentInfo.from_dict(info), [KVAgentInfo.from_dict(a) for a in rank_agents]
        )

    def _compile_grammar(self, structured_output) -> None:
        self.engine.grammars.compile(structured_output)

    def _stop(self) -> None:
        """The worker is done: what it sent before this has run; nothing after does."""
        self._ended = True
