"""Tool-call parsers: the model's calls found in its output text, as vLLM's
`--tool-call-parser NAME` finds them (hermes, llama3_json, mistral), and the forced
tool_choice's output turned into calls.

Like the reasoning parsers (router/reasoning.py), the whole-output parse runs the
streaming parser over the whole text, so streamed deltas always add up to the
non-streamed answer. A call is streamed whole (id, name and complete arguments in one
delta) once it is complete: hermes when its `</tool_call>` arrives, mistral when the
next `[TOOL_CALLS]` starts or the output ends, llama3_json at the end of the output
(only then is the JSON known to be a call and not an answer). A block that is not a
valid call stays in the content as written. Whitespace that only separates calls from
each other or from the text is dropped, so an output of calls alone has null
content."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any


def _held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    index: int = 0  # position among the choice's calls
    id: str = field(default_factory=new_call_id)

    def to_dict(self) -> dict:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _call_from(obj: Any, arg_keys: tuple[str, ...]) -> ToolCall | None:
    """{"name": ..., <arg key>: {...}} -> ToolCall; None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolCallStream:
    """One choice's output, delta by delta: feed() and finish() return the content that
    is certain so far and the calls completed. With parallel_tool_calls false only the
    first call is kept (later ones are dropped, as a call, not turned into content)."""

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.calls: list[ToolCall] = []

    def _keep(self, call: ToolCall) -> list[ToolCall]:
        if self.calls and not self.parallel:
            return []
        call.index = len(self.calls)
        self.calls.append(call)
        return [call]

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError


class TaggedStream(ToolCallStream):
    """Calls in blocks that open with START anywhere in the output and close with END,
    or, without an END, where the next block opens or the output ends. A subclass reads
    a block's calls (_calls_in); an unclosed last block counts when it reads whole."""

    START: str = ""
    END: str | None = None

    def __init__(self, parallel: bool = True):
        super().__init__(parallel)
        self._buf = ""  # outside a call: a possible start tag; inside: the block so far
        self._in_call = False
        # Whitespace next to a call is held: dropped at the content's ends, and between
        # two texts only one run is kept (the one before the call, else the one after).
        self._ws = ""  # the content's trailing whitespace
        self._after_call = False  # a call came after the last text
        self._lead = ""  # whitespace since that call
        self._any = False  # some content emitted

    def _text(self, s: str) -> str:
        if self._after_call:
            stripped = s.lstrip()
            if not stripped:
                self._lead += s
                return ""
            sep = (self._ws or self._lead + s[: len(s) - len(stripped)]) if self._any else ""
            s, self._ws, self._lead, self._after_call = sep + stripped, "", "", False
        s = self._ws + s
        kept = s.rstrip()
        self._ws = s[len(kept) :]
        self._any = self._any or bool(kept)
        return kept

    def _calls_in(self, body: str) -> list[ToolCall] | None:
        """The calls of a block's body; None when it is not a block of calls."""
        raise NotImplementedError

    def _close(self, body: str, closed: bool) -> tuple[str, list[ToolCall]]:
        self._in_call = False
        calls = self._calls_in(body)
        if not calls:  # not calls: the block stays in the content as written
            end = self.END if closed and self.END else ""
            return self._text(self.START + body + end), []
        self._after_call, self._lead = True, ""
        return "", [k for call in calls for k in self._keep(call)]

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        text, content, calls = self._buf + delta, [], []
        while True:
            if self._in_call:
                # without an END tag the next START ends the block (and stays to open
                # the next one)
                end = text.find(self.END or self.START)
                if end < 0:
                    self._buf = text
                    break
                c, k = self._close(text[:end], closed=True)
                content.append(c)
                calls += k
                text = text[end + len(self.END or "") :]
            else:
                start = text.find(self.START)
                if start < 0:
                    keep = _held_back(text, self.START)
                    content.append(self._text(text[: len(text) - keep]))
                    self._buf = text[len(text) - keep :]
                    break
                content.append(self._text(text[:start]))
                self._in_call = True
                text = text[start + len(self.START) :]
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        buf, self._buf = self._buf, ""
        if self._in_call:
            content, calls = self._close(buf, closed=False)
        else:
            content, calls = self._text(buf), []
        if not self._after_call:  # the output's own trailing whitespace
            content += self._ws
        self._ws = self._lead = ""
        return content, calls


