"""A mixture-of-experts MLP layer: a router ("gate") and the experts' weights stacked
into two tensors, computed by the kernel backend's one `fused_moe` op, plus an optional
shared expert that every token goes through (Qwen2-MoE). Shared by every MoE family
(Qwen3-MoE, Mixtral, Qwen2-MoE; DeepSeek's grouped routing would add to this module,
not to the engine)."""

from __future__ import annotations

import torch
from torch import nn

from services.kernels import KernelBackend
from services.kernels.fp8 import (
    FP8_DTYPE,
    FP8_FNUZ_DTYPE,
    Fp8Experts,
    Fp8Format,
    expert_scale_shapes,
    fn_to_fnuz,
    fp8_max,
    quantize_weight_per_channel,
)
from services.models.layers import Linear
from services.models.tensor_parallel import TPGroup, divide


class FusedMoE(nn.Module):
    """w13: [E, 2I, H], each expert's gate rows then its up rows; w2: [E, H, I].
    `expert_modules` of the model class maps a checkpoint's per-expert tensor names to
    these (e.g. experts.7.gate_proj -> w13[7, :I]). Under tensor parallelism every rank
    holds every expert, its share I / tp of each expert's MLP width (the experts'
    gate/up split like a column-parallel layer, down like a row-parallel one), and the
    partial outputs are summed; the router is replicated.

    FP8 experts (`use_fp8`: block-FP8 checkpoints such as Qwen3-30B-A3B-FP8, and
    compressed-tensors FP8 ones): w13 / w2 hold the checkpoint's FP8 weights and
    w13_scale / w2_scale their scales as fp8.Fp8Experts lays them out (block: [E, 2I/bn,
    H/bk] / [E, H/bn, I/bk]; channel: [E, 2I] / [E, H], a per-tensor checkpoint's scale
    repeated on every row), passed to fused_moe as an Fp8Experts; on MI300 the weights
    become e4m3fnuz and the scales double, as for an Fp8Linear.

    shared_expert (Qwen2-MoE): a dense MLP every token goes through, weighted by
    sigmoid(shared_expert_gate(x)) (a [H] -> 1 linear) and added to the routed experts'
    sum. It returns each rank's partial output (reduce_results=False), so the layer
    sums both partials and all-reduces once."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        ops: KernelBackend,
        tp: TPGroup | None = None,
        shared_expert: nn.Module | None = None,
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
        self.fp8_format: Fp8Format | None = None
        self.shared_expert = shared_expert
        self.shared_expert_gate = (
            Linear(hidden_size, 1, False, ops) if shared_expert is not None else None
        )

    def use_fp8(self, fmt: Fp8Format, fp8_dtype: torch.dtype) -> None:
        """Keep the experts in FP8 (called on the meta device, before allocation)."""
        e, two_i, h = self.w13.shape
        inter = two_i // 2
        dev = self.w13.device

        def param(*shape, dtype):
            return nn.Parameter(torch.empty(*shape, dtype=dtype, device=dev), requires_grad=False)

        self.w13 = param(e, two_i, h, dtype=fp8_dtype)
        self.w2 = param(e, h, inter, dtype=fp8_dtype)
        shape13, shape2 = expert_scale_shapes(fmt, e, h, inter)
        self.w13_scale = param(*shape13, dtype=torch.float32)
        self.w2_scale = param(*shape2, dtype=torch.float32)
        self.fp8_format = fmt

    entry_gated = False  # the router's logits, as they are

    @property
    def entry_linear(self) -> nn.Module:
        """The router: the linear that reads the layer's input first (DecoderLayer folds
        the norm before it into it)."""
        return self.gate

    def forward(self, x):
        return self.forward_from_entry(self.gate(x), x)

    def forward_from_entry(self, router_logits, x):
        """The layer from the router's logits on (x: the layer's input)."""
        args = (x, router_logits, self.w13, self.w2, self.top_k, self.renormalize)
        if self.fp8_format is None:
            out = self.ops.fused_moe(*args)
        else:
            fp8 = Fp8Experts(self.w13_scale, self.w2_scale, self.fp8_format)
            out = self.ops.fused_moe(*args, fp8=fp8)
        if self.shared_expert is not None:  # routed + gated shared, as transformers sums
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)

    def weight_pieces(self) -> dict[str, set]:
        """What a checkpoint must provide for each parameter: (expert, shard) pieces."""
        e = range(self.num_experts)
        pieces = {
            "w13": {(i, s) for i in e for s in (0, 1)},
            "w2": {(i, None) for i in e},
        }
        if self.fp8_format is not None:
            pieces["w13_scale"] = pieces["w13"]
            pieces["w2_scale"] = pieces["w2"]
        return pieces

    def load_expert(
        self, param: str, expert: int, shard, tensor: torch.Tensor, converted: bool = False
    ) -> None:
        """One expert's checkpoint tensor (gate / up: shard 0 / 1 of w13; down: w2), or
        with FP8 experts its scales (param w13_scale / w2_scale). converted: already
        in the experts' FP8 type and scale convention (online quantization)."""
        target = getattr(self, param).data[expert]
        size = self.intermediate_size  # this rank's share of I, along dim `split`
        split = 0 if shard is not None else 1
        fmt = self.fp8_format
        if fmt is not None and not converted:
            tensor = self._fp8_checkpoint_tensor(param, expert, tensor)
        if fmt is not None and param.endswith("_scale"):
            if fmt.granularity == "block":  # sizes along I in scale blocks
                size //= fmt.block_n if shard is not None else fmt.block_k
            else:  # channel: a scale per output row ([N, 1], [N]; per-tensor [1])
                tensor = tensor.reshape(-1)
                rows = size * self.tp.size if shard is not None else target.shape[0]
                if tensor.numel() == 1:
                    tensor = tensor.expand(rows)  # a per-tensor scale on every row: exact
                if shard is None:
                    split = None  # down's rows are H: every rank has all of them
        if shard is not None:
            target = target[shard * size : (shard + 1) * size]
        if self.tp.size > 1 and split is not None:  # this rank's share of the width
            tensor = tensor.narrow(split, self.tp.rank * size, size)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"expert {expert} {param} shard {shard}: checkpoint shape "
                f"{tuple(tensor.shape)}, model expects {tuple(target.shape)}"
            )
        target.copy_(tensor)

    def quantize_expert(self, param: str, expert: int, shard, tensor: torch.Tensor) -> None:
        """Online quantization (`quantization="fp8"`): an expert's full-precision
        checkpoint tensor -> FP8 with a scale per output row, computed over the whole
        row before this rank takes its part, so every tensor-parallel split holds the
        same FP8 weights (as Fp8Linear.quantize_rows)."""
        if self.fp8_format is None or self.fp8_format.granularity != "channel":
            raise ValueError(f"expert {expert} {param}: online quantization makes channel experts")
        # on the experts' device: a 30B MoE quantizes in seconds there, minutes on a CPU
        q, scale = quantize_weight_per_channel(tensor.to(self.w13.device), self.w13.dtype)
        self.load_expert(param, expert, shard, q, converted=True)
        self.load_expert(f"{param}_scale", expert, shard, scale, converted=True)

    def fill_random(self, generator: torch.Generator, amplitude: float) -> None:
        """Dummy FP8 experts (load_format="dummy"): uniform in +-amplitude once
        dequantized, drawn one expert at a time on the experts' device."""
        for weight, scale in ((self.w13, self.w13_scale), (self.w2, self.w2_scale)):
            top = fp8_max(weight.dtype)
            for w in weight.data:
                tmp = torch.empty(w.shape, device=w.device, dtype=torch.float32)
                w.copy_(tmp.uniform_(-top, top, generator=generator).to(w.dtype))
            scale.data.fill_(amplitude / top)

    def _fp8_checkpoint_tensor(self, param: str, expert: int, tensor: torch.Tensor):
        """An FP8 expert's weight (float8_e4m3fn, converted to fnuz where the experts are)
        or fp32 scales (doubled for fnuz): weight * scale stays what the checkpoint has."""
        fnuz = self.w13.dtype == FP8_FNUZ_DTYPE
        if param.endswith("_scale"):
            return tensor.float() * 2 if fnuz else tensor.float()
        if tensor.dtype != FP8_DTYPE:
            raise ValueError(
                f"expert {expert} {param}: the quantization config keeps the experts in FP8, "
                f"but the checkpoint tensor is {tensor.dtype}"
            )
        return fn_to_fnuz(tensor)[0] if fnuz else tensor
