"""Turns the last-position logits of a batch into next tokens (+ logprobs).

Order, as in vLLM: a structured output's grammar masks the logits first (vLLM applies
its grammar bitmask before the sampler, so reported logprobs are those of the masked,
renormalized distribution); logprobs are taken from that (otherwise raw) distribution;
then allowed_token_ids, bad_words and logit_bias, penalties, min_tokens masking, temperature,
top-k, top-p and min-p shape the distribution that is sampled. A request with a seed
owns a torch.Generator, so its draws reproduce regardless of what else shares the
batch."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.engine.sampling_params import SamplingParams


@dataclass
class SamplingRequest:
    params: SamplingParams
    # the sequence's own prompt + output list, not a copy: a step builds one request per
    # sequence, and only penalties need the token lists themselves
    token_ids: list[int]
    num_prompt_tokens: int
    stop_token_ids: list[int]  # suppressed while fewer than min_tokens were generated
    generator: torch.Generator | None
    # logit_bias, single-token bad_words (-inf) and allowed_token_ids (-inf elsewhere) as
    # one float32 row on the device, built once per request: added without a host sync
    logits_bias: torch.Tensor | None = None
    # bad words of several tokens: their last token is banned after the others (reads
    # the host's output tokens, like penalties)
    bad_word_seqs: list[list[int]] | None = None
    # structured output: the tokens its grammar allows next, as xgrammar's packed int32
    # bitmask on the host (see structured.GrammarState); None: no constraint this step
    grammar_bitmask: torch.Tensor | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (chosen token's logprob, its rank, [(token id, logprob)] top-n), or None
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]
    # seq id -> [(prompt token, (logprob, rank, top-n))] for the prompt tokens whose
    # logprobs this step computed (prompt_logprobs), in prompt order
    prompt_logprobs: dict[str, list] = field(default_factory=dict)


class DeviceTokens:
    """Sampled tokens of a step, left on the device so the next step can read them as
    its input ids before they reach the host; tolist() waits for the host copy."""

    def __init__(self, tokens: torch.Tensor):
        self.tokens = tokens
        self._ready = None
        if self.tokens.is_cuda:
            self._host = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=True)
            self._host.copy_(self.tokens, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = self.tokens

    def wait(self) -> None:
        """Until the step that made these tokens has finished on the device."""
        if self._ready is not None:
            self._ready.synchronize()

    def tolist(self) -> list[int]:
        self.wait()
        return self._host.tolist()


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum. On a GPU in two stages (triton/argmax.py: torch's one
    reduction of a 128k-vocabulary row took ~40 us of a decode step), imported here
    because the kernel tests must import Triton's kernels first (interpreter on a CPU)."""
    if not logits.is_cuda:
        return logits.argmax(dim=-1)
    from services.kernels.triton.argmax import argmax_rows

    return argmax_rows(logits)


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> SamplerOutput:
        if all(_plain_greedy(r) for r in requests):
            # the common decode step: argmax of the raw (or biased) logits
            return SamplerOutput(self.sample(logits, requests).tolist(), [None] * len(requests))
        logits = logits.float()
        grammar_rows = [i for i, r in enumerate(requests) if r.grammar_bitmask is not None]
        if grammar_rows:
            logits = grammar_masked = _apply_grammar(logits, requests, grammar_rows)
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        logits = _apply_logits_bias(logits.clone(), requests)
        for i, r in enumerate(requests):
            if r.bad_word_seqs:
                _ban_bad_word_ends(logits[i], r)
            if r.params.has_penalties:
                _apply_penalties(logits[i], r)
            if r.num_output_tokens < r.params.min_tokens and r.stop_token_ids:
                logits[i, r.stop_token_ids] = float("-inf")
        if grammar_rows:
            narrowed = [i for i in grammar_rows if _narrows(requests[i])]
            if narrowed:
                _grammar_wins(logits, grammar_masked, narrowed)

        token_ids = self.sample(logits, requests, biased=True).tolist()
        logprobs = [None] * len(requests)
        if raw_logprobs is not None:
            for i, r in enumerate(requests):
                if r.params.logprobs is not None:
                    logprobs[i] = _logprobs_entry(raw_logprobs[i], token_ids[i], r.params.logprobs)
        return SamplerOutput(token_ids, logprobs)

    def sample(
        self, logits: torch.Tensor, requests: list[SamplingRequest], biased: bool = False
    ) -> torch.Tensor:
        """Next token per row as a device tensor, without a host sync: the argmax for
        greedy rows, a draw from the shaped distribution for the others. Each request's
        logits_bias row is added unless `biased` (the caller did); penalties, multi-token
        bad words and min_tokens masking are the caller's (__call__ applies them first)."""
        if not biased:
            logits = _apply_logits_bias(logits, requests)
        if logits.device.type == "cpu" and logits.dtype != torch.float32:
            # the same argmax (bf16 -> fp32 is exact), in half the time: a CPU's bf16
            # argmax is not vectorized (1.2 ms for 16 rows of SmolLM2's vocabulary)
            logits = logits.float()
        tokens = _argmax(logits)
        for i, r in enumerate(requests):
            p = r.params
            if p.greedy:
                continue
            row = logits[i].float() / p.temperature
            if p.top_k > 0 and p.top_k < row.shape[0]:
                kth = torch.topk(row, p.top_k).values[-1]
                row = row.masked_fill(row < kth, float("-inf"))
            probs = torch.softmax(row, dim=-1)
            if p.top_p < 1.0:
                probs = _top_p(probs, p.top_p)
            if p.min_p > 0.0:
                probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
            # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p, and a
            # per-request generator makes the draw reproducible.
            noise = torch.empty_like(probs).exponential_(generator=r.generator)
            tokens[i] = (probs / noise).argmax()
        return tokens