class HermesStream(TaggedStream):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5,
    Qwen3)."""

    START, END = "<tool_call>", "</tool_call>"

    def _calls_in(self, body: str) -> list[ToolCall] | None:
        call = _call_from(_loads(body), ("arguments",))
        return None if call is None else [call]


class MistralStream(TaggedStream):
    """Mistral's `[TOOL_CALLS]` blocks, in each form its tokenizers write:
    `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}, ...]` (v3: a JSON list of
    calls, or one call object; "id" optional), `[TOOL_CALLS]name[ARGS]{...}` (v11 and
    later: one call per block) and `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` (the same
    with the call's id, as v13 tokenizers write it: Magistral, Mistral Small 3.2,
    Devstral). A block ends where the next one starts, or with the output. A call keeps
    the id the model wrote; one without (or with an id it already used in this output)
    gets 9 letters and digits: Mistral's chat templates refuse any other id when the
    calls come back in the history. [TOOL_CALLS] is a special token: the output must
    keep special tokens (skip_special_tokens false) for the calls to be found."""

    START, END = "[TOOL_CALLS]", None
    ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"

    def _calls_in(self, body: str) -> list[ToolCall] | None:
        head, args_tag, args = body.partition(self.ARGS)
        if args_tag:  # name[ARGS]{...} or name[CALL_ID]id[ARGS]{...}
            name, _, call_id = (s.strip() for s in head.partition(self.CALL_ID))
            if not name or any(c.isspace() or c == "[" for c in name):
                return None
            found = [{"name": name, "arguments": _loads(args), "id": call_id}]
        else:  # [{...}, ...] or {...}
            found = _loads(body)
            found = [found] if isinstance(found, dict) else found
            if not isinstance(found, list):
                return None
        calls = [_call_from(obj, ("arguments",)) for obj in found]
        if not calls or None in calls:
            return None
        used = {call.id for call in self.calls}
        for obj, call in zip(found, calls):
            given = obj.get("id")
            ok = isinstance(given, str) and given and not any(c.isspace() for c in given)
            call.id = given if ok and given not in used else mistral_call_id()
            used.add(call.id)
        return calls


_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    return "".join(secrets.choice(_ID_CHARS) for _ in range(9))


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class Llama3JsonStream(ToolCallStream):
    """Llama 3.x JSON calls: the whole output is `{"name": ..., "parameters": {...}}`
    (or "arguments"), several separated by `;`, possibly after `<|python_tag|>`. An
    output that starts otherwise streams as content at once; one that starts like a
    call is held to the end, then returned as calls, or as content if it is not."""

    TAG = "<|python_tag|>"

    def __init__(self, parallel: bool = True):
        super().__init__(parallel)
        self._buf = ""
        self._content = False  # decided: plain content

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self._content:
            return delta, []
        self._buf += delta
        head = self._buf.lstrip()
        if not head or head.startswith(("{", self.TAG)) or self.TAG.startswith(head):
            return "", []  # undecided, or a call being written
        self._content = True
        buf, self._buf = self._buf, ""
        return buf, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        buf, self._buf = self._buf, ""
        objs = self._objects(buf)
        calls = [_call_from(o, ("parameters", "arguments")) for o in objs or ()]
        if not calls or any(c is None for c in calls):
            return buf, []
        return "", [k for c in calls for k in self._keep(c)]

    def _objects(self, text: str) -> list | None:
        s = text.strip()
        if s.startswith(self.TAG):
            s = s[len(self.TAG) :].lstrip()
        decoder, pos, objs = json.JSONDecoder(), 0, []
        while pos < len(s):
            try:
                obj, pos = decoder.raw_decode(s, pos)
            except ValueError:
                return None
            objs.append(obj)
            rest = s[pos:].lstrip()
            if rest and not rest.startswith(";"):
                return None
            pos = len(s) - len(rest[1:].lstrip()) if rest else len(s)
        return objs


class ToolParser:
    name = ""
    stream_class: type[ToolCallStream] = ToolCallStream

    def stream(self, parallel: bool = True) -> ToolCallStream:
        return self.stream_class(parallel)

    def parse(self, text: str, parallel: bool = True) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole output; content None when there is none."""
        stream = self.stream(parallel)
        c1, k1 = stream.feed(text)
        c2, k2 = stream.finish()
        return (c1 + c2) or None, k1 + k2


class HermesToolParser(ToolParser):
    name = "hermes"
    stream_class = HermesStream


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    stream_class = Llama3JsonStream


class MistralToolParser(ToolParser):
    name = "mistral"
    stream_class = MistralStream
    # [TOOL_CALLS] is a special token: the worker must not skip it (vLLM does the same)
    keeps_special_tokens = True


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def make_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()


class ForcedToolStream(ToolCallStream):
    """A forced tool_choice's output is the calls' JSON alone (the constraint saw to
    it): nothing streams as content; at the end it becomes the calls. An output cut
    short (max_tokens) is not valid JSON: it is returned as content, without calls."""

    def __init__(self, name: str | None, parallel: bool = True):
        super().__init__(parallel)
        self.name = name
        self._text = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._text += text
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        try:
            value = json.loads(self._text)
        except ValueError:
            return self._text, []
        if self.name is not None:
            found = [{"name": self.name, "parameters": value}]
        else:
            found = value if isinstance(value, list) else []
        calls = [_call_from(c, ("parameters",)) for c in found]
        if not calls or None in calls:
            return self._text, []
        for i, call in enumerate(calls):
            call.index = i
        self.calls = calls
        return "", calls


class ForcedToolParser(ToolParser):
    name = "forced"

    def __init__(self, function: str | None):
        self.function = function

    def stream(self, parallel: bool = True) -> ToolCallStream:
        return ForcedToolStream(self.function, parallel)
