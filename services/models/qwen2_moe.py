"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention with a mixture of
experts in every `decoder_sparse_step`-th layer except `mlp_only_layers` (dense), top-k
routing renormalized only when `norm_topk_prob`, plus a shared expert every token goes
through, weighted by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from services.models.llama import MLP
from services.models.moe import FusedMoE
from services.models.qwen2 import Qwen2ForCausalLM


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    # checkpoint: model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight, mlp.gate.weight,
    # mlp.shared_expert.{gate,up,down}_proj.weight and mlp.shared_expert_gate.weight
    expert_modules = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}

    def make_mlp(self, config, ops, layer_idx: int):
        sparse = (
            layer_idx not in (config.mlp_only_layers or [])
            and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0
        )
        if not sparse:
            return MLP(config, ops, self.tp)
        shared = MLP(
            config,
            ops,
            self.tp,
            intermediate_size=config.shared_expert_intermediate_size,
            reduce_results=False,  # summed with the routed experts' partial, reduced once
        )
        return FusedMoE(
            config.num_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.moe_intermediate_size,
            bool(config.norm_topk_prob),
            ops,
            self.tp,
            shared_expert=shared,
        )
