"""Fp8Linear: a linear layer whose weight stays in FP8 e4m3 in memory (a byte per
weight, so a 70B model fits one H200), with its float32 scales and an explicit
Fp8Format (services/kernels/fp8.py) saying how they cover the weight. The kernel
backend's `linear` computes it (`ops.linear(x, layer)`, like every Linear); the
loader builds these in place of `Linear` where the quantization config says so
(loader.py, quantization.py) and fills them through `load_weight` / `load_scale`.

The weight's type is the platform's (fp8.platform_fp8_dtype, chosen by the loader):
float8_e4m3fn, or float8_e4m3fnuz on MI300, where the checkpoint's e4m3fn weights are
converted as they load (fp8.fn_to_fnuz: same bits, 0x80 -> 0) and every scale is
doubled, which keeps weight * scale exactly as the checkpoint has it."""

from __future__ import annotations

import torch
from torch import nn

from services.kernels import KernelBackend
from services.kernels.fp8 import (
    FP8_DTYPE,
    FP8_DTYPES,
    FP8_FNUZ_DTYPE,
    Fp8Format,
    fn_to_fnuz,
    fp8_max,
    quantize_weight_per_channel,
)
from services.models.layers import RowParallelLinear


class Fp8Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        fmt: Fp8Format,
        ops: KernelBackend,
        bias_dtype: torch.dtype = torch.float32,
        fp8_dtype: torch.dtype = FP8_DTYPE,
        block_key: str = "weight_block_size",
    ):
        super().__init__()
        if fp8_dtype not in FP8_DTYPES:
            raise ValueError(f"FP8 weights are one of {FP8_DTYPES}, not {fp8_dtype}")
        self.in_features = in_features
        self.out_features = out_features
        self.fp8_format = fmt  # a plain attribute: kernels read it (fp8_format_of)
        self.ops = ops
        # the quantization_config key naming the scale blocks (refusals name it)
        self.block_key = block_key
        shape = fmt.scale_shape(out_features, in_features)
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=fp8_dtype), requires_grad=False
        )
        self.weight_scale = nn.Parameter(
            torch.empty(shape, dtype=torch.float32), requires_grad=False
        )
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=bias_dtype), requires_grad=False
            )
        else:
            self.register_parameter("bias", None)

    @classmethod
    def replacing(
        cls,
        linear: nn.Linear,
        fmt: Fp8Format,
        fp8_dtype: torch.dtype = FP8_DTYPE,
        block_key: str = "weight_block_size",
    ) -> Fp8Linear:
        """An Fp8Linear of the same shape, on the same device (the loader swaps them on
        the meta device, before any memory is allocated), its weight in `fp8_dtype`."""
        bias = linear.bias
        with torch.device(linear.weight.device):
            layer = cls(
                linear.in_features,
                linear.out_features,
                bias is not None,
                fmt,
                linear.ops,
                bias.dtype if bias is not None else torch.float32,
                fp8_dtype,
                block_key,
            )
        # tensor parallelism: the replaced layer's split (plain attributes, no submodule)
        layer.__dict__["tp_span"] = linear.tp_span
        layer.__dict__["checkpoint_slice"] = linear.checkpoint_slice
        if hasattr(linear, "shard_rows"):  # a fused layer's checkpoint shards
            layer.__dict__["shard_rows"] = linear.shard_rows
        row = isinstance(linear, RowParallelLinear) and linear.tp.size > 1 and linear.reduce_results
        layer.__dict__["reduce"] = linear.tp if row else None
        return layer

    def forward(self, x):
        out = self.ops.linear(x, self)
        reduce = self.__dict__.get("reduce")  # row-parallel: sum the ranks' partials
        return out if reduce is None else reduce.all_reduce(out)

    def scale_slice(self, shard, tensor: torch.Tensor, per_tensor: bool) -> torch.Tensor:
        """This rank's part of a checkpoint scale tensor: the scales of its rows
        (column-parallel) or of its K blocks (row-parallel, block scales); per-tensor
        and per-channel scales of a row-parallel layer are whole."""
        span = self.__dict__["tp_span"](shard) if "tp_span" in self.__dict__ else None
        if span is None or per_tensor:
            return tensor
        dim, start, size = span
        fmt = self.fp8_format
        if fmt.granularity != "block":
            return tensor if dim == 1 else tensor.narrow(0, start, size)
        block = fmt.block_n if dim == 0 else fmt.block_k
        if start % block:
            raise ValueError(
                f"quantization_config.{self.block_key} [{fmt.block_n}, {fmt.block_k}]: "
                f"this tensor-parallel rank's {'rows' if dim == 0 else 'columns'} start at "
                f"{start}, inside a scale block; use a tensor_parallel_size that splits "
                "the layer on block boundaries"
            )
        return tensor.narrow(dim, start // block, -(-size // block))

    def extra_repr(self) -> str:
        fmt = self.fp8_format
        blocks = f" {fmt.block_n}x{fmt.block_k}" if fmt.granularity == "block" else ""
        fnuz = " (e4m3fnuz)" if self.fnuz else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, fp8 {fmt.granularity}{blocks}{fnuz}"
        )

    @property
    def fnuz(self) -> bool:
        """Whether the weight is float8_e4m3fnuz: checkpoint (e4m3fn) weights are
        converted as they load and their scales doubled."""
        return self.weight.dtype == FP8_FNUZ_DTYPE

    # ---- loading -------------------------------------------------------------------
    def load_weight(self, tensor: torch.Tensor, start: int, size: int, name: str) -> None:
        """Output rows start:start+size from a float8_e4m3fn checkpoint tensor
        (converted to fnuz for an fnuz layer; load_scale doubles its scales)."""
        if tensor.dtype != FP8_DTYPE:
            raise ValueError(
                f"{name}: the quantization config makes this layer FP8, but the checkpoint "
                f"holds {tensor.dtype} (expected float8_e4m3fn)"
            )
        if self.fnuz:
            tensor, _ = fn_to_fnuz(tensor)
        _copy_rows(self.weight.data[start : start + size], tensor, name)

    def load_scale(
        self, tensor: torch.Tensor, start: int, size: int, name: str, per_tensor: bool
    ) -> None:
        """The scales of output rows start:start+size. `per_tensor`: the checkpoint has one
        scale for the whole shard (a fused layer then holds it per row: exact, no
        requantization). An fnuz layer keeps them doubled (see load_weight)."""
        fmt, dst = self.fp8_format, self.weight_scale.data
        tensor = tensor.float() * 2 if self.fnuz else tensor
        if fmt.granularity == "block":
            n0 = start // fmt.block_n
            rows = -(-size // fmt.block_n)
            _copy_rows(dst[n0 : n0 + rows], tensor.float(), name)
        elif per_tensor:
            if tensor.numel() != 1:
                raise ValueError(f"{name}: a per-tensor scale has shape {tuple(tensor.shape)}")
            if fmt.granularity == "channel":
                dst[start : start + size] = tensor.float().reshape(())
            else:
                dst.copy_(tensor.float().reshape(()))
        else:
            # compressed-tensors writes per-channel scales as [N, 1]
            if tensor.numel() != size or tensor.dim() not in (1, 2) or tensor.shape[0] != size:
                raise ValueError(
                    f"{name}: shape {tuple(tensor.shape)}, expected [{size}, 1] or [{size}] "
                    "(one scale per output channel)"
                )
            dst[start : start + size] = tensor.float().reshape(size)

    def quantize_rows(
        self, tensor: torch.Tensor, start: int, size: int, name: str, shard=None
    ) -> None:
        """Online quantization: a checkpoint's full-precision tensor -> FP8 with a scale
        per output row, computed over the whole row before this rank takes its part, so
        every tensor-parallel split holds the same FP8 weights."""
        if self.fp8_format.granularity != "channel":
            raise ValueError(f"{name}: online quantization makes per-channel FP8 layers only")
        # on the layer's device: an 8B model quantizes in a second there, minutes on a CPU
        q, scale = quantize_weight_per_channel(tensor.to(self.weight.device), self.weight.dtype)
        q = self.checkpoint_slice("weight", shard, q) if "checkpoint_slice" in self.__dict__ else q
        scale = self.scale_slice(shard, scale, per_tensor=False)
        if tuple(q.shape) != (size, self.in_features):
            raise ValueError(
                f"weight {name!r}: checkpoint shape {tuple(tensor.shape)}, model expects "
                f"{(size, self.in_features)}"
            )
        self.weight.data[start : start + size] = q
        self.weight_scale.data[start : start + size] = scale

    def fill_random(self, generator: torch.Generator, amplitude: float) -> None:
        """Dummy weights (load_format="dummy"): uniform in +-amplitude once dequantized,
        drawn row chunk by row chunk on the layer's device (no full fp32 copy)."""
        w = self.weight.data
        top = fp8_max(w.dtype)
        chunk = max(1, (1 << 26) // max(1, self.in_features))
        for r in range(0, w.shape[0], chunk):
            rows = w[r : r + chunk]
            tmp = torch.empty(rows.shape, device=w.device, dtype=torch.float32)
            rows.copy_(tmp.uniform_(-top, top, generator=generator).to(w.dtype))
        self.weight_scale.data.fill_(amplitude / top)
        if self.bias is not None:
            self.bias.data.uniform_(-amplitude, amplitude, generator=generator)


def _copy_rows(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"{name}: shape {tuple(src.shape)} in the checkpoint, the model expects "
            f"{tuple(dst.shape)}"
        )
    dst.copy_(src)
