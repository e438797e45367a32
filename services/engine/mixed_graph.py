"""CUDA graphs for mixed steps: prefill chunks and decode rows in one forward pass.

Under steady load a colocated engine admits a new prompt on nearly every step, so most
steps hold a prefill chunk next to the decode rows. Run eagerly, such a step launches
~15 kernels per layer from Python, which costs more host time than the GPU takes for a
few hundred tokens of an 8B model (measured on the H200: 256 streams ran at 41% of the
engine's decode rate). Every kernel here reads lengths from device tensors and the
attention kernel's grid depends only on the token and sequence counts, so a mixed step
is captured once per token bucket and replayed.

A bucket of T tokens holds up to S = min(T, max_num_seqs) real sequences plus one
padding sequence. A step of n <= T tokens fills rows 0..n-1; rows n..T-1 belong to the
padding sequence (its KV goes to slot -1, which the KV write skips; it attends to its
own few keys in block 0, which are finite garbage and never read by anyone), and the
sequence slots past it have no query rows, so their attention programs exit at once.
Attention runs at a configuration chosen for query length T and the model's maximum
context: an upper bound, which the kernel handles for any shorter query (one q block
walks its keys whole). Only the rows that are sampled reach the LM head, gathered by a
device index, and their logits land in one buffer that every bucket shares."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from services.engine.block_table_staging import BlockTableStager
from services.kernels import AttentionMetadata

if TYPE_CHECKING:
    from services.engine.step_inputs import StepInput

log = logging.getLogger(__name__)


def mixed_capture_sizes(max_tokens: int) -> list[int]:
    """Token buckets up to max_tokens: fine steps where padding would be a large share,
    then every 64 tokens up to 512 and every 128 beyond (padding stays under ~15%)."""
    top = max(max_tokens, 0)
    sizes = [16, 32, 64, 96, 128, *range(192, 513, 64), *range(640, top + 1, 128)]
    return [s for s in sizes if s <= max_tokens]


class MixedGraphs:
    """Captured forward passes of mixed steps, one per token bucket. capture=False runs
    the same static-buffer forward eagerly (a CPU has no graphs; tests check the
    padding there)."""

    def __init__(
        self,
        model,
        ops,
        *,
        max_tokens: int,
        max_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        capture: bool = True,
    ):
        self.model = model
        self.ops = ops
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.sizes = mixed_capture_sizes(max_tokens)
        if not self.sizes:
            raise ValueError(f"no mixed-step bucket fits {max_tokens} tokens (the least is 16)")
        self.capture_graphs = capture
        self.device = device
        t_max = self.sizes[-1]
        self.max_seqs = max_seqs
        s_max = self._seq_slots(t_max)
        self.max_blocks = -(-max_model_len // block_size)
        i32 = dict(dtype=torch.int32, device=device)
        i64 = dict(dtype=torch.int64, device=device)
        # device inputs, filled from host staging buffers before each replay
        # input ids, positions, slots, and which earlier device token feeds a row (-1: none)
        self.tokens = torch.zeros(4, t_max, **i64)
        self.logits_index = torch.zeros(self._logit_rows(t_max), **i64)
        self.cu_seqlens_q = torch.zeros(s_max + 1, **i32)
        self.seq_lens = torch.zeros(s_max, **i32)
        self.block_tables = torch.zeros(s_max, self.max_blocks, **i32)
        pin = device.type == "cuda"
        self._host_tokens = _host_like(self.tokens, pin)
        self._host_index = _host_like(self.logits_index, pin)
        self._host_cu = _host_like(self.cu_seqlens_q, pin)
        self._host_lens = _host_like(self.seq_lens, pin)
        self._host_tables = _host_like(self.block_tables, pin)
        self._tables = BlockTableStager(self._host_tables.numpy())
        self._staged = torch.cuda.Event() if pin else None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [max logit rows, vocab], shared
        self.steps_run = 0  # mixed steps served from here (tests and logs read it)

    def _seq_slots(self, tokens: int) -> int:
        return min(tokens, self.max_seqs) + 1  # + the padding sequence

    def _logit_rows(self, tokens: int) -> int:
        return min(tokens, self.max_seqs)

    def bucket(self, num_tokens: int, num_seqs: int) -> int | None:
        """The smallest bucket that holds this step, or None (it runs eagerly)."""
        for size in self.sizes:
            if size >= num_tokens:
                # the padding sequence needs a slot only when rows are padded
                return size if num_seqs + (size > num_tokens) <= self._seq_slots(size) else None
        return None

    def _metadata(self, size: int) -> AttentionMetadata:
        seqs = self._seq_slots(size)
        return AttentionMetadata(
            slot_mapping=self.tokens[2, :size],
            cu_seqlens_q=self.cu_seqlens_q[: seqs + 1],
            seq_lens=self.seq_lens[:seqs],
            block_tables=self.block_tables[:seqs],
            max_query_len=size,  # an upper bound: the configuration of a long chunk
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )

    def _forward(self, size: int) -> None:
        meta = self._metadata(size)
        self.ops.prepare_attention(meta)
        hidden = self.model(self.tokens[0, :size], self.tokens[1, :size], meta)
        rows = self._logit_rows(size)
        logits = self.model.compute_logits(hidden[self.logits_index[:rows]])
        if self.logits is None:  # the first warm-up (largest bucket), outside any graph
            shape = (self._logit_rows(self.sizes[-1]), logits.shape[-1])
            self.logits = torch.empty(shape, dtype=logits.dtype, device=logits.device)
        self.logits[:rows].copy_(logits)

    @torch.inference_mode()
    def capture(self, pool=None):
        """Capture every bucket, largest first, into `pool` (shared with the decode
        graphs; None: a new one); returns the pool."""
        for size in reversed(self.sizes):
            self._fill_idle(size)
            self._forward(size)  # warm-up: compiles kernels, settles the allocator
            if not self.capture_graphs:
                continue
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            if pool is None:
                pool = graph.pool()
            self.graphs[size] = graph
        if self.capture_graphs:
            torch.cuda.synchronize()
            log.info("captured mixed-step CUDA graphs for token buckets %s", self.sizes)
        return pool

    def _fill_idle(self, size: int) -> None:
        """Inputs for a capture: every row padding (one sequence of `size` tokens that
        writes nowhere), so the warm-up touches no real KV."""
        self.tokens[:, :size].zero_()
        self.tokens[2, :size].fill_(-1)
        seqs = self._seq_slots(size)
        self.cu_seqlens_q[: seqs + 1].fill_(size)
        self.cu_seqlens_q[0] = 0
        self.seq_lens[:seqs].zero_()
        self.seq_lens[0] = size
        self.block_tables[:seqs].zero_()
        self.logits_index.zero_()

    @torch.inference_mode()
    def run(self, step: StepInput, size: int, device_input=None) -> torch.Tensor:
        """Replay the bucket `size` for this step (bucket() chose it); returns the
        logits of step.logits_rows, in order (a view of the shared buffer, valid until
        the next mixed step). device_input = (tokens, (rows, sources)): input row
        rows[i] is tokens[sources[i]], sampled by a step whose tokens are not on the
        host yet."""
        n, seqs = len(step.input_ids), len(step.seq_lens)
        slots = self._seq_slots(size)
        if self._staged is not None:
            self._staged.synchronize()  # the previous step's copies left the buffers
        tok = self._host_tokens.numpy()
        tok[0, :n] = step.input_ids
        tok[1, :n] = step.positions
        tok[2, :n] = step.slots
        tok[3] = -1  # every row, as the whole buffer is copied and gathered
        if device_input is not None:
            fed_rows, sources = device_input[1]
            tok[3, fed_rows] = sources
        pad = size - n
        if pad:
            tok[0, n:size] = 0
            tok[1, n:size] = range(pad)  # the padding sequence's own positions
            tok[2, n:size] = -1  # its KV is written nowhere
        cu = self._host_cu.numpy()
        cu[: seqs + 1] = step.cu_seqlens
        cu[seqs + 1 : slots + 1] = size  # the padding sequence ends at `size`, the rest are empty
        lens = self._host_lens.numpy()
        lens[:seqs] = step.seq_lens
        lens[seqs:slots] = 0
        self._tables.stage(step.block_tables)
        if pad:
            lens[seqs] = pad
            self._tables.host[seqs, : -(-pad // self.block_size)] = 0  # its keys: block 0
            self._tables.overwritten(seqs)
        index = self._host_index.numpy()
        rows = len(step.logits_rows)
        index[:rows] = step.logits_rows
        index[rows : self._logit_rows(size)] = 0
        async_copy = self._staged is not None  # pinned buffers: copies queue on the stream
        self.tokens.copy_(self._host_tokens, non_blocking=async_copy)
        self.cu_seqlens_q[: slots + 1].copy_(self._host_cu[: slots + 1], non_blocking=async_copy)
        self.seq_lens[:slots].copy_(self._host_lens[:slots], non_blocking=async_copy)
        self.block_tables[:slots].copy_(self._host_tables[:slots], non_blocking=async_copy)
        self.logits_index.copy_(self._host_index, non_blocking=async_copy)
        if self._staged is not None:
            self._staged.record()
        if device_input is not None:  # after the staged copy, before the replay
            source = self.tokens[3]
            picked = device_input[0].index_select(0, source.clamp(min=0))
            self.tokens[0].copy_(torch.where(source >= 0, picked, self.tokens[0]))
        if self.capture_graphs:
            self.graphs[size].replay()
        else:
            self._forward(size)
        self.steps_run += 1
        return self.logits[:rows]


def _host_like(t: torch.Tensor, pin: bool) -> torch.Tensor:
    host = torch.zeros(t.shape, dtype=t.dtype)
    return host.pin_memory() if pin else host
