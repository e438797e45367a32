"""The other ranks of a tensor-parallel engine, as rank 0 sees them.

Rank 0 (the engine's process: it schedules, samples and serves) starts ranks 1..N-1 as
processes, each owning one device and a ModelRunner over its share of the weights and
KV heads. Before every runner call that runs the model, rank 0 sends the call (plain
host lists, no tensors) down one pipe per rank; each rank makes the same call on its
runner, so the collectives inside the model line up. Tensors move only through the
process group (gloo on CPU, NCCL on GPU).

Beside that call stream, a side channel (a second pipe per rank) runs service-layer
functions in a rank's process off the step path, on a thread pool there: e.g. a KV
transfer engine per rank, and the writes of the rank's KV heads to another worker.

A rank that dies is noticed twice: rank 0's next collective fails (gloo: at once; the
process group's timeout otherwise) and a watcher thread sees the process end and calls
`on_death`. A rank whose rank 0 dies is killed by the kernel (PR_SET_PDEATHSIG) or
reads the end of its pipe: none is left holding a device."""

from __future__ import annotations

import concurrent.futures
import ctypes
import datetime
import gc
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from services.models.tensor_parallel import TPGroup

log = logging.getLogger(__name__)

STORE_HOST = "127.0.0.1"  # the ranks of one worker share a host


FREEZE_HEAP = "freeze_heap"  # a rank-loop command of its own, not a runner method


class RankFailed(RuntimeError):
    """A tensor-parallel rank died or failed."""


@dataclass(frozen=True)
class RankPlan:
    """What every rank needs to build its runner (picklable: sent to spawned processes)."""

    runner_cls: type  # ModelRunner (passed in: this module is below it)
    config: object  # EngineConfig; rank r's device is rank_device(config.device, r)
    model_path: str
    max_position: int
    size: int
    store_port: int
    timeout_s: float
    log_level: int


def rank_device(device: str, rank: int) -> str:
    """cuda:K for rank 0 -> cuda:K+rank; every CPU rank is "cpu"."""
    if device == "cpu":
        return "cpu"
    base = torch.device(device).index or 0
    return f"cuda:{base + rank}"


def check_devices(device: str, size: int) -> None:
    if device == "cpu" or size == 1:
        return
    base = torch.device(device).index or 0
    have = torch.cuda.device_count()
    if base + size > have:
        raise ValueError(
            f"tensor_parallel_size {size} from {device} needs GPUs {base}..{base + size - 1}; "
            f"this machine has {have}"
        )


