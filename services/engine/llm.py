"""Offline API in vLLM's shape: LLM(model).generate(prompts, sampling_params)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq

from services.engine.config import EngineConfig
from services.engine.llm_engine import LLMEngine
from services.engine.outputs import RequestOutput
from services.engine.sampling_params import SamplingParams
from services.models.tokenizer import apply_chat_template


class LLM:
    def __init__(self, model: str, **engine_args):
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the tensor-parallel ranks, if any (also on leaving a `with` block)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[int] | Seq[str | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or SamplingParams()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("need one SamplingParams per prompt (or a single one)")
        order = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, params)
                order.append(rid)
        except ValueError:
            for rid in order:
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
        return [done[rid] for rid in order]

    def chat(self, messages, sampling_params: SamplingParams | None = None, **template_kwargs):
        """messages: one conversation (list of {role, content}) or a list of them."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.apply_chat_template(conv, **template_kwargs) for conv in conversations]
        return self.generate(prompts, sampling_params)

    def apply_chat_template(self, conversation, **kwargs) -> list[int]:
        return apply_chat_template(self.tokenizer, conversation, **kwargs)
