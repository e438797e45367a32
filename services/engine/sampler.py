"""Turns the last-position logits of a batch into next tokens (+ logprobs).

Order, as in vLLM: logprobs are taken from the raw model distribution; then
penalties, min_tokens masking, temperature, top-k, top-p and min-p shape the
distribution that is sampled. A request with a seed owns a torch.Generator, so its
draws reproduce regardless of what else shares the batch."""

from __future__ import annotations

from dataclasses import dataclass

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


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> SamplerOutput:
        if all(_plain_greedy(r) for r in requests):
            # the common decode step: argmax of the raw logits (exact in any dtype)
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * len(requests))
        logits = logits.float()
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)

        logits = logits.clone()
        for i, r in enumerate(requests):
            if r.params.has_penalties:
                _apply_penalties(logits[i], r)
            if r.num_output_tokens < r.params.min_tokens and r.stop_token_ids:
                logits[i, r.stop_token_ids] = float("-inf")

        token_ids = self.sample(logits, requests).tolist()
        logprobs = [None] * len(requests)
        if raw_logprobs is not None:
            for i, r in enumerate(requests):
                if r.params.logprobs is not None:
                    logprobs[i] = _logprobs_entry(raw_logprobs[i], token_ids[i], r.params.logprobs)
        return SamplerOutput(token_ids, logprobs)

    def sample(self, logits: torch.Tensor, requests: list[SamplingRequest]) -> torch.Tensor:
        """Next token per row as a device tensor, without a host sync: the argmax for
        greedy rows, a draw from the shaped distribution for the others. Penalties and
        min_tokens masking are the caller's (__call__ applies them first)."""
        tokens = logits.argmax(dim=-1)
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
        r.params, r.num_output_tokens, bool(r.stop_token_ids)
    )


def samples_on_device(p: SamplingParams, num_output_tokens: int, has_stop_ids: bool) -> bool:
    """Sampler.sample alone gives the next token: no logprobs to report, no penalties
    or min_tokens masking (they read the host's token lists)."""
    return (
        p.logprobs is None
        and not p.has_penalties
        and not (num_output_tokens < p.min_tokens and has_stop_ids)
    )


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


def _logprobs_entry(row: torch.Tensor, token_id: int, top_n: int):
    chosen = float(row[token_id])
    rank = int((row > row[token_id]).sum()) + 1
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, ids = torch.topk(row, top_n)
        top = list(zip(ids.tolist(), values.tolist()))
    return chosen, rank, top
