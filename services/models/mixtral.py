"""Mixtral (8x7B, 8x22B): the Mistral decoder with a mixture-of-experts MLP in every
layer, top-2 of 8 experts, always renormalized."""

from __future__ import annotations

from services.models.llama import LlamaForCausalLM
from services.models.moe import FusedMoE


class MixtralForCausalLM(LlamaForCausalLM):
    # checkpoint: model.layers.N.block_sparse_moe.experts.E.w{1,2,3}.weight (w1 gate,
    # w3 up, w2 down) and block_sparse_moe.gate.weight; ours live under `mlp`
    expert_modules = {"w1": ("w13", 0), "w3": ("w13", 1), "w2": ("w2", None)}
    checkpoint_renames = {".block_sparse_moe.": ".mlp."}

    def make_mlp(self, config, ops, layer_idx: int):
        return FusedMoE(
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_size,
            config.intermediate_size,
            True,
            ops,
            self.tp,
        )
