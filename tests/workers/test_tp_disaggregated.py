"""Tensor parallelism, acceptance 2 and 3: prefill and decode workers with different TP
(P tp=2 -> D tp=1 and P tp=1 -> D tp=2, the latter also with the decode worker's engine
in its own process; real rank processes, Mooncake TCP) equal the
colocated engine token for token, write exactly the requests' KV bytes and free every
block; a TP=2 decode worker whose rank is killed under load leaves the pool: its
requests end with a clear error, the worker exits non-zero and no rank is left."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from services.engine import LLM, SamplingParams
from tests.engine.helpers import save_random_model
from tests.workers.procs import start_worker, worker_pair
from tests.workers.test_disaggregated import generate

MAX_TOKENS = 10
BLOCK = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    # 8 query heads, 2 KV heads, 3 layers, head_dim 16: fp32 blocks of 12 KiB
    return str(save_random_model(tmp_path_factory.mktemp("llama"), "llama"))


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # distinct prompts: no prefix-cache hit on either side
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (1, 15, 16, 33, 70, 130)]


def _block_bytes(model: str) -> int:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(model)
    head_dim = hf.head_dim
    return hf.num_hidden_layers * 2 * BLOCK * hf.num_key_value_heads * head_dim * 4  # fp32


@pytest.mark.parametrize(
    "prefill_tp,decode_tp,decode_flags",
    [(2, 1, ()), (1, 2, ()), (1, 2, ("--engine-process",))],
    ids=["P2-D1", "P1-D2", "P1-D2 engine process"],
)
def test_different_tp_equals_colocated(model, prefill_tp, decode_tp, decode_flags):
    # the engine process (a decode worker's default on a GPU) spawns the ranks itself
    prompts = _prompts(prefill_tp)
    with LLM(model, num_kv_blocks=128) as colocated:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
        refs = [o.output.token_ids for o in colocated.generate(prompts, params)]
    chunked = ("--max-num-batched-tokens", "32")  # long prompts prefill in chunks
    with worker_pair(
        model,
        prefill_args=(*chunked, "--tensor-parallel-size", str(prefill_tp)),
        decode_args=("--tensor-parallel-size", str(decode_tp), *decode_flags),
    ) as (prefill, decode):
        # every rank process froze its startup heap out of the collector once warm
        for w, tp in ((prefill, prefill_tp), (decode, decode_tp)):
            for rank in range(1, tp):
                assert any(
                    f"tp-rank-{rank} INFO" in line and "startup objects frozen out of GC" in line
                    for line in w.log
                ), (w.role, rank, "".join(w.log[-30:]))
        with ThreadPoolExecutor(len(prompts)) as pool:
            results = list(
                pool.map(
                    lambda p: generate(decode, p, prefill, MAX_TOKENS, ignore_eos=True), prompts
                )
            )
        for (tokens, last), ref in zip(results, refs):
            assert tokens == ref
            assert not last.timings.prefill_fallback
        report = prefill.load()
        assert report.kv_transfers_ok == len(prompts)
        # every KV byte of every prompt block, written once over all the ranks
        blocks = sum(-(-len(p) // BLOCK) for p in prompts)
        assert report.kv_transfer_bytes == blocks * _block_bytes(model)
        for w in (prefill, decode):
            report = w.wait_all_blocks_free()
            assert report.num_free_blocks == report.num_total_blocks, w.role


def _rank_pids(worker) -> list[int]:
    """The worker's rank processes (its children)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == worker.proc.pid:
            out.append(int(entry))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_killed_rank_takes_the_decode_worker_down(model):
    prefill = start_worker("prefill", model=model)
    decode = start_worker("decode", "--tensor-parallel-size", "2", model=model)
    try:
        ranks = [pid for pid in _rank_pids(decode) if _alive(pid)]
        assert ranks, "the TP=2 decode worker has no rank process"
        prompts = _prompts(7)

        def run(p):
            try:
                # as long as the context allows: still decoding when the rank dies
                return generate(decode, p, prefill, 1023 - len(p), ignore_eos=True, timeout=60)
            except grpc.RpcError as e:
                return e

        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(run, p) for p in prompts]
            deadline = time.monotonic() + 30
            while decode.load().num_running < len(prompts) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert decode.load().num_running == len(prompts)  # under load
            for pid in ranks:
                os.kill(pid, signal.SIGKILL)
            results = [f.result(90) for f in futures]
        errors = [r for r in results if isinstance(r, grpc.RpcError)]
        assert len(errors) == len(prompts), "a request outlived its worker's rank"
        assert any("rank" in (e.details() or "") for e in errors), [e.details() for e in errors]
        assert decode.proc.wait(60) != 0
        assert not any(_alive(pid) for pid in ranks), "a rank outlived its worker"
        assert any("tensor-parallel rank 1 died" in line for line in decode.log)
        # the prefill worker is untouched and serves a new decode worker
        with LLM(model, num_kv_blocks=64) as colocated:
            want = colocated.generate(
                prompts[:1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
            )[0].output.token_ids
        fresh = start_worker("decode", model=model)
        try:
            assert generate(fresh, prompts[0], prefill, MAX_TOKENS)[0] == want
        finally:
            fresh.stop()
    finally:
        decode.stop()
        prefill.stop()
