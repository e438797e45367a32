"""The engine with each decode step's RoPE + KV write inside its attention launch (the
triton backend's attention_with_prologue, PDSERVE_TRITON_ATTN_PROLOGUE=1) against the
same engine with the prologue a kernel of its own: the same tokens and logprobs, and
the fused launch really ran. Llama (RoPE only), Qwen3 (q/k norm), Mistral with a
sliding window, and an FP8 KV cache. On a CPU the kernels run under Triton's
interpreter; on a GPU the decode steps replay CUDA graphs."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")

from services.engine import LLM, SamplingParams  # noqa: E402
from tests.engine.helpers import assert_all_blocks_free, save_random_model  # noqa: E402

PROMPTS = ([5, 9, 200, 31, 77, 12], [7, 3, 99], list(range(1, 20)))
STEPS = 5


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("attn_prologue")
    return {
        "llama": save_random_model(root / "llama", "llama"),
        "qwen3": save_random_model(root / "qwen3", "qwen3"),
        "mistral": save_random_model(root / "mistral", "mistral", sliding_window=8),
    }


@pytest.fixture
def fused_calls(monkeypatch):
    """Attention launches that did the prologue (the real kernel, counted)."""
    from services.kernels import triton as tk

    calls = []
    attention = tk.paged_attention

    def counted(*args, prologue=None, **kwargs):
        if prologue is not None:
            calls.append(prologue.qk_norm is not None)
        return attention(*args, prologue=prologue, **kwargs)

    monkeypatch.setattr(tk, "paged_attention", counted)
    return calls


def _generate(model_dir, device, monkeypatch, prologue: str, prompts=PROMPTS, **engine_args):
    monkeypatch.setenv("PDSERVE_TRITON_ATTN_PROLOGUE", prologue)
    llm = LLM(
        str(model_dir),
        device=device,
        dtype="float32",
        block_size=16,
        num_kv_blocks=16,
        max_model_len=64,
        **engine_args,
    )
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    outs = [r.output for r in llm.generate([list(p) for p in prompts], params)]
    assert_all_blocks_free(llm)
    return [(o.token_ids, o.logprobs) for o in outs]


def _layers(model_dir) -> int:
    import json

    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


@pytest.mark.parametrize(
    "model,kv_cache_dtype",
    [("llama", "auto"), ("qwen3", "auto"), ("mistral", "auto"), ("llama", "fp8_e4m3")],
    ids=["llama", "qwen3", "mistral-window", "llama-fp8-kv"],
)
def test_the_fused_engine_equals_the_two_launch_engine(
    model, kv_cache_dtype, models, device, monkeypatch, fused_calls
):
    args = dict(kernel_backend="triton", kv_cache_dtype=kv_cache_dtype)
    off = _generate(models[model], device, monkeypatch, "0", **args)
    assert fused_calls == []
    on = _generate(models[model], device, monkeypatch, "1", **args)
    if model == "qwen3" or device != "cpu":
        # Qwen3: k's norm sums its squares in another order (test_attention_prologue.py);
        # a GPU may contract products otherwise: the same tokens, logprobs within 1e-4
        assert [t for t, _ in on] == [t for t, _ in off]
        for (_, a), (_, b) in zip(on, off):
            for da, db in zip(a, b):
                assert da.keys() == db.keys()
                assert all(abs(da[t].logprob - db[t].logprob) < 1e-4 for t in da)
    else:
        assert on == off
    # every layer of every decode step after the prompts' (one batch: STEPS - 1 steps);
    # a CUDA graph counts its capture, not its replays
    if device == "cpu":
        assert len(fused_calls) == _layers(models[model]) * (STEPS - 1)
    else:
        assert fused_calls
    assert all(norm == (model == "qwen3") for norm in fused_calls)


def test_the_tuned_backend_fuses_only_where_triton_won_every_op(
    models, device, monkeypatch, fused_calls, tmp_path
):
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    ref = _generate(models["llama"], device, monkeypatch, "0", kernel_backend="triton")
    rest = "linear=torch,rms_norm=torch,fused_add_rms_norm=torch,silu_and_mul=torch"
    split = f"{rest},paged_attention=triton,store_kv_cache=triton,rotary_embedding=torch"
    got = _generate(
        models["llama"], device, monkeypatch, "1", kernel_backend="tuned", kernel_choices=split
    )
    assert fused_calls == []  # RoPE's winner is another backend: two launches
    assert [t for t, _ in got] == [t for t, _ in ref]
    same = split.replace("rotary_embedding=torch", "rotary_embedding=triton")
    got = _generate(
        models["llama"], device, monkeypatch, "1", kernel_backend="tuned", kernel_choices=same
    )
    assert fused_calls  # triton won all three: its fused launch
    assert [t for t, _ in got] == [t for t, _ in ref]
