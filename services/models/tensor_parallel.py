"""One rank's place in a tensor-parallel group, and the group's collectives.

The process group is built on a store the caller owns (ProcessGroupGloo on CPU,
ProcessGroupNCCL on GPU) instead of torch.distributed's process-wide default group, so
several engines, each with its own group, can live in one process (tests do)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def divide(total: int, parts: int, what: str) -> int:
    if total % parts:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size {parts}")
    return total // parts


def kv_head_range(total_kv_heads: int, tp_size: int, rank: int) -> range:
    """The KV heads rank `rank` holds: an equal share, or with more ranks than heads,
    one head replicated on tp_size / total ranks (vLLM's rule; kvtransfer's
    kv_heads_of_rank is the same rule, on the other side of a transfer)."""
    if tp_size <= total_kv_heads:
        per = divide(total_kv_heads, tp_size, "num_key_value_heads")
        return range(rank * per, (rank + 1) * per)
    if tp_size % total_kv_heads:
        raise ValueError(
            f"tensor_parallel_size {tp_size} is larger than num_key_value_heads "
            f"{total_kv_heads} and not a multiple of it: the KV heads cannot be replicated "
            "evenly"
        )
    head = rank // (tp_size // total_kv_heads)
    return range(head, head + 1)


def check_split(hf_config, tp_size: int) -> None:
    """Refuse, naming the config.json key, a model that tp_size ranks cannot split."""
    if tp_size == 1:
        return
    heads = hf_config.num_attention_heads
    divide(heads, tp_size, "num_attention_heads")
    kv_head_range(getattr(hf_config, "num_key_value_heads", None) or heads, tp_size, 0)
    for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        width = getattr(hf_config, key, None)
        if width:
            divide(width, tp_size, key)


class TPGroup:
    """rank / size and the collectives the model's parallel layers call. size 1 has
    no process group: every collective is the identity."""

    def __init__(self, rank: int = 0, size: int = 1, process_group=None):
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"bad tensor-parallel rank {rank} of {size}")
        if size > 1 and process_group is None:
            raise ValueError("a tensor-parallel group of several ranks needs a process group")
        self.rank = rank
        self.size = size
        self._pg = process_group

    @classmethod
    def connect(
        cls, store, rank: int, size: int, device: torch.device, timeout_s: float
    ) -> TPGroup:
        """Join the group whose ranks meet at `store` (a torch.distributed.TCPStore)."""
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            pg = dist.ProcessGroupGloo(store, rank, size, timeout)
        return cls(rank, size, pg)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        if self.size > 1:
            self._pg.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dimension."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self._pg.allgather([parts], [x.contiguous()]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank, in place."""
        if self.size > 1:
            self._pg.broadcast([x], 0).wait()
        return x

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"
