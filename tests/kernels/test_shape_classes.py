"""The tuned backend's vocabulary: shape classes by token count and batch kind, the
candidates each op and class may use (capture-safe ones only for decode classes), and
the "op[.class]=candidate" overrides. Needs no triton: nothing here runs a kernel."""

from __future__ import annotations

import pytest
import torch

from services.kernels.shape_classes import (
    OP_CLASSES,
    KernelShapes,
    all_keys,
    attention_class,
    candidates_for,
    parse_choices,
    token_class,
)
from tests.kernels.helpers import make_attention_batch


def test_all_keys_cover_every_op_and_class():
    dense = KernelShapes(64, 4, 2, 16, 96, 16, "float32")
    moe = KernelShapes(64, 4, 2, 16, 96, 16, "float32", 1e-5, 8, 2, 32)
    moe_fp8 = KernelShapes(**{**moe.__dict__, "weight_quant": "fp8_block_128x128"})
    everything = {f"{op}.{c}" for op, cs in OP_CLASSES.items() for c in cs}
    assert all_keys(moe_fp8) == everything
    assert all_keys(moe) == {k for k in everything if "fp8_linear" not in k}
    unquantized_dense = {k for k in everything if "fused_moe" not in k and "fp8" not in k}
    assert all_keys(dense) == all_keys() == unquantized_dense
    assert "paged_attention.mixed" in all_keys() and "linear.mixed" not in all_keys()


def test_moe_shapes_from_the_config():
    from transformers import LlamaConfig, MixtralConfig, Qwen3MoeConfig

    common = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    qwen = Qwen3MoeConfig(
        **common,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
    )
    shapes = KernelShapes.from_hf_config(qwen, 16, "float32")
    assert (shapes.num_experts, shapes.top_k, shapes.moe_intermediate_size) == (8, 2, 32)
    mixtral = MixtralConfig(**common, intermediate_size=96, num_local_experts=4)
    shapes = KernelShapes.from_hf_config(mixtral, 16, "float32")
    assert (shapes.num_experts, shapes.top_k, shapes.moe_intermediate_size) == (4, 2, 96)
    dense = KernelShapes.from_hf_config(LlamaConfig(**common, intermediate_size=96), 16, "float32")
    assert (dense.num_experts, dense.top_k, dense.moe_intermediate_size) == (0, 0, 0)
    with pytest.raises(ValueError, match="top_k"):
        KernelShapes(64, 4, 2, 16, 96, 16, "float32", 1e-5, 8, 9, 32)


def test_shapes_carry_the_models_layer_count():
    from transformers import LlamaConfig

    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=7)
    assert KernelShapes.from_hf_config(hf, 16, "float32").num_layers == 7
    with pytest.raises(ValueError, match="num_layers"):
        KernelShapes(64, 4, 2, 16, 96, 16, "float32", num_layers=0)


def test_parse_choices():
    assert parse_choices("rms_norm=triton, paged_attention.prefill=sdpa") == {
        "rms_norm.decode1": "triton",
        "rms_norm.decode8": "triton",
        "rms_norm.decode64": "triton",
        "rms_norm.decode256": "triton",
        "rms_norm.prefill": "triton",
        "paged_attention.prefill": "sdpa",
    }
    assert parse_choices({"linear.prefill": "torch"}) == {"linear.prefill": "torch"}
    assert parse_choices(None) == {} and parse_choices("") == {}
    for bad, msg in [
        ("gemm=torch", "unknown kernel op"),
        ("rms_norm.mixed=torch", "classes"),
        ("rms_norm=cutlass", "not a candidate"),
        ("paged_attention.decode8=sdpa", "not a candidate"),  # cannot be captured
        ("store_kv_cache.decode64=torch", "not a candidate"),  # padded slot -1
        ("rms_norm", "op\\[.class\\]=candidate"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_choices(bad)


def test_own_triton_linear_is_a_candidate_up_to_decode8_only():
    # its GEMV covers up to 8 rows; above that it is cuBLAS, i.e. torch again
    assert "triton" in candidates_for("linear", "decode1")
    assert "triton" in candidates_for("linear", "decode8")
    for cls in ("decode64", "decode256", "prefill"):
        assert "triton" not in candidates_for("linear", cls)
        assert "torch" in candidates_for("linear", cls)
    assert parse_choices("linear.decode8=triton") == {"linear.decode8": "triton"}
    with pytest.raises(ValueError, match="not a candidate for linear.prefill"):
        parse_choices("linear.prefill=triton")


def test_attention_class(device):
    def meta(q_lens, ctx):
        return make_attention_batch(
            q_lens,
            ctx,
            block_size=16,
            num_q_heads=2,
            num_kv_heads=2,
            head_dim=16,
            dtype=torch.float32,
            device=device,
        )[3]

    assert attention_class(meta([1], [5])) == "decode1"
    assert attention_class(meta([1, 1], [5, 9])) == "decode8"
    assert attention_class(meta([1] * 9, [5] * 9)) == "decode64"
    assert token_class(1) == "decode1"
    assert token_class(2) == token_class(8) == "decode8"
    assert token_class(9) == token_class(64) == "decode64"
    assert token_class(256) == "decode256" and token_class(257) == "prefill"
    assert attention_class(meta([4, 7], [0, 3])) == "prefill"
    assert attention_class(meta([4, 1], [0, 3])) == "mixed"
    m = meta([4, 7], [0, 3])
    m.cu_seqlens_q_cpu = None  # no host lengths: cannot prove it is prompt-only
    assert attention_class(m) == "mixed"


def test_mixed_graphs_keep_capturable_candidates_only():
    """A GPU tuner picks, for the classes mixed-step graphs run, only what they can
    capture; an explicit override may still choose the rest (mixed steps then run
    eagerly, mixed_graph_blocker naming the pick)."""
    assert "torch" in candidates_for("store_kv_cache", "prefill")
    assert "torch" not in candidates_for("store_kv_cache", "prefill", mixed_graphs=True)
    assert "torch" not in candidates_for("fused_moe", "prefill", mixed_graphs=True)
    assert candidates_for("paged_attention", "mixed", mixed_graphs=True) == ("triton",)
    # prefill-only attention never runs inside a mixed graph: every candidate stays
    assert "sdpa" in candidates_for("paged_attention", "prefill", mixed_graphs=True)
    assert "sdpa" in candidates_for("paged_attention", "mixed", graphs=False, mixed_graphs=True)
    assert parse_choices("paged_attention.mixed=sdpa") == {"paged_attention.mixed": "sdpa"}
