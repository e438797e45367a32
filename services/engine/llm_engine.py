"""The engine loop: tokenizer + scheduler + model runner + output processing.

One class serves all three roles:
- both: a normal colocated engine;
- prefill: a sequence stops after its first sampled token and keeps its blocks
  (status PREFILLED) until the caller has handed the KV over and calls release();
- decode: reserve_remote_kv() allocates the blocks a remote prefill will fill, and
  admit_remote() starts decoding once that KV and the first token have arrived
  (both roles' entry points live in pd_roles.py).
Not thread-safe: the caller drives it from one thread."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from services.engine.async_steps import AsyncSteps, StepInFlight
from services.engine.block_manager import BlockManager
from services.engine.config import EngineConfig
from services.engine.detokenizer import IncrementalDetokenizer
from services.engine.kv_audit import KVAudit, audit_kv
from services.engine.model_runner import ModelRunner
from services.engine.output_deltas import Delta, engine_makes_text, make_delta
from services.engine.outputs import CompletionOutput, RequestOutput
from services.engine.pd_roles import DisaggregatedRoles
from services.engine.request_checks import RequestChecks
from services.engine.sampler import (
    SamplerOutput,
    SamplingRequest,
    logits_bias_row,
    samples_on_device,
)
from services.engine.sampling_params import SamplingParams
from services.engine.scheduler import ScheduledSeq, Scheduler
from services.engine.sequence import Logprob, Sequence, SequenceStatus
from services.engine.startup import StartupPhases
from services.engine.structured import Grammars, GrammarState
from services.models.loader import check_supported, load_hf_config, resolve_model_path
from services.models.rope import max_positions
from services.models.tokenizer import eos_token_ids, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class _Request:
    seq: Sequence
    detok: IncrementalDetokenizer | None  # None: its text is made where the deltas go
    generator: torch.Generator | None
    stop_token_ids: list[int]
    logits_bias: torch.Tensor | None = None  # see SamplingRequest
    bad_word_seqs: list[list[int]] | None = None
    grammar: GrammarState | None = None  # structured output's matcher
    # what the sampler reads of it, built on its first step and reused: all of it is
    # fixed for the request (the token list is the sequence's own), but a grammar's mask
    sampling: SamplingRequest | None = None
    # from how many output tokens on Sampler.sample alone gives the next token
    # (samples_on_device; None: never), decided once: async scheduling asks for every
    # running sequence every step
    device_sampling_from: int | None = field(init=False)
    # with delta outputs: output tokens and text characters sent so far (-1: nothing yet)
    sent_tokens: int = field(default=-1, init=False)
    sent_chars: int = field(default=0, init=False)

    def __post_init__(self):
        params, has_stop_ids = self.seq.params, bool(self.stop_token_ids)
        if samples_on_device(params, params.min_tokens, has_stop_ids, bool(self.bad_word_seqs)):
            # min_tokens masks the stop ids on the host until it is reached
            self.device_sampling_from = params.min_tokens if has_stop_ids else 0
        else:
            self.device_sampling_from = None


class LLMEngine(AsyncSteps, DisaggregatedRoles):
    def __init__(self, config: EngineConfig, phases: StartupPhases | None = None):
        """phases: where the start-up phases (kernel tuning, weights, KV cache, graph
        capture) record and log their durations."""
        phases = phases or StartupPhases()
        self.config = config
        self.model_path = resolve_model_path(config.model, config.revision, config.download_dir)
        self.hf_config = load_hf_config(self.model_path)
        self.tokenizer = load_tokenizer(self.model_path)
        self.eos_token_ids = eos_token_ids(self.model_path, self.tokenizer, self.hf_config)

        model_max = max_positions(self.hf_config)  # RoPE scaling extends it
        max_model_len = config.max_model_len or model_max
        check_supported(
            self.hf_config, max_model_len, config.quantization, config.tensor_parallel_size
        )
        self.runner = ModelRunner(
            config, self.hf_config, self.model_path, max(max_model_len, model_max), phases
        )
        try:
            self._set_up_kv(phases, max_model_len)
        except BaseException:
            self.runner.close()  # no tensor-parallel rank outlives a failed start
            raise
        self.requests: dict[str, _Request] = {}
        # requests whose Rust DecodeStream erred and that went on in Python (detokenizer.py)
        self.num_detokenizer_fallbacks = 0
        # in an engine process: step() and admit_remote() return deltas made straight
        # from the sequences, and only requests with stop strings are detokenized here
        # (the worker makes the others' text; output_deltas.py)
        self.delta_outputs = False
        self.grammars = Grammars(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        self.checks = RequestChecks(
            self.tokenizer,
            self.hf_config.vocab_size,
            self.grammars,
            config.scheduling_policy,
            self.max_model_len,
        )
        self._generator = torch.Generator(self.runner.device).manual_seed(config.seed)
        # async scheduling: prefill workers never decode, so they never pipeline
        self._async = config.async_scheduling_enabled and config.role != "prefill"
        self._in_flight: StepInFlight | None = None
        # steps that admitted new prompts next to decode rows without waiting for the
        # step before (their count shows the pipeline holds under steady arrivals)
        self.num_pipelined_mixed_steps = 0

    def _set_up_kv(self, phases: StartupPhases, max_model_len: int) -> None:
        config = self.config
        num_blocks = config.num_kv_blocks or self._blocks_that_fit()
        capacity = num_blocks * config.block_size
        if config.max_model_len is None:
            max_model_len = min(max_model_len, capacity)
        elif config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the KV cache capacity "
                f"({num_blocks} blocks x {config.block_size} = {capacity} tokens)"
            )
        self.max_model_len = max_model_len
        with phases.phase("kv_cache"):
            self.runner.allocate_kv_cache(num_blocks)
        with phases.phase("cuda_graphs"):
            self.runner.capture_cuda_graphs(self.max_model_len)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.scheduling_policy,
        )

    def close(self) -> None:
        """Stop the engine's other tensor-parallel ranks (nothing to do without TP)."""
        self.runner.close()

    # -- requests -----------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.checks.tokenize(prompt)

    def truncate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        return self.checks.truncate(prompt_token_ids, params)

    def validate(
        self, prompt_token_ids: list[int], params: SamplingParams, *, fit_max_tokens: bool = False
    ) -> None:
        """request_checks.py: ValueError for a request this engine cannot run."""
        self.checks.validate(prompt_token_ids, params, fit_max_tokens=fit_max_tokens)

    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Sequence:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = self.truncate(self.tokenize(prompt), params)
        self.validate(ids, params)
        seq = Sequence(request_id, ids, params)
        self._register(seq)
        self.scheduler.add(seq)
        return seq

    def _register(self, seq: Sequence) -> None:
        params = seq.params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(self.runner.device).manual_seed(params.seed)
        elif not params.greedy:
            generator = self._generator
        stop_ids = list(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids += self.eos_token_ids
        words = self._bad_word_token_ids(params.bad_words)
        banned = [w[0] for w in words if len(w) == 1]
        detok = None  # no text here
        if not self.delta_outputs or engine_makes_text(params):
            detok = IncrementalDetokenizer(self.tokenizer, params, self._count_detokenizer_fallback)
        self.requests[seq.seq_id] = _Request(
            seq,
            detok,
            generator,
            stop_ids,
            logits_bias_row(params, banned, self.hf_config.vocab_size, self.runner.device),
            [w for w in words if len(w) > 1] or None,
            self.grammars.state(params.structured_output) if params.structured_output else None,
        )

    def _bad_word_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens, as vLLM finds them: the word alone and after a space
        (mid-sentence spelling), both banned."""
        seqs: list[list[int]] = []
        for word in words:
            for prefix in ("", " "):
                ids = self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        seq = req.seq
        self._free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def get_sequence(self, request_id: str) -> Sequence | None:
        req = self.requests.get(request_id)
        return req.seq if req else None

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput] | list[Delta]:
        """Run one step; returns the outputs it produced (deltas with delta_outputs).
        With async scheduling a decode step sampled on the device returns the previous
        step's tokens, after launching the next one (whose tokens the following call
        returns)."""
        done, self._in_flight = self._in_flight, None
        if done is None:
            sched = self.scheduler.schedule()
            if not sched.scheduled:
                return []
            if not self._pipelines(sched.scheduled):
                return self._step_sync(sched)
            done = self._launch([item.seq for item in sched.scheduled])
        self._in_flight = self._launch_next(done)
        return self._read_tokens(done)

    def _step_sync(self, sched) -> list:
        to_sample = [s for s in sched.scheduled if s.completes_prefill]
        sampling = [self._sampling_request(s.seq) for s in to_sample]
        result = self.runner.execute(sched.scheduled, sampling)
        if result is not None:
            for item in sched.scheduled:
                for token, lp in result.prompt_logprobs.get(item.seq.seq_id, ()):
                    item.seq.prompt_logprobs.append(self._logprob_entry(token, lp))
        for item in sched.scheduled:
            self.scheduler.postprocess(item.seq, item.num_new_tokens, item.seq.num_tokens)
        return self._process_samples(to_sample, result) if result and result.token_ids else []

    def _free_blocks(self, seq: Sequence) -> None:
        # A step in flight may still write seq's KV: let it finish before the blocks
        # can go to another request (a remote prefill writes them outside the stream).
        step = self._in_flight
        if step is not None and id(seq) in step.rows:
            step.tokens.wait()
        self.scheduler.finish(seq)

    def _sampling_request(self, seq: Sequence) -> SamplingRequest:
        req = self.requests[seq.seq_id]
        if req.sampling is not None and req.grammar is None:
            return req.sampling  # one per request, not one per request per step
        req.sampling = SamplingRequest(
            seq.params,
            seq.token_ids,
            seq.num_prompt_tokens,
            req.stop_token_ids,
            req.generator,
            req.logits_bias,
            req.bad_word_seqs,
            req.grammar.next_bitmask() if req.grammar is not None else None,
        )
        return req.sampling

    def _process_samples(self, items: list[ScheduledSeq], result: SamplerOutput) -> list:
        outputs = []
        for item, token, lp in zip(items, result.token_ids, result.logprobs):
            seq = item.seq
            req = self.requests[seq.seq_id]
            if self.config.role == "prefill" and seq.num_output_tokens == 0:
                self._append_token(seq, token, lp)
                self.scheduler.remove(seq)
                seq.status = SequenceStatus.PREFILLED  # blocks kept until release()
                seq.reserved_at = time.monotonic()
                outputs.append(self._output(req, finished=True))
                continue
            outputs.append(self._append_and_check(req, token, lp))
        return outputs

    def _append_token(self, seq: Sequence, token: int, lp) -> None:
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(self._logprob_entry(token, lp))

    def _logprob_entry(self, token: int, lp) -> dict[int, Logprob]:
        """(logprob, rank, [(token id, logprob)] top-n) -> {token id: Logprob}."""
        chosen, rank, top = lp
        entry = {
            tid: Logprob(val, r + 1, self.decode_token(tid)) for r, (tid, val) in enumerate(top)
        }
        entry[token] = Logprob(chosen, rank, self.decode_token(token))
        return entry

    def _append_and_check(self, req: _Request, token: int, lp) -> RequestOutput | Delta:
        seq = req.seq
        token_ids = seq.token_ids
        if lp is None:  # the usual case, once per sequence per step: no call
            token_ids.append(token)
        else:
            self._append_token(seq, token, lp)
        params = seq.params
        n_out = len(token_ids) - len(seq.prompt_token_ids)
        min_reached = n_out >= params.min_tokens
        detok = req.detok
        stop_str = None
        if detok is not None:
            stop_str = detok.add_tokens([token], check_stop=min_reached)
        grammar_done = req.grammar is not None and req.grammar.accept(token)
        if stop_str is not None:
            self._finish(seq, "stop", stop_str)
        elif min_reached and token in req.stop_token_ids:
            # as vLLM: stop_reason is the id for stop_token_ids, None for plain EOS
            self._finish(seq, "stop", token if token in params.stop_token_ids else None)
        elif grammar_done:  # it accepted its stop token (EOS) even under ignore_eos
            self._finish(seq, "stop", None)
        elif params.max_tokens is not None and n_out >= params.max_tokens:
            self._finish(seq, "length", None)
        elif len(token_ids) >= self.max_model_len:
            self._finish(seq, "length", None)
        finished = seq.status is SequenceStatus.FINISHED
        if finished:
            if stop_str is None and detok is not None:  # text cut at a stop string stays cut
                detok.flush()
            self.requests.pop(seq.seq_id, None)
        return self._output(req, finished)

    def _finish(self, seq: Sequence, reason: str, stop_reason) -> None:
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self._free_blocks(seq)
        seq.status = SequenceStatus.FINISHED

    def _output(self, req: _Request, finished: bool) -> RequestOutput | Delta:
        if self.delta_outputs:
            return self._make_delta(req, finished)
        return self._make_output(req, finished)

    def _make_output(self, req: _Request, finished: bool) -> RequestOutput:
        seq = req.seq
        completion = CompletionOutput(
            index=0,
            text=req.detok.stable_text(finished),
            source=seq.token_ids,  # sliced only when read (outputs.py)
            start=seq.num_prompt_tokens,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            seq.seq_id,
            seq.prompt_token_ids,
            [completion],
            finished,
            seq.num_cached_tokens,
            _prompt_logprobs(seq),
        )

    def _make_delta(self, req: _Request, finished: bool) -> Delta:
        """What is new in req's output since its previous delta, straight from the
        sequence: a RequestOutput per request per step costs more than the step's
        own bookkeeping at hundreds of sequences."""
        seq = req.seq
        first = req.sent_tokens < 0
        sent = 0 if first else req.sent_tokens
        new_ids = seq.token_ids[len(seq.prompt_token_ids) + sent :]
        req.sent_tokens = sent + len(new_ids)
        text = ""
        if req.detok is not None:
            stable = req.detok.stable_text(finished)
            text, req.sent_chars = stable[req.sent_chars :], len(stable)
        return make_delta(
            seq.seq_id,
            new_ids,
            text,
            seq.logprobs[sent:] if seq.params.logprobs is not None else None,
            finished,
            seq.finish_reason,
            seq.stop_reason,
            seq.num_cached_tokens,
            (seq.prompt_token_ids, _prompt_logprobs(seq)) if first else None,
        )

    def decode_token(self, token_id: int) -> str | None:
        return self.checks.decode_token(token_id)

    # -- sizing -------------------------------------------------------------------------

    def _blocks_that_fit(self) -> int:
        num_blocks = self.runner.kv_memory_budget() // self.runner.kv_spec.block_bytes
        if num_blocks < 1:
            raise ValueError("not enough memory for even one KV block")
        return num_blocks

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "detokenizer_fallbacks": self.num_detokenizer_fallbacks}

    def _count_detokenizer_fallback(self) -> None:
        self.num_detokenizer_fallbacks += 1

    def kv_audit(self) -> KVAudit:
        """Orphaned KV blocks and the oldest reservation (call on the engine's thread)."""
        return audit_kv(self)


def _prompt_logprobs(seq: Sequence) -> list | None:
    if seq.params.prompt_logprobs is None:
        return None
    return [None, *seq.prompt_logprobs]  # vLLM's shape: the first has none
