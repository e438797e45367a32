"""Mixed steps (prefill chunks next to decode rows) through the static, padded inputs
that their CUDA graphs replay (services/engine/mixed_graph.py). On a CPU the same
forward runs eagerly over those buffers under Triton's interpreter, which checks the
padding: the padding sequence, empty sequence slots, slot -1 KV writes and the
gathered logits rows. tests/engine/test_gpu_engine.py replays real graphs."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")

from services.engine import LLM, SamplingParams  # noqa: E402
from services.engine.mixed_graph import MixedGraphs, mixed_capture_sizes  # noqa: E402
from services.kernels.shape_classes import mixed_graph_blocker  # noqa: E402
from tests.engine.helpers import assert_all_blocks_free, save_random_model  # noqa: E402

MAX_TOKENS = 6


def test_buckets():
    assert mixed_capture_sizes(512) == [16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512]
    assert mixed_capture_sizes(100) == [16, 32, 64, 96]
    assert mixed_capture_sizes(1024)[-5:] == [512, 640, 768, 896, 1024]
    assert mixed_capture_sizes(8) == []
    graphs = MixedGraphs.__new__(MixedGraphs)
    graphs.sizes, graphs.max_seqs = mixed_capture_sizes(128), 4
    assert graphs.bucket(16, 4) == 16  # no padding: no padding sequence needed
    assert graphs.bucket(15, 4) == 16  # padded: 4 sequences + the padding one fit 5 slots
    assert graphs.bucket(17, 3) == 32
    assert graphs.bucket(129, 1) is None  # beyond the largest bucket: eager
    graphs.max_seqs = 3
    assert graphs.bucket(15, 3) == 16
    assert graphs.bucket(15, 4) is None  # more sequences than slots


def test_blocker_names_the_pick():
    picks = {"paged_attention.mixed": "triton", "store_kv_cache.prefill": "triton"}
    assert mixed_graph_blocker(picks, [16, 512]) is None
    sdpa = {**picks, "paged_attention.mixed": "sdpa"}
    assert "paged_attention.mixed" in mixed_graph_blocker(sdpa, [16])
    torch_kv = {**picks, "store_kv_cache.prefill": "torch"}
    assert "store_kv_cache.prefill" in mixed_graph_blocker(torch_kv, [512])
    assert mixed_graph_blocker(torch_kv, [16, 64]) is None  # no prefill-class bucket


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("mixed") / "llama", "llama")


def _llm(model_dir, backend, **kw):
    return LLM(
        str(model_dir),
        kernel_backend=backend,
        device="cpu",
        dtype="float32",
        block_size=16,
        max_num_seqs=4,
        max_num_batched_tokens=40,  # chunks the long prompts next to decode rows
        num_kv_blocks=48,
        max_model_len=160,
        **kw,
    )


def test_mixed_steps_through_static_buffers_equal_torch_backend(tiny_llama, device):
    if device != "cpu":
        pytest.skip("the GPU replays real graphs (tests/engine/test_gpu_engine.py)")
    rng = random.Random(3)
    # 5 prompts over 4 sequence slots: one waits, then joins next to decode rows
    prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 37, 2, 61, 20)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    ref_llm = _llm(tiny_llama, "torch")
    reference = ref_llm.generate(prompts, params)

    llm = _llm(tiny_llama, "triton")
    runner = llm.engine.runner
    assert runner.mixed_graphs is None  # a CPU captures nothing by itself
    c = runner.config
    runner.mixed_graphs = MixedGraphs(
        runner.model,
        runner.ops,
        max_tokens=c.mixed_graph_max_tokens,
        max_seqs=c.max_num_seqs,
        max_model_len=llm.engine.max_model_len,
        block_size=c.block_size,
        device=runner.device,
        capture=False,
    )
    free_before = llm.engine.scheduler.block_manager.num_free_blocks
    runner.mixed_graphs.capture()  # warm-ups over padding only: no block is touched
    assert llm.engine.scheduler.block_manager.num_free_blocks == free_before
    outs = llm.generate(prompts, params)
    assert runner.mixed_graphs.steps_run >= 3  # the chunked prompts and their neighbours
    for got, want in zip(outs, reference):
        assert got.output.token_ids == want.output.token_ids
        for a, b, t in zip(got.output.logprobs, want.output.logprobs, got.output.token_ids):
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
    assert_all_blocks_free(llm)


def test_pipelined_admissions_through_static_buffers(tiny_llama, device):
    """Async scheduling with prompts waiting: each is admitted next to decode rows whose
    input tokens are still on the device, gathered into the static buffers before the
    forward (the replay on a GPU). Tokens equal the synchronous torch engine's."""
    if device != "cpu":
        pytest.skip("the GPU replays real graphs (tests/engine/test_gpu_engine.py)")
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 512) for _ in range(rng.randrange(2, 12))] for _ in range(7)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    reference = _llm(tiny_llama, "torch").generate(prompts, params)

    llm = _llm(tiny_llama, "triton", async_scheduling=True)
    runner, c = llm.engine.runner, llm.engine.runner.config
    runner.mixed_graphs = MixedGraphs(
        runner.model,
        runner.ops,
        max_tokens=c.mixed_graph_max_tokens,
        max_seqs=c.max_num_seqs,
        max_model_len=llm.engine.max_model_len,
        block_size=c.block_size,
        device=runner.device,
        capture=False,
    )
    runner.mixed_graphs.capture()
    engine, outs, step = llm.engine, {}, 0
    while step < 200 and (step < 2 * len(prompts) or engine.has_unfinished_requests()):
        if step % 2 == 0 and step // 2 < len(prompts):
            engine.add_request(f"p{step // 2}", prompts[step // 2], params)
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out.output.token_ids
        step += 1
    assert engine.num_pipelined_mixed_steps >= 3
    assert runner.mixed_graphs.steps_run >= engine.num_pipelined_mixed_steps
    assert [outs[f"p{i}"] for i in range(len(prompts))] == [r.output.token_ids for r in reference]
    assert_all_blocks_free(llm)