def _plain_greedy(r: SamplingRequest) -> bool:
    return r.params.greedy and samples_on_device(
        r.params, r.num_output_tokens, bool(r.stop_token_ids), bool(r.bad_word_seqs)
    )


def samples_on_device(
    p: SamplingParams, num_output_tokens: int, has_stop_ids: bool, has_bad_word_seqs=False
) -> bool:
    """Sampler.sample alone gives the next token: no logprobs to report, no penalties,
    multi-token bad words or min_tokens masking (they read the host's token lists)."""
    return (
        p.logprobs is None
        and p.structured_output is None  # its matcher masks each step on the host
        and not p.has_penalties
        and not has_bad_word_seqs
        and not (num_output_tokens < p.min_tokens and has_stop_ids)
    )


def _apply_grammar(
    logits: torch.Tensor, requests: list[SamplingRequest], rows: list[int]
) -> torch.Tensor:
    """-inf for every token the row's grammar forbids, into a new float32 tensor, for all
    the rows at once. Columns past the bitmask (a padded LM head) are forbidden too.

    On the CPU xgrammar's kernel masks the rows in place (2.6x faster than unpacking the
    bits with torch ops, and single-threaded: docs/performance.md); on a GPU the bitmask
    goes to the device in one copy and is unpacked there."""
    words = torch.stack([requests[i].grammar_bitmask for i in rows])
    out = logits.clone()
    width = min(words.shape[1] * 32, out.shape[1])
    if out.device.type == "cpu":
        import xgrammar as xgr

        batch = torch.full((len(requests), words.shape[1]), -1, dtype=torch.int32)
        batch[rows] = words  # the kernel reads row i of the bitmask for logits row i
        xgr.apply_token_bitmask_inplace(out, batch, vocab_size=width, indices=rows)
    else:
        _mask_with_torch(out, words.to(out.device, non_blocking=True), rows, width)
    if width < out.shape[1]:
        out[rows, width:] = float("-inf")
    return out


def _mask_with_torch(out: torch.Tensor, words: torch.Tensor, rows: list[int], width: int):
    """The same as xgrammar's kernel with torch ops on out's device: words[j] is the
    packed bitmask of row rows[j]."""
    shifts = torch.arange(32, dtype=torch.int32, device=out.device)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()[:, :width]
    out[rows, :width] = out[rows, :width].masked_fill(~allowed, float("-inf"))


