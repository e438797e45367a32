"""Linear layers, embedding and LM head, each split across a tensor-parallel group.

Every layer is built with its local (per-rank) shape and knows which slice of a
checkpoint tensor is its own (`checkpoint_slice`), so the loader stays unaware of TP.
With tp.size == 1 each is the plain layer (one rank holds everything, no collective).
- column-parallel (q/k/v, gate/up, LM head): output features split, no communication;
- row-parallel (o_proj, down_proj): input features split, outputs summed (all-reduce);
- vocab-parallel embedding: rows split, each rank embeds its tokens, summed."""

from __future__ import annotations

import torch
from torch import nn

from services.kernels import KernelBackend
from services.models.tensor_parallel import TPGroup, divide, kv_head_range

_SINGLE = TPGroup()


class Linear(nn.Linear):
    """nn.Linear whose matmul is the kernel backend's choice (layout per shape).
    Replicated on every rank."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ops: KernelBackend):
        super().__init__(in_features, out_features, bias=bias)
        self.ops = ops

    def forward(self, x):
        return self.ops.linear(x, self)

    def tp_span(self, shard) -> tuple[int, int, int] | None:
        """(dim, start, size) of this rank's part of a checkpoint weight (shard: a fused
        layer's part, e.g. "q"); None: all of it (replicated)."""
        return None

    def checkpoint_slice(self, leaf: str, shard, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the checkpoint tensor for parameter `leaf`."""
        span = self.tp_span(shard)
        if span is None:
            return tensor
        dim, start, size = span
        if leaf == "bias" and dim == 1:  # a row-parallel bias is added once, by rank 0
            return tensor if self.tp.is_driver else torch.zeros_like(tensor)
        return tensor.narrow(dim, start, size)


class ColumnParallelLinear(Linear):
    """Output features split in equal contiguous parts, rank r holding part r.
    shards: a fused layer's checkpoint parts {shard id: global rows} in order (q, k, v;
    gate, up); each part is split on its own."""

    def __init__(self, in_features, out_features, bias, ops, tp: TPGroup = _SINGLE, shards=None):
        self.tp = tp
        self.shards = shards or {None: out_features}
        self._local = {k: self._rank_rows(k, n)[1] for k, n in self.shards.items()}
        super().__init__(in_features, sum(self._local.values()), bias, ops)

    def _rank_rows(self, shard, rows: int) -> tuple[int, int]:
        """(start, size) of this rank's rows within the shard's global rows."""
        size = divide(rows, self.tp.size, f"{type(self).__name__} output {shard or ''}")
        return self.tp.rank * size, size

    def tp_span(self, shard):
        if self.tp.size == 1:
            return None
        rows = self.shards.get(shard, self.shards.get(None))
        return (0, *self._rank_rows(shard, rows))

    def shard_rows(self, shard) -> tuple[int, int]:
        """(start, size) of a checkpoint shard's rows in this rank's fused weight: the
        shards lie in order, each this rank's part of it."""
        start = 0
        for key, size in self._local.items():
            if key == shard:
                return start, size
            start += size
        raise ValueError(f"{type(self).__name__} has no shard {shard!r}")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q, k, v projection: each rank holds its query heads and its KV heads (one
    KV head replicated on several ranks when there are more ranks than KV heads)."""

    def __init__(self, hidden, head_dim, num_heads, num_kv_heads, bias, ops, tp=_SINGLE):
        self.head_dim = head_dim
        self.kv_heads = kv_head_range(num_kv_heads, tp.size, tp.rank)
        divide(num_heads, tp.size, "num_attention_heads")
        shards = {
            "q": num_heads * head_dim,
            "k": num_kv_heads * head_dim,
            "v": num_kv_heads * head_dim,
        }
        super().__init__(hidden, 0, bias, ops, tp, shards)

    def _rank_rows(self, shard, rows):
        if shard == "q":
            return super()._rank_rows(shard, rows)
        d = self.head_dim
        return self.kv_heads.start * d, len(self.kv_heads) * d


class RowParallelLinear(Linear):
    """Input features split; each rank's partial product is summed over ranks. The
    bias is added once: rank 0 holds it, the others hold zeros. reduce_results=False
    returns the rank's partial product, for a caller that sums it with another partial
    before one all-reduce (an MoE layer's shared expert)."""

    def __init__(
        self, in_features, out_features, bias, ops, tp: TPGroup = _SINGLE, reduce_results=True
    ):
        self.tp = tp
        self.reduce_results = reduce_results
        local = divide(in_features, tp.size, f"{type(self).__name__} input")
        super().__init__(local, out_features, bias, ops)

    def forward(self, x):
        out = self.ops.linear(x, self)
        return self.tp.all_reduce(out) if self.reduce_results else out

    def tp_span(self, shard):
        if self.tp.size == 1:
            return None
        return 1, self.tp.rank * self.in_features, self.in_features


def _vocab_rows(vocab_size: int, tp: TPGroup) -> tuple[int, int]:
    """(start, rows) of this rank's vocabulary; the last ranks' tails are padding when
    the vocabulary does not divide (their logits are cut before sampling)."""
    per = -(-vocab_size // tp.size)
    return tp.rank * per, per


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup = _SINGLE):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, rows = _vocab_rows(vocab_size, tp)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))

    def forward(self, input_ids):
        if self.tp.size == 1:
            return nn.functional.embedding(input_ids, self.weight)
        local = input_ids - self.start
        mine = (local >= 0) & (local < self.weight.shape[0])
        out = nn.functional.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)

    def checkpoint_slice(self, leaf, shard, tensor):
        if self.tp.size == 1:
            return tensor
        part = tensor[self.start : self.start + self.weight.shape[0]]
        if part.shape[0] < self.weight.shape[0]:  # the padded tail: zero rows
            pad = part.new_zeros(self.weight.shape[0] - part.shape[0], *part.shape[1:])
            part = torch.cat([part, pad])
        return part


class ParallelLMHead(Linear):
    """Vocabulary split like the embedding (so tied weights stay tied); each rank's
    logits are gathered into the full vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int, ops, tp: TPGroup = _SINGLE):
        self.tp = tp
        self.vocab_size = vocab_size
        self.start, rows = _vocab_rows(vocab_size, tp)
        super().__init__(hidden_size, rows, False, ops)

    def forward(self, x):
        logits = self.ops.linear(x, self)
        if self.tp.size == 1:
            return logits
        return self.tp.all_gather_last(logits)[..., : self.vocab_size]

    checkpoint_slice = VocabParallelEmbedding.checkpoint_slice
