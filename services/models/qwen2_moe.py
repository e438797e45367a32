"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention with a mixture of
experts in every `decoder_sparse_step`-th layer except `mlp_only_layers` (dense), top-k
routing renormalized only when `norm_topk_prob`, plus a shared expert every token goes
through, weighted by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from services.models.llama import MLP
from services.models.qwen2 import Qwen2ForCausalLM
from services.models.qwen3_moe import Qwen3MoeForCausalLM, qwen_moe_mlp


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    # checkpoint: model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight, mlp.gate.weight
    # (as Qwen3-MoE), mlp.shared_expert.{gate,up,down}_proj.weight, mlp.shared_expert_gate
    expert_modules = Qwen3MoeForCausalLM.expert_modules

    def make_mlp(self, config, ops, layer_idx: int):
        def shared_expert():
            # summed with the routed experts' partial and reduced once (FusedMoE)
            return MLP(
                config,
                ops,
                self.tp,
                intermediate_size=config.shared_expert_intermediate_size,
                reduce_results=False,
            )

        return qwen_moe_mlp(config, ops, self.tp, layer_idx, shared_expert)
