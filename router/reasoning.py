"""Reasoning parsers: split a reasoning model's `<think>...</think>` block from its
answer, as vLLM's `--reasoning-parser` does, into `reasoning` (also sent as the older
`reasoning_content`) and `content`.

The router works on text (it holds no tokenizer), so a tag split across two stream
deltas is held back until it is whole or cannot be one: streamed deltas joined always
equal the non-streamed split.

Both parsers read the output the same way: everything up to the first `</think>` is
reasoning (a `<think>` in it, which models whose template does not open the block in
the prompt emit themselves, is dropped), the rest is content; without `</think>` the
whole output is reasoning (the model stopped while thinking). `qwen3` differs in one
case: when the request's chat_template_kwargs set `enable_thinking` to false, the
template already closed the block in the prompt and the whole output is content."""

from __future__ import annotations

START, END = "<think>", "</think>"


class ReasoningParser:
    name = ""

    def thinking(self, chat_template_kwargs: dict | None) -> bool:
        """Whether this request's output starts inside the reasoning block."""
        return True

    def split(self, text: str, thinking: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of a whole output; None where there is none."""
        stream = ReasoningStream(thinking)
        r1, c1 = stream.feed(text)
        r2, c2 = stream.finish()
        reasoning, content = r1 + r2, c1 + c2
        if not stream.ended and thinking:
            return reasoning, None
        return (reasoning if stream.ended else None), (content or None)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"

    def thinking(self, chat_template_kwargs: dict | None) -> bool:
        return (chat_template_kwargs or {}).get("enable_thinking", True) is not False


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)
}


def make_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {sorted(REASONING_PARSERS)}"
        )
    return REASONING_PARSERS[name]()


def _held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """One choice's output, delta by delta: feed() returns the (reasoning, content)
    text that is certain so far; finish() flushes what was held back."""

    def __init__(self, thinking: bool = True):
        self.in_reasoning = thinking
        self.ended = False  # `</think>` seen
        self._start_dropped = False
        self._pending = ""

    def feed(self, delta: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", delta
        text = self._pending + delta
        if not self._start_dropped:
            start, end = text.find(START), text.find(END)
            if start >= 0 and (end < 0 or start < end):
                text = text[:start] + text[start + len(START) :]
                self._start_dropped = True
        end = text.find(END)
        if end >= 0:
            self._pending = ""
            self.in_reasoning = False
            self.ended = True
            return text[:end], text[end + len(END) :]
        keep = _held_back(text, END)
        if not self._start_dropped:
            keep = max(keep, _held_back(text, START))
        self._pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], ""

    def finish(self) -> tuple[str, str]:
        """The text held back at the end of the output (a tag that never completed)."""
        pending, self._pending = self._pending, ""
        return (pending, "") if self.in_reasoning else ("", pending)
