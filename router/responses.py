"""OpenAI response bodies and stream chunks built from the workers' GenerateResponses."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from pdpb.v1 import common_pb2
from router.protocol import GenerationRequest
from router.reasoning import ReasoningParser, ReasoningStream
from router.tools import ForcedToolParser, ToolCallStream, ToolParser

FINISH_REASONS = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


def _lp(value: float) -> float:
    # JSON has no -inf; OpenAI-compatible servers send a large negative number instead
    return value if math.isfinite(value) else -9999.0


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)  # pdpb TokenLogprob
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    usage: common_pb2.Usage | None = None
    prompt_text: str | None = None
    started: bool = False
    text_offset: int = 0  # completions logprobs: characters so far
    # first response: pdpb TokenLogprob per prompt token (the first has rank 0: no
    # logprob) when prompt logprobs were asked for, and the prompt's length
    prompt_logprobs: list = field(default_factory=list)
    prompt_tokens: int = 0
    reasoning: ReasoningStream | None = None  # chat with a reasoning parser
    tools: ToolCallStream | None = None  # chat with tool_choice "auto"


class ResponseBuilder:
    def __init__(
        self,
        req: GenerationRequest,
        request_id: str,
        model: str,
        reasoning_parser: ReasoningParser | None = None,
        tool_parser: ToolParser | None = None,
    ):
        self.req = req
        self.model = model
        self.created = int(time.time())
        self.chat = req.kind == "chat"
        self.id = f"{'chatcmpl' if self.chat else 'cmpl'}-{request_id}"
        self.states = [ChoiceState(i) for i in range(req.num_choices)]
        # vLLM parses reasoning in chat completions only
        self.parser = reasoning_parser if self.chat else None
        if self.parser is not None:
            self.thinking = self.parser.thinking(req.prompts[0].chat_template_kwargs)
            for s in self.states:
                s.reasoning = ReasoningStream(self.thinking)
        # tool calls are looked for in the content (after reasoning), only when the
        # request lets the model choose (vLLM does the same)
        self.tool_parser = tool_parser if self.chat and req.tool_choice == "auto" else None
        if self.chat and req.tool_choice in ("required", "named"):  # constrained to calls
            self.tool_parser = ForcedToolParser(req.tool_choice_name)
        if self.tool_parser is not None:
            for s in self.states:
                s.tools = self.tool_parser.stream(req.parallel_tool_calls)

    # ----------------------------------------------------------------- accumulation

    def add(self, index: int, resp) -> tuple[ChoiceState, bool, str]:
        """Record a response; returns (state, first response?, text to relay)."""
        s = self.states[index]
        first = not s.started
        s.started = True
        text = resp.text
        if first and self.req.echo:
            prompt = self.req.prompts[index // self.req.n]
            s.prompt_text = prompt.text if prompt.text is not None else resp.prompt_text
            text = s.prompt_text + text
            # echo + logprobs: offsets count from the first prompt token
            s.text_offset = 0 if self.req.logprobs is not None else len(s.prompt_text)
        if first:
            s.prompt_logprobs = list(resp.prompt_logprobs)
            s.prompt_tokens = len(resp.prompt_token_ids) or len(resp.prompt_logprobs)
        s.text.append(text)
        s.token_ids.extend(resp.token_ids)
        s.logprobs.extend(resp.logprobs)
        if resp.finish_reason:
            s.finish_reason = FINISH_REASONS.get(resp.finish_reason, "stop")
            which = resp.WhichOneof("stop_reason")
            s.stop_reason = getattr(resp, which) if which else None
            s.usage = resp.usage
        return s, first, text

    # ----------------------------------------------------------------- logprobs

    def _chat_logprobs(self, lps) -> dict | None:
        if self.req.logprobs is None:
            return None

        def entry(tok: str, lp: float) -> dict:
            return {"token": tok, "logprob": _lp(lp), "bytes": list(tok.encode("utf-8"))}

        return {
            "content": [
                {
                    **entry(lp.token, lp.logprob),
                    "top_logprobs": [entry(t.token, t.logprob) for t in lp.top][
                        : self.req.logprobs
                    ],
                }
                for lp in lps
            ]
        }

    def _completion_logprobs(self, s: ChoiceState, lps, prompt=()) -> dict | None:
        """OpenAI's completions logprobs; `prompt` (echo): the prompt tokens first, the
        very first with null logprob and top_logprobs."""
        if self.req.logprobs is None:
            return None
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if prompt:
            out["tokens"].append(prompt[0].token)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(s.text_offset)
            s.text_offset += len(prompt[0].token)
        for lp in [*prompt[1:], *lps]:
            top = {t.token: _lp(t.logprob) for t in list(lp.top)[: self.req.logprobs]}
            top.setdefault(lp.token, _lp(lp.logprob))
            out["tokens"].append(lp.token)
            out["token_logprobs"].append(_lp(lp.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(s.text_offset)
            s.text_offset += len(lp.token)
        return out

    # ----------------------------------------------------------------- usage

    def usage(self) -> dict:
        n = self.req.n
        prompt = cached = completion = 0
        for p in range(len(self.req.prompts)):
            usages = [s.usage for s in self.states[p * n : (p + 1) * n] if s.usage is not None]
            prompt += max((u.prompt_tokens for u in usages), default=0)
            cached += max((u.cached_tokens for u in usages), default=0)
            completion += sum(u.completion_tokens for u in usages)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    # ----------------------------------------------------------------- streaming

    def _prompt_logprobs(self, s: ChoiceState) -> list | None:
        """vLLM's prompt_logprobs: null for the first prompt token, then per token
        {token id: {logprob, rank, decoded_token}} for the token and the top-n."""
        n = self.req.prompt_logprobs
        if n is None:
            return None
        out: list = [None]
        for lp in s.prompt_logprobs[1:]:
            entry = {
                str(t.token_id): {"logprob": _lp(t.logprob), "rank": r, "decoded_token": t.token}
                for r, t in enumerate(list(lp.top)[:n], 1)
            }
            entry[str(lp.token_id)] = {
                "logprob": _lp(lp.logprob),
                "rank": lp.rank,
                "decoded_token": lp.token,
            }
            out.append(entry)
        return out

    def usage_so_far(self) -> dict:
        """stream_options.continuous_usage_stats: the usage up to this chunk."""
        n = self.req.n
        prompt = sum(
            max((s.prompt_tokens for s in self.states[p * n : (p + 1) * n]), default=0)
            for p in range(len(self.req.prompts))
        )
        completion = sum(len(s.token_ids) for s in self.states)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def _chunk(self, choices: list[dict]) -> dict:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.req.include_usage:
            chunk["usage"] = self.usage_so_far() if self.req.continuous_usage else None
        return chunk

    def chunks(self, index: int, resp) -> list[dict]:
        """The stream chunks for one worker response of choice `index`."""
        s, first, text = self.add(index, resp)
        out = []
        finish = s.finish_reason if resp.finish_reason else None
        if self.chat:
            if first:
                role = {"role": "assistant", "content": ""}
                out.append(
                    self._chunk(
                        [{"index": index, "delta": role, "logprobs": None, "finish_reason": None}]
                    )
                )
            delta = self._delta(s, text, finish)
            if finish and s.tools is not None and s.tools.calls and self._calls_finish():
                finish = "tool_calls"
            if not (delta or resp.logprobs or finish):
                return out
            choice = {
                "index": index,
                "delta": delta or ({"content": ""} if resp.logprobs else {}),
                "logprobs": self._chat_logprobs(resp.logprobs),
                "finish_reason": finish,
            }
        else:
            if not (text or resp.logprobs or finish):
                return out
            choice = {
                "index": index,
                "text": text,
                "logprobs": self._completion_logprobs(
                    s, resp.logprobs, s.prompt_logprobs if first and self.req.echo else ()
                ),
                "finish_reason": finish,
            }
        if finish:
            choice["stop_reason"] = s.stop_reason
        out.append(self._chunk([choice]))
        return out

    def _calls_finish(self) -> bool:
        """finish_reason "tool_calls" when the model chose to call (auto) or had to
        call one of several (required); a named function ends with "stop", as in
        OpenAI's and vLLM's answers."""
        return self.req.tool_choice != "named"

    def _delta(self, s: ChoiceState, text: str, finish: str | None) -> dict:
        reasoning, content, calls = "", text, []
        if s.reasoning is not None:
            reasoning, content = s.reasoning.feed(text)
            if finish:
                r, c = s.reasoning.finish()
                reasoning, content = reasoning + r, content + c
        if s.tools is not None:
            content, calls = s.tools.feed(content)
            if finish:
                c, more = s.tools.finish()
                content, calls = content + c, calls + more
        delta = {}
        if reasoning:
            # `reasoning` is vLLM's current name, `reasoning_content` the one clients
            # written for DeepSeek and older vLLM read; vLLM sends both
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:  # each call whole, in one delta (router/tools.py)
            delta["tool_calls"] = [{"index": c.index, **c.to_dict()} for c in calls]
        return delta

    def usage_chunk(self) -> dict:
        chunk = self._chunk([])
        chunk["usage"] = self.usage()
        return chunk

    # ----------------------------------------------------------------- whole response

    def response(self) -> dict:
        choices = []
        for s in self.states:
            text = "".join(s.text)
            if self.chat:
                message = {"role": "assistant", "content": text}
                if self.parser is not None:
                    reasoning, content = self.parser.split(text, self.thinking)
                    message.update(
                        content=content, reasoning=reasoning, reasoning_content=reasoning
                    )
                if self.tool_parser is not None:
                    content, calls = self.tool_parser.parse(
                        message["content"] or "", self.req.parallel_tool_calls
                    )
                    if calls:  # without calls the content is the text unchanged
                        message["content"] = content
                        message["tool_calls"] = [c.to_dict() for c in calls]
                choice = {
                    "index": s.index,
                    "message": message,
                    "logprobs": self._chat_logprobs(s.logprobs),
                }
            else:
                echo_lps = self.req.echo and self.req.logprobs is not None
                s.text_offset = 0 if echo_lps else len(s.prompt_text or "")
                choice = {
                    "index": s.index,
                    "text": text,
                    "logprobs": self._completion_logprobs(
                        s, s.logprobs, s.prompt_logprobs if self.req.echo else ()
                    ),
                }
                if self.req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = self._prompt_logprobs(s)
            called = self.chat and "tool_calls" in choice["message"] and self._calls_finish()
            choice["finish_reason"] = "tool_calls" if called else s.finish_reason
            choice["stop_reason"] = s.stop_reason
            choices.append(choice)
        body = {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": self.usage(),
        }
        if self.chat and self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = self._prompt_logprobs(self.states[0])  # vLLM: top level
        return body
