"""End to end: the engine with kernel_backend="triton" (and "aiter" where it loads)
produces the same greedy tokens as kernel_backend="torch" on a tiny random-weight
Llama (llama3 rope scaling, GQA 8/2, head_dim 16), with chunked prefill mixing prefill
chunks and decode rows in one step. On a CPU the kernels run under Triton's
interpreter, so the model and the run are kept tiny."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")

from services.engine import LLM, SamplingParams  # noqa: E402
from tests.engine.helpers import assert_all_blocks_free, save_random_model  # noqa: E402

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("kernels") / "llama", "llama")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(7)
    return [[rng.randrange(3, 512) for _ in range(n)] for n in (3, 18, 41)]


def _generate(model_dir, prompts, backend, device, **engine_args):
    llm = LLM(
        str(model_dir),
        kernel_backend=backend,
        device=device,
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=24,  # chunks the 41-token prompt next to decode rows
        num_kv_blocks=32,
        max_model_len=128,
        **engine_args,
    )
    assert llm.engine.runner.ops.name == backend
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = [o.output.token_ids for o in llm.generate(prompts, params)]
    assert_all_blocks_free(llm)
    return outs


@pytest.fixture(scope="module")
def torch_tokens(tiny_llama, prompts, device):
    return _generate(tiny_llama, prompts, "torch", device)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # interpreter: aiter's padded rows
@pytest.mark.parametrize("backend", ["triton", "aiter"])
def test_engine_greedy_tokens_match_torch_backend(
    backend, tiny_llama, prompts, torch_tokens, device
):
    if backend == "aiter":
        from services.kernels import get_backend

        try:
            get_backend("aiter")
        except ValueError as exc:
            pytest.skip(str(exc))
    tokens = _generate(tiny_llama, prompts, backend, device)
    assert all(len(t) == MAX_TOKENS for t in tokens)
    assert tokens == torch_tokens


# Every op from a different candidate than its neighbours, sdpa for prompt and mixed
# attention: dispatch by class must keep the tokens exact.
MIXED_CHOICES = (
    "linear=torch,linear.decode1=triton,rms_norm=triton,fused_add_rms_norm.decode1=torch,"
    "fused_add_rms_norm.decode8=triton,paged_attention.decode1=aiter,"
    "fused_add_rms_norm.decode64=torch,fused_add_rms_norm.decode256=triton,"
    "fused_add_rms_norm.prefill=torch,rotary_embedding=triton,silu_and_mul=torch,"
    "silu_and_mul.prefill=triton,store_kv_cache=triton,paged_attention.decode8=triton,"
    "paged_attention.decode64=triton,paged_attention.decode256=triton,"
    "paged_attention.prefill=sdpa,paged_attention.mixed=sdpa"
)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_tuned_backend_matches_torch_backend(
    tiny_llama, prompts, torch_tokens, device, tmp_path, monkeypatch
):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    # On a CPU every choice is given (measuring under the interpreter takes minutes);
    # on a GPU the tuner measures at this model's shapes, then the cache is reused.
    choices = MIXED_CHOICES if device == "cpu" else None
    tokens = _generate(tiny_llama, prompts, "tuned", device, kernel_choices=choices)
    assert tokens == torch_tokens
    if device != "cpu":
        assert list((tmp_path / "kernel_tuning").glob("*.json"))
        assert _generate(tiny_llama, prompts, "tuned", device) == torch_tokens


def test_cpu_default_is_the_tuner_measuring_cpu_candidates(
    tiny_llama, prompts, torch_tokens, device, tmp_path, monkeypatch
):
    """On a CPU the engine's default backend is `tuned`, measuring the CPU's own
    candidates (plain GEMM vs weight slabs) at this model's shapes; its tokens equal
    the torch reference's in fp32."""
    if device != "cpu":
        pytest.skip("the CPU tuner")
    from services.engine import EngineConfig

    assert EngineConfig(model=str(tiny_llama)).kernel_backend_name == "tuned"
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert _generate(tiny_llama, prompts, "tuned", device) == torch_tokens
    (cache,) = (tmp_path / "kernel_tuning").glob("cpu*.json")
    assert _generate(tiny_llama, prompts, "tuned", device) == torch_tokens  # from the cache
    assert list((tmp_path / "kernel_tuning").glob("*.json")) == [cache]