def _narrows(r: SamplingRequest) -> bool:
    """The request has constraints besides its grammar that can forbid tokens."""
    return (
        r.logits_bias is not None
        or bool(r.bad_word_seqs)
        or (r.num_output_tokens < r.params.min_tokens and bool(r.stop_token_ids))
    )


def _grammar_wins(logits: torch.Tensor, grammar_masked: torch.Tensor, rows: list[int]) -> None:
    """A row whose other constraints (allowed_token_ids, bad words, min_tokens) forbid
    every token the grammar allows falls back to the grammar alone: the output must
    still match it. (A row max over the whole batch: 10x cheaper on the CPU than
    gathering the rows first.)"""
    dead = torch.isneginf(logits.amax(dim=1))[rows].tolist()
    for i, d in zip(rows, dead):
        if d:
            logits[i] = grammar_masked[i]


def _apply_logits_bias(logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
    """Adds each request's logits_bias row on the device, into a new float32 tensor (the
    captured graph's output buffer stays untouched)."""
    rows = [(i, r.logits_bias) for i, r in enumerate(requests) if r.logits_bias is not None]
    if not rows:
        return logits
    bias = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    for i, row in rows:
        bias[i, : row.numel()] = row  # a padded LM head's extra columns stay unbiased
    return logits.float() + bias


def logits_bias_row(
    params: SamplingParams, banned: list[int], vocab_size: int, device
) -> torch.Tensor | None:
    """The request's logit_bias, banned tokens and allowed_token_ids as one additive
    float32 row (built once per request; None when there is nothing to add)."""
    if not (params.logit_bias or banned) and params.allowed_token_ids is None:
        return None
    row = torch.zeros(vocab_size, dtype=torch.float32)
    if params.allowed_token_ids is not None:
        row.fill_(float("-inf"))
        row[params.allowed_token_ids] = 0.0
    for t, b in params.logit_bias.items():
        row[t] += b
    if banned:
        row[banned] = float("-inf")
    return row.to(device)


def _ban_bad_word_ends(row: torch.Tensor, r: SamplingRequest) -> None:
    out = r.output_token_ids
    for word in r.bad_word_seqs:
        prefix = word[:-1]
        if len(out) >= len(prefix) and out[len(out) - len(prefix) :] == prefix:
            row[word[-1]] = float("-inf")


def _top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_probs, order = probs.sort(descending=True)
    cumulative = sorted_probs.cumsum(0)
    # keep the smallest prefix whose mass reaches top_p (always at least one token)
    drop = cumulative - sorted_probs >= top_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)  # not boolean indexing: no sync
    return torch.zeros_like(probs).scatter_(0, order, sorted_probs)


def _apply_penalties(row: torch.Tensor, r: SamplingRequest) -> None:
    p = r.params
    if p.repetition_penalty != 1.0:
        # HF / vLLM semantics: every token seen in prompt or output is penalised once
        seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)))
        if seen.numel():
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
    if (p.presence_penalty or p.frequency_penalty) and r.num_output_tokens:
        ids, counts = torch.tensor(r.output_token_ids).unique(return_counts=True)
        row[ids] -= p.frequency_penalty * counts.float() + p.presence_penalty


def prompt_logprobs(logprobs: torch.Tensor, token_ids: list[int], top_n: int) -> list:
    """Rows of log-softmax and the token each row predicts -> one (logprob, rank,
    top-n) per row, with one host copy for the whole chunk."""
    ids = torch.tensor(token_ids, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])
    ranks = (logprobs > chosen).sum(dim=1) + 1
    top_vals, top_ids = torch.topk(logprobs, top_n) if top_n > 0 else (None, None)
    chosen, ranks = chosen[:, 0].tolist(), ranks.tolist()
    tops = (
        [list(zip(i, v)) for i, v in zip(top_ids.tolist(), top_vals.tolist())]
        if top_n > 0
        else [[] for _ in token_ids]
    )
    return list(zip(chosen, ranks, tops))


def _logprobs_entry(row: torch.Tensor, token_id: int, top_n: int):
    chosen = float(row[token_id])
    rank = int((row > row[token_id]).sum()) + 1
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = torch.topk(row, top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return chosen, rank, top
