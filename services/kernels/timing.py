"""Timing a kernel call on its device, as the kernel tuner and the benchmarks do: the
median of wall-clock runs (CPU) or CUDA events, and CUDA-graph replays (what captured
decode steps see, without Python launch overhead)."""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import torch

_CPU_SAMPLING_S = 0.025


def time_us(
    fn: Callable[[], object], device: torch.device, give_up_us: float | None = None
) -> float:
    """give_up_us (CPU): a first call slower than this is returned as the time at once:
    a clear loser needs no more samples (bf16 weight slabs on an AVX2 CPU took 3.5 s a
    call at SmolLM2's decode64, and their samples most of a 36 s start-up)."""
    if device.type == "cuda":
        try:  # lazy: triton is optional and heavy (else CUDA events time it, below)
            from triton.testing import do_bench

            return do_bench(fn, warmup=5, rep=20) * 1e3
        except ImportError:
            pass
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) * 1e3 / 20
    t = time.perf_counter()
    fn()
    first = time.perf_counter() - t
    if give_up_us is not None and first * 1e6 > give_up_us:
        return first * 1e6
    # sub-millisecond CPU calls vary by 10-20% run to run on a shared machine: three
    # samples picked the slower of two candidates 7% apart; sample for ~25 ms instead
    # (slow calls, e.g. Triton's interpreter in tests, still stop after three)
    samples: list[float] = []
    spent = 0.0
    while len(samples) < 3 or (spent < _CPU_SAMPLING_S and len(samples) < 50):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
        spent += samples[-1]
    return statistics.median(samples) * 1e6


def alternating_us(calls: dict[str, Callable[[], object]], min_rounds: int = 5) -> dict[str, float]:
    """CPU: the median time of each call, timed in turns (A B, then B A, ...) rather
    than one after the other, so that a shared host's load drifting between two
    back-to-back timings does not decide between two close candidates. At least
    min_rounds rounds, more while a round is short (up to ~50 ms in all)."""
    samples: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for fn in calls.values():
        fn()
    spent, rounds = 0.0, 0
    while rounds < min_rounds or (spent < 2 * _CPU_SAMPLING_S and rounds < 50):
        for name in order if rounds % 2 == 0 else reversed(order):
            t = time.perf_counter()
            calls[name]()
            samples[name].append(time.perf_counter() - t)
            spent += samples[name][-1]
        rounds += 1
    return {name: statistics.median(s) * 1e6 for name, s in samples.items()}


# On a CPU, the two fastest candidates within this fraction of each other are timed
# again in turns (a runoff): on a shared 2-core host, timed one after the other, the
# oneDNN linear measured 8% ahead of the weight slabs at SmolLM2's decode1 while it ran
# the engine's steps 5-20% behind them.
CPU_RUNOFF_MARGIN = 0.15


def cpu_runoff(times: dict[str, float], case, candidates, configs) -> list[str] | None:
    """If the two fastest of `times` are within CPU_RUNOFF_MARGIN of each other, times
    them again in turns (alternating_us), updates their entries and returns them.
    case(backend, config): the op's inputs with their call, as the tuner builds them;
    built once and run by either finalist (a case can be a gigabyte of weights)."""
    ranked = sorted(times, key=times.get)
    if len(ranked) < 2 or times[ranked[1]] > times[ranked[0]] * (1 + CPU_RUNOFF_MARGIN):
        return None
    finalists = ranked[:2]
    if any(c in configs for c in finalists):
        return None  # launch configs are GPU kernels' (on a CPU only under the interpreter)
    switch = _Switch(candidates[finalists[0]])
    call = case(switch, None)[0]

    def turn(cand):
        def run():
            switch.current = candidates[cand]
            return call()

        return run

    times.update(alternating_us({cand: turn(cand) for cand in finalists}))
    return finalists


class _Switch:
    """Forwards every op to `current`, so that one case runs on either finalist."""

    def __init__(self, current):
        self.current = current

    def __getattr__(self, name):
        return getattr(self.current, name)


def time_graph_us(fn: Callable[[], object], calls: int = 10, replays: int = 20) -> float:
    """Kernel time as a captured decode step sees it: no Python launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return replay_ms(graph, replays) * 1e3 / calls


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 20) -> float:
    """Milliseconds per replay of a captured graph, back to back, after one warm-up."""
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays


# Bytes of weight copies a bandwidth measurement cycles through: past a GPU's L2
# (50-60 MB on Hopper), where a weight timed alone reads 1.7-2x faster than in a step.
PAST_L2_BYTES = 512 << 20


def copies_past_l2(nbytes: int) -> int:
    """How many copies of an nbytes weight to cycle through so the reads come from HBM."""
    return max(2, -(-PAST_L2_BYTES // nbytes))


def cycled_graph_us(calls: list[Callable[[], object]], replays: int = 10) -> float:
    """Microseconds per call of `calls` (one per weight copy) run in turn, captured in a
    CUDA graph."""
    it = itertools.cycle(calls)
    return time_graph_us(lambda: next(it)(), calls=len(calls), replays=replays)
