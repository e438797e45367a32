"""FP8 weights under tensor parallelism (CPU, gloo, real rank processes): each rank
keeps its rows (column-parallel) or columns (row-parallel) of every FP8 weight with
their scales, and TP=2 equals TP=1 on the same checkpoint; a block-quantized layer
that TP would split inside a scale block is refused by name."""

from __future__ import annotations

import multiprocessing

import pytest

from services.engine import LLM, SamplingParams
from tests.engine.fp8_helpers import (
    BLOCK,
    PROJECTIONS,
    fake_quant_activations,
    is_proj,
    prompts,
    quantize_block,
    random_llama,
    write_checkpoints,
)
from tests.engine.helpers import assert_all_blocks_free, hf_greedy, hf_load, hf_logprobs
from tests.engine.test_fp8_checkpoints import (
    CT_IGNORED,
    block_fp8,  # noqa: F401 - fixtures
    compressed_tensors,  # noqa: F401
    unquantized,  # noqa: F401
)

PARAMS = SamplingParams(temperature=0, max_tokens=8, logprobs=1, ignore_eos=True)


@pytest.fixture(scope="module")
def aligned_block_fp8(tmp_path_factory):
    # every TP=2 split falls on a 128 block: q / kv rows 128, MLP width 256 per rank
    config, model = random_llama(hidden=256, heads=2, kv_heads=2, head_dim=128, inter=512)
    tensors, deq = {}, {}
    for name, value in model.state_dict().items():
        if is_proj(name):
            q, scale, d = quantize_block(value)
            tensors[name] = q
            tensors[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
            deq[name] = d
        else:
            tensors[name] = deq[name] = value
    qconf = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [BLOCK, BLOCK],
    }
    return write_checkpoints(tmp_path_factory.mktemp("aligned"), config, model, tensors, deq, qconf)


def _run(path, tp, **extra):
    with LLM(str(path), tensor_parallel_size=tp, **extra) as llm:
        outs = llm.generate(prompts(), PARAMS)
        assert_all_blocks_free(llm)
    return outs


def _gap(want, got) -> float:
    worst = 0.0
    for a, b in zip(want, got, strict=True):
        assert a.output.token_ids == b.output.token_ids
        for x, y, t in zip(a.output.logprobs, b.output.logprobs, a.output.token_ids):
            worst = max(worst, abs(x[t].logprob - y[t].logprob))
    return worst


def test_block_fp8_tp2_equals_tp1(aligned_block_fp8):
    # the same 128-wide activation groups on both: only fp32 summation order differs
    path = aligned_block_fp8[0]
    assert _gap(_run(path, 1), _run(path, 2)) < TOL_SAME_GROUPS


def _emulated_tp2(reference, skip=()):
    """transformers on the dequantized weights with the activations quantized as two
    ranks quantize them: per token over all K, except the row-parallel o_proj and
    down_proj, whose ranks each scale their half of K."""
    hf = hf_load(reference)
    names = [n for n, _ in hf.named_modules() if n.rpartition(".")[2] in PROJECTIONS]
    for leaf in ("o_proj", "down_proj"):
        half = next(m for n, m in hf.named_modules() if n.endswith(leaf)).in_features // 2
        others = [n for n in names if not n.endswith(leaf)] + list(skip)
        fake_quant_activations(hf, half, others)
    row = [n for n in names if n.endswith(("o_proj", "down_proj"))]
    return fake_quant_activations(hf, None, row + list(skip))


def test_per_channel_fp8_tp2_equals_its_emulation(compressed_tensors, unquantized):  # noqa: F811
    # per-channel weights (compressed-tensors and online quantization): the same
    # semantics as TP=1 except where each rank scales activations over its K columns
    # (as vLLM's do), so the reference is transformers emulating exactly that
    _, ct_q, ct_ref = compressed_tensors
    cases = ((ct_q, ct_ref, {}, [CT_IGNORED]), (*unquantized, {"quantization": "fp8"}, []))
    for path, reference, extra, skip in cases:
        # the reference kernels, as fp8_helpers.compare needs for an exact emulation
        outs = _run(path, 2, kernel_backend="torch", **extra)
        emulated = _emulated_tp2(reference, skip)
        for prompt, out in zip(prompts(), outs):
            tokens = out.output.token_ids
            assert tokens == hf_greedy(emulated, prompt, len(tokens), ignore_eos=True)
            ref_lp = hf_logprobs(emulated, prompt + tokens[:-1])[len(prompt) - 1 :]
            for pos, (token, entry) in enumerate(zip(tokens, out.output.logprobs)):
                assert entry[token].logprob == pytest.approx(ref_lp[pos, token].item(), abs=1e-3)


def test_block_split_inside_a_scale_block_is_refused(block_fp8):  # noqa: F811
    # MLP width 640: 320 rows per rank, not a multiple of the 128-row scale blocks
    with pytest.raises(ValueError, match="weight_block_size"):
        LLM(str(block_fp8[0]), tensor_parallel_size=2)
    # the refusal comes while loading weights, after rank 1 started: it is stopped too
    # (left running, its process group aborted this test process at exit)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tp-rank")]


TOL_SAME_GROUPS = 1e-3


def test_block_fp8_moe_tp2_equals_tp1(tmp_path):
    """FP8 experts under TP=2: each rank keeps its 128 columns of every expert's
    width (gate / up rows, down columns) with their block scales; the same 128-wide
    activation groups on both, so only fp32 summation order differs."""
    from tests.engine.test_fp8_moe import write_fp8_moe_checkpoint

    # q, k and v 128 rows per rank, experts and the dense MLP 128 wide per rank
    path, _, _ = write_fp8_moe_checkpoint(
        tmp_path, moe_intermediate_size=256, num_attention_heads=4, num_key_value_heads=4,
        head_dim=64,
    )  # fmt: skip
    assert _gap(_run(path, 1), _run(path, 2)) < TOL_SAME_GROUPS
