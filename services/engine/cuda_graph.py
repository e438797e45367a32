"""CUDA-graph capture and replay of decode steps.

A decode-only step (one new token per sequence) has the same shapes every time for a
given batch size, so its whole forward pass (all layers plus the LM head) is captured
once per batch size and replayed: one launch instead of hundreds, which is what makes
small-batch decode memory-bound rather than launch-bound. A batch is padded up to the
nearest captured size; padded rows write their KV to slot -1 (skipped by the kernel)
and attend to a single key, and their logits are dropped.

Needs a kernel backend whose ops read every length from device tensors (no host sync,
no data-dependent shapes): `triton` and `aiter`. The torch backend runs eagerly."""

from __future__ import annotations

import logging

import torch

from services.kernels import AttentionMetadata

log = logging.getLogger(__name__)

GRAPH_BACKENDS = ("triton", "aiter")


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, 257, 16))
    return [s for s in sizes if s <= max_batch] or [1]


class CUDAGraphRunner:
    def __init__(
        self,
        model,
        ops,
        *,
        max_batch: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ):
        self.model = model
        self.ops = ops
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        n = self.sizes[-1]
        max_blocks = -(-max_model_len // block_size)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, **i32)
        self.block_tables = torch.zeros(n, max_blocks, **i32)
        self.cu_seqlens_q = torch.arange(n + 1, **i32)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            cu_seqlens_q=self.cu_seqlens_q[: bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        meta = self._metadata(bs)
        self.ops.prepare_attention(meta)
        hidden = self.model(self.input_ids[:bs], self.positions[:bs], meta)
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        # Largest first, so smaller graphs reuse the big one's memory pool.
        for bs in reversed(self.sizes):
            self._forward(bs)  # warm-up: compiles kernels, settles the allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[bs] = self._forward(bs)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()
        log.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def can_run(self, num_seqs: int, max_seq_len: int) -> bool:
        return num_seqs <= self.sizes[-1] and max_seq_len <= self.max_model_len

    @torch.inference_mode()
    def run(self, input_ids, positions, slot_mapping, seq_lens, block_tables) -> torch.Tensor:
        """Inputs are host (CPU) tensors for the real rows; returns their logits."""
        n = input_ids.shape[0]
        bs = next(s for s in self.sizes if s >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        if bs > n:  # padding rows: write nowhere, attend to one key
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(1)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
