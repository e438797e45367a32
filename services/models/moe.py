"""A mixture-of-experts MLP layer: a router ("gate") and the experts' weights stacked
into two tensors, computed by the kernel backend's one `fused_moe` op. Shared by every
MoE family (Qwen3-MoE, Mixtral; Qwen2-MoE's shared expert or DeepSeek's grouped routing
would add to this module, not to the engine)."""

from __future__ import annotations

import torch
from torch import nn

from services.kernels import KernelBackend
from services.models.llama import Linear


class FusedMoE(nn.Module):
    """w13: [E, 2I, H], each expert's gate rows then its up rows; w2: [E, H, I].
    `expert_modules` of the model class maps a checkpoint's per-expert tensor names to
    these (e.g. experts.7.gate_proj -> w13[7, :I])."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        ops: KernelBackend,
    ):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, {num_experts}]")
        self.ops = ops
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.intermediate_size = intermediate_size
        self.gate = Linear(hidden_size, num_experts, False, ops)  # the router
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x):
        router_logits = self.gate(x)
        return self.ops.fused_moe(x, router_logits, self.w13, self.w2, self.top_k, self.renormalize)

    def weight_pieces(self) -> dict[str, set]:
        """What a checkpoint must provide for each parameter: (expert, shard) pieces."""
        e = range(self.num_experts)
        return {
            "w13": {(i, s) for i in e for s in (0, 1)},
            "w2": {(i, None) for i in e},
        }

    def load_expert(self, param: str, expert: int, shard, tensor: torch.Tensor) -> None:
        target = getattr(self, param).data[expert]
        if shard is not None:
            size = self.intermediate_size
            target = target[shard * size : (shard + 1) * size]
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"expert {expert} {param} shard {shard}: checkpoint shape "
                f"{tuple(tensor.shape)}, model expects {tuple(target.shape)}"
            )
        target.copy_(tensor)
