"""Timing a kernel call on its device, as the kernel tuner and the benchmarks do: the
median of wall-clock runs (CPU) or CUDA events, and CUDA-graph replays (what captured
decode steps see, without Python launch overhead)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

_CPU_SAMPLING_S = 0.025


def time_us(fn: Callable[[], object], device: torch.device) -> float:
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
    fn()
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
