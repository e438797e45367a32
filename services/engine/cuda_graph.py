"""CUDA-graph capture and replay of decode steps.

A decode-only step (one new token per sequence) has the same shapes every time for a
given batch size, so its whole forward pass (all layers plus the LM head) is captured
once per batch size and replayed: one launch instead of hundreds, which is what makes
small-batch decode memory-bound rather than launch-bound. A batch is padded up to the
nearest captured size; padded rows write their KV to slot -1 (skipped by the kernel)
and attend to a single key, and their logits are dropped.

Needs a kernel backend whose ops read every length from device tensors (no host sync,
no data-dependent shapes): `triton`, `aiter` and `tuned`. The torch backend runs eagerly."""

from __future__ import annotations

import logging

import torch

from services.engine.block_table_staging import BlockTableStager
from services.kernels import AttentionMetadata
from services.kernels.shape_classes import DECODE_CLASSES

log = logging.getLogger(__name__)

# tuned: its tuner only considers capture-safe candidates for decode-sized batches
GRAPH_BACKENDS = ("triton", "aiter", "tuned")


def decode_graph_max_batch(max_batch: int, ops) -> int:
    """The largest decode batch to capture. Past the largest decode class a batch takes
    the prefill class's picks; if the backend says one of them cannot be captured (an
    explicit override), graphs stop at that class, logged, rather than fail to capture."""
    largest = max(DECODE_CLASSES.values())
    check = getattr(ops, "graph_blocker", None)
    reason = None if max_batch <= largest or check is None else check([max_batch])
    if reason is not None:
        log.warning("decode batches over %d run eagerly: %s", largest, reason)
        return largest
    return max_batch


def capture_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes to capture: every 16 up to 256, every 32 beyond (padding stays
    under ~12%), and max_batch itself, so every batch the engine can run replays a graph."""
    top = max(max_batch, 1)
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(288, top + 1, 32), top]
    return sorted({s for s in sizes if s <= top})


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
        self.max_blocks = -(-max_model_len // block_size)
        i32 = dict(dtype=torch.int32, device=device)
        # Inputs live in a few packed buffers, staged through pinned host copies that
        # are reused every step: three host-to-device copies per replay, no allocation.
        # rows: input ids, positions, slots, and which earlier device token feeds a row
        self._dev_i64 = torch.zeros(4, n, dtype=torch.int64, device=device)
        rows = self._dev_i64.unbind(0)
        self.input_ids, self.positions, self.slot_mapping, self._source_rows = rows
        self.seq_lens = torch.ones(n, **i32)
        self.block_tables = torch.zeros(n, self.max_blocks, **i32)
        self.cu_seqlens_q = torch.arange(n + 1, **i32)
        self._host_i64 = torch.zeros(4, n, dtype=torch.int64).pin_memory()
        self._host_lens = torch.ones(n, dtype=torch.int32).pin_memory()
        self._host_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32).pin_memory()
        self._tables = BlockTableStager(self._host_tables.numpy())
        self._staged = torch.cuda.Event()  # the last copies out of the host buffers
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
    def run(
        self, input_ids, positions, slot_mapping, seq_lens, block_tables, device_input=None
    ) -> torch.Tensor:
        """Inputs are host lists for the real rows (block_tables: one list per row);
        returns their logits. device_input = (tokens, rows) replaces input_ids with
        tokens[rows], a device tensor indexed by a host list: tokens sampled by a
        step whose results have not reached the host yet."""
        n = len(positions)
        bs = next(s for s in self.sizes if s >= n)
        self._staged.synchronize()  # the previous step's copies have left the buffers
        host = self._host_i64.numpy()
        if device_input is None:
            host[0, :n] = input_ids
        else:
            host[3, :n] = device_input[1]
        host[1, :n] = positions
        host[2, :n] = slot_mapping
        host[2, n:bs] = -1  # padding rows write nowhere...
        lens = self._host_lens.numpy()
        lens[:n] = seq_lens
        lens[n:bs] = 1  # ...and attend to one key
        self._tables.stage(block_tables)
        self._dev_i64.copy_(self._host_i64, non_blocking=True)
        self.seq_lens[:bs].copy_(self._host_lens[:bs], non_blocking=True)
        self.block_tables[:bs].copy_(self._host_tables[:bs], non_blocking=True)
        self._staged.record()
        if device_input is not None:  # ordered after the staged copy, before the replay
            torch.index_select(device_input[0], 0, self._source_rows[:n], out=self.input_ids[:n])
        self.graphs[bs].replay()
        return self.logits[bs][:n]
