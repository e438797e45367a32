"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norm) with a
mixture-of-experts MLP in every `decoder_sparse_step`-th layer except `mlp_only_layers`,
which keep a dense MLP; top-k routing renormalized when `norm_topk_prob`."""

from __future__ import annotations

from services.models.llama import MLP
from services.models.moe import FusedMoE
from services.models.qwen3 import Qwen3ForCausalLM


def qwen_moe_mlp(config, ops, tp, layer_idx: int, shared_expert=None):
    """Layer layer_idx's MLP in the Qwen MoE families (Qwen2-MoE, Qwen3-MoE): the experts
    in every decoder_sparse_step-th layer not in mlp_only_layers, else a dense MLP.
    shared_expert: makes Qwen2-MoE's shared expert for a layer with experts."""
    sparse = (
        layer_idx not in (config.mlp_only_layers or [])
        and config.num_experts > 0
        and (layer_idx + 1) % config.decoder_sparse_step == 0
    )
    if not sparse:
        return MLP(config, ops, tp)
    return FusedMoE(
        config.num_experts,
        config.num_experts_per_tok,
        config.hidden_size,
        config.moe_intermediate_size,
        bool(config.norm_topk_prob),
        ops,
        tp,
        shared_expert=shared_expert() if shared_expert is not None else None,
    )


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    # checkpoint: model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight, mlp.gate.weight
    expert_modules = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}

    def make_mlp(self, config, ops, layer_idx: int):
        return qwen_moe_mlp(config, ops, self.tp, layer_idx)