class TPRanks:
    """Rank 0's handle on ranks 1..size-1; `group` is rank 0's TPGroup."""

    def __init__(self, runner_cls, config, model_path, max_position: int, timeout_s: float = 600.0):
        size = config.tensor_parallel_size
        check_devices(config.device, size)
        store = dist.TCPStore(
            STORE_HOST,
            0,  # any free port: two workers run side by side on one host
            size,
            is_master=True,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )
        plan = RankPlan(
            runner_cls,
            config,
            str(model_path),
            max_position,
            size,
            store.port,
            timeout_s,
            logging.getLogger().getEffectiveLevel(),
        )
        ctx = multiprocessing.get_context("spawn")  # never fork a process holding CUDA
        self._conns: list[multiprocessing.connection.Connection] = []
        self._sides: list[multiprocessing.connection.Connection] = []
        self.procs: list[multiprocessing.Process] = []
        for rank in range(1, size):
            ours, theirs = ctx.Pipe()
            side, side_theirs = ctx.Pipe()
            proc = ctx.Process(
                target=_rank_main,
                args=(rank, plan, theirs, side_theirs),
                name=f"tp-rank-{rank}",
                daemon=True,
            )
            proc.start()
            theirs.close()
            side_theirs.close()
            self._conns.append(ours)
            self._sides.append(side)
            self.procs.append(proc)
        self._closing = False
        self._side_lock = threading.Lock()
        self._side_ids = itertools.count()
        self._pending: dict[int, tuple[int, concurrent.futures.Future]] = {}
        for rank, side in enumerate(self._sides, start=1):
            threading.Thread(
                target=self._read_side, args=(rank, side), name=f"tp-side-{rank}", daemon=True
            ).start()
        self._store = store  # kept alive: the ranks' store
        self.group = TPGroup.connect(store, 0, size, torch.device(config.device), timeout_s)
        log.info("tensor parallelism: %d ranks, pids %s", size, [p.pid for p in self.procs])

    def call(self, method: str, *args) -> None:
        """Have every other rank call runner.<method>(*args) (rank 0 makes it itself)."""
        try:
            for conn in self._conns:
                conn.send((method, args))
        except (BrokenPipeError, EOFError, OSError) as e:
            raise RankFailed(f"a tensor-parallel rank is gone: {self.dead_ranks()}") from e

    def gather(self, method: str, *args) -> list:
        """call() and collect each other rank's return value (set-up calls only)."""
        self.call(method, *args)
        replies = []
        for rank, conn in enumerate(self._conns, start=1):
            try:
                status, value = conn.recv()
            except (EOFError, OSError) as e:
                raise RankFailed(f"tensor-parallel rank {rank} died during {method}") from e
            if status != "ok":
                raise RankFailed(f"tensor-parallel rank {rank} failed in {method}: {value}")
            replies.append(value)
        return replies

    def freeze_heap(self) -> list[int]:
        """Once the worker is warm: every other rank freezes what it built at start-up
        out of the cyclic garbage collector (a collection walking a rank's heap
        would stall every collective behind it; see proto/pdpb/heap.py). Returns how
        many objects each froze."""
        return self.gather(FREEZE_HEAP)

    def side_call(self, rank: int, fn: Callable, *args) -> concurrent.futures.Future:
        """Run fn(state, *args) on rank `rank`'s side channel (state: a dict the rank
        keeps for such functions, holding its "runner"); a Future of its result.
        fn must be a module-level function (it is pickled by name)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._side_lock:
            call_id = next(self._side_ids)
            self._pending[call_id] = (rank, future)
            try:
                self._sides[rank - 1].send((call_id, fn, args))
            except (BrokenPipeError, OSError) as e:
                del self._pending[call_id]
                future.set_exception(RankFailed(f"tensor-parallel rank {rank} is gone: {e}"))
        return future

    def _read_side(self, rank: int, side) -> None:
        while True:
            try:
                call_id, ok, value = side.recv()
            except (EOFError, OSError):
                break
            with self._side_lock:
                _, future = self._pending.pop(call_id, (None, None))
            if future is None:
                continue
            if ok:
                future.set_result(value)
            else:
                future.set_exception(RankFailed(f"tensor-parallel rank {rank}: {value}"))
        with self._side_lock:  # the rank is gone: nothing pending on it can finish
            lost = [(i, f) for i, (r, f) in self._pending.items() if r == rank]
            for i, _ in lost:
                del self._pending[i]
        for _, future in lost:
            future.set_exception(RankFailed(f"tensor-parallel rank {rank} died"))

    def dead_ranks(self) -> dict[int, int | None]:
        return {r: p.exitcode for r, p in enumerate(self.procs, start=1) if not p.is_alive()}

    def watch(self, on_death: Callable[[int, int | None], None]) -> None:
        """Call on_death(rank, exit code) from a thread when a rank process ends while
        the engine is not closing."""

        def run():
            sentinels = {p.sentinel: r for r, p in enumerate(self.procs, start=1)}
            ready = multiprocessing.connection.wait(list(sentinels))
            if not self._closing:
                rank = sentinels[ready[0]]
                on_death(rank, self.procs[rank - 1].exitcode)

        threading.Thread(target=run, name="tp-rank-watch", daemon=True).start()

    def close(self, timeout_s: float = 10.0) -> None:
        self._closing = True
        for conn in self._conns:
            try:
                conn.send(("stop", ()))
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)
        for conn in (*self._conns, *self._sides):
            conn.close()


def _serve_side(side, state: dict, workers: int = 8) -> None:
    """The rank's side channel: each call on a pool thread, replies as they finish."""
    pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="tp-side")
    lock = threading.Lock()

    def run(call_id, fn, args):
        try:
            reply = (call_id, True, fn(state, *args))
        except Exception as e:
            log.exception("side call %s failed", getattr(fn, "__name__", fn))
            reply = (call_id, False, repr(e))
        with lock:
            try:
                side.send(reply)
            except OSError:
                pass

    while True:
        try:
            call_id, fn, args = side.recv()
        except (EOFError, OSError):
            return
        pool.submit(run, call_id, fn, args)


def _die_with_parent() -> None:
    try:  # Linux: SIGKILL this rank when rank 0's process ends, however it ends
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _rank_main(rank: int, plan: RankPlan, conn, side) -> None:
    _die_with_parent()
    logging.basicConfig(
        level=plan.log_level,
        format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(name)s: %(message)s",
    )
    from services.models.loader import load_hf_config

    config = replace(plan.config, device=rank_device(plan.config.device, rank))
    if config.device == "cpu":  # the ranks share the host's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // plan.size))
    store = dist.TCPStore(
        STORE_HOST,
        plan.store_port,
        plan.size,
        is_master=False,
        timeout=datetime.timedelta(seconds=plan.timeout_s),
    )
    group = TPGroup.connect(store, rank, plan.size, torch.device(config.device), plan.timeout_s)
    try:
        hf_config = load_hf_config(plan.model_path)
        runner = plan.runner_cls(config, hf_config, plan.model_path, plan.max_position, tp=group)
        state = {"runner": runner, "rank": rank}
        threading.Thread(target=_serve_side, args=(side, state), daemon=True).start()
        while True:
            try:
                method, args = conn.recv()
            except EOFError:  # rank 0 is gone
                return
            if method == "stop":
                return
            if method == FREEZE_HEAP:  # pdpb.heap's freeze: the engine may not import pdpb
                gc.collect()
                gc.freeze()
                frozen = gc.get_freeze_count()
                log.info("%d startup objects frozen out of GC", frozen)
                conn.send(("ok", frozen))
                continue
            result = getattr(runner, method)(*args)
            if method in runner.REPLYING_CALLS:
                conn.send(("ok", result))
    except Exception as e:  # a failed rank takes its worker down: say why first
        log.exception("tensor-parallel rank %d failed", rank)
        try:
            conn.send(("error", repr(e)))
        except OSError:
            pass
        os._exit(1)
