"""A mixture-of-experts MLP layer: a router ("gate") and the experts' weights stacked
into two tensors, computed by the kernel backend's one `fused_moe` op. Shared by every
MoE family (Qwen3-MoE, Mixtral; Qwen2-MoE's shared expert or DeepSeek's grouped routing
would add to this module, not to the engine)."""

from __future__ import annotations

import torch
from torch import nn

from services.kernels import KernelBackend
from services.models.layers import Linear
from services.models.tensor_parallel import TPGroup, divide


class FusedMoE(nn.Module):
    """w13: [E, 2I, H], each expert's gate rows then its up rows; w2: [E, H, I].
    `expert_modules` of the model class maps a checkpoint's per-expert tensor names to
    these (e.g. experts.7.gate_proj -> w13[7, :I]). Under tensor parallelism every rank
    holds every expert, its share I / tp of each expert's MLP width (the experts'
    gate/up split like a column-parallel layer, down like a row-parallel one), and the
    partial outputs are summed; the router is replicated."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        ops: KernelBackend,
        tp: TPGroup | None = None,
    ):
        super().__init__()
        self.tp = tp or TPGroup()
        intermediate_size = divide(intermediate_size, self.tp.size, "the experts' MLP width")
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
        out = self.ops.fused_moe(x, router_logits, self.w13, self.w2, self.top_k, self.renormalize)
        return self.tp.all_reduce(out)

    def weight_pieces(self) -> dict[str, set]:
        """What a checkpoint must provide for each parameter: (expert, shard) pieces."""
        e = range(self.num_experts)
        return {
            "w13": {(i, s) for i in e for s in (0, 1)},
            "w2": {(i, None) for i in e},
        }

    def load_expert(self, param: str, expert: int, shard, tensor: torch.Tensor) -> None:
        target = getattr(self, param).data[expert]
        size = self.intermediate_size
        if shard is not None:
            target = target[shard * size : (shard + 1) * size]
        if self.tp.size > 1:  # this rank's share of the expert's width
            tensor = tensor.narrow(0 if shard is not None else 1, self.tp.rank * size, size)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"expert {expert} {param} shard {shard}: checkpoint shape "
                f"{tuple(tensor.shape)}, model expects {tuple(target.shape)}"
            )
        target.copy_(tensor)
