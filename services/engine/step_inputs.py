"""A step's host-side inputs: from scheduled sequences to the lists every rank needs
(StepInput) and the attention metadata built from them. Pure bookkeeping: the runner
turns these into tensors and runs the model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.scheduler import ScheduledSeq
from services.kernels import AttentionMetadata


@dataclass
class StepInput:
    """One forward pass as host lists: all any rank needs to run it (rank 0 sends it to
    the others). logits_rows: the rows sampled; prompt_rows: (start, end) row ranges
    whose logits give prompt logprobs, computed first, in order."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    cu_seqlens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    logits_rows: list[int]
    prompt_rows: list[tuple[int, int]]


def prompt_targets(batch):
    """Per sequence: (seq, first, last) prompt tokens whose logprobs this chunk
    gives (position p predicts token p + 1), skipping those already collected (a
    recompute after preemption); first > last: none. Every chunk contributes."""
    for item in batch:
        seq = item.seq
        if not seq.needs_prompt_logprobs:
            yield seq, 1, 0
            continue
        start = seq.num_computed_tokens
        first = max(start + 1, len(seq.prompt_logprobs) + 1)  # first target token
        last = min(start + item.num_new_tokens, seq.num_prompt_tokens - 1)
        yield seq, first, last


def decode_rows(seqs, bs: int):
    """Positions, slots, lengths and block tables of one new token per sequence,
    at position num_computed_tokens (its block is already allocated)."""
    # comprehensions, not one loop of appends: hundreds of sequences per step
    pos = [seq.num_computed_tokens for seq in seqs]
    tables = [seq.block_table for seq in seqs]
    slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, pos)]
    lens = [p + 1 for p in pos]
    return pos, slots, lens, tables


def prepare_step(batch: list[ScheduledSeq], bs: int) -> StepInput:
    """The host lists of a scheduled batch: each item's next num_new_tokens tokens."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    cu_seqlens = [0]
    seq_lens: list[int] = []
    logits_rows: list[int] = []
    for item in batch:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens
        input_ids.extend(seq.token_ids[start:end])
        positions.extend(range(start, end))
        table = seq.block_table
        slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        cu_seqlens.append(cu_seqlens[-1] + item.num_new_tokens)
        seq_lens.append(end)
        if item.completes_prefill:
            logits_rows.append(cu_seqlens[-1] - 1)
    prompt_rows = [
        (row0 + first - 1 - seq.num_computed_tokens, row0 + last - seq.num_computed_tokens)
        for row0, (seq, first, last) in zip(cu_seqlens, prompt_targets(batch))
        if first <= last
    ]
    tables = [item.seq.block_table for item in batch]
    return StepInput(
        input_ids, positions, slots, cu_seqlens, seq_lens, tables, logits_rows, prompt_rows
    )


def pipelined_step(seqs, admitted: list[ScheduledSeq], bs: int) -> StepInput:
    """Decode rows of sequences whose input token is still on the device (placeholder
    ids 0, filled from the step before), then whole prompts that complete here."""
    pos, slots, lens, tables = decode_rows(seqs, bs)
    n = len(seqs)
    chunk = prepare_step(admitted, bs)
    return StepInput(
        [0] * n + chunk.input_ids,
        pos + chunk.positions,
        slots + chunk.slots,
        list(range(n + 1)) + [n + c for c in chunk.cu_seqlens[1:]],
        lens + chunk.seq_lens,
        tables + chunk.block_tables,
        list(range(n)) + [n + r for r in chunk.logits_rows],
        [],
    )


def attention_metadata(step: StepInput, block_size: int, dev) -> AttentionMetadata:
    """The step's attention metadata as device tensors, with the host lists kept."""
    slots, cu_seqlens, seq_lens = step.slots, step.cu_seqlens, step.seq_lens
    block_tables = step.block_tables
    width = max(len(t) for t in block_tables)
    tables = [t + [0] * (width - len(t)) for t in block_tables]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
        cu_seqlens_q=torch.tensor(cu_seqlens, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
        max_query_len=max(b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        cu_seqlens_q_cpu=cu_seqlens,
        seq_lens_cpu=seq_lens,
    )
