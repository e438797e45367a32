"""Structured outputs through xgrammar: compiled grammars and per-request matchers.

A request's constraint is compiled when the engine validates it, so a spec that does
not compile is refused at request time (ValueError -> 400), and compiled grammars are
kept in a bounded LRU keyed by (kind, spec): clients tend to send the same schema again
and again. Each request then owns a GrammarState: the allowed next tokens as xgrammar's
packed bitmask before each sample, advanced with each output token.

xgrammar is imported on first use: engines that never see a constraint skip its
start-up cost."""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict

import torch

from services.engine.sampling_params import StructuredOutput

log = logging.getLogger(__name__)

CACHE_SIZE = 128  # compiled grammars kept (the large ones are a few MB each)
_WHAT = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}
# OpenAI's json_object promises an object; vLLM compiles xgrammar's built-in JSON
# grammar, which also lets a top-level array through. An object fits both.
_OBJECT_SCHEMA = '{"type": "object"}'
# JSON's "any whitespace" (vLLM's default) bounded per gap between tokens of the JSON
# (xgrammar's max_whitespace_cnt): without a bound a small model can write newlines
# until max_tokens (SmolLM2-135M, greedy: 4 of 20 generated schemas in
# tests/router/test_json_schemas.py, none with it). 32 still fits an indented line
# seven levels deep.
MAX_JSON_WHITESPACE = 32
# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: "
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


class Grammars:
    """The model's compiler and its cache of compiled grammars. Thread-safe: the servers
    validate requests outside the engine's thread."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, so: StructuredOutput):
        """The compiled grammar of `so`; ValueError if it does not compile."""
        if self._tokenizer is None:
            raise ValueError("structured output needs a tokenizer; this model has none")
        key = (so.kind, so.spec)
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        # compiled outside the lock: a large schema takes seconds, and the engine thread
        # must not wait for it to fetch another (cached) grammar meanwhile
        compiled = self._compile(so)
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def state(self, so: StructuredOutput) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.compile(so)), self.vocab_size)

    def _compile(self, so: StructuredOutput):
        compiler = self._get_compiler()
        try:
            if so.kind in ("json", "json_object"):
                schema = so.spec if so.kind == "json" else _OBJECT_SCHEMA
                return compiler.compile_json_schema(schema, max_whitespace_cnt=MAX_JSON_WHITESPACE)
            if so.kind == "regex":
                return compiler.compile_regex(so.spec)
            if so.kind == "choice":
                return compiler.compile_grammar(choice_grammar(json.loads(so.spec)))
            if so.kind == "structural_tag":
                return _compile_structural_tag(compiler, json.loads(so.spec))
            return compiler.compile_grammar(so.spec)
        except (RuntimeError, ValueError, TypeError) as e:
            detail = _CPP_PREFIX.sub("", str(e).strip()).split(" The JSON string is:")[0]
            raise ValueError(
                f"structured output ({so.kind}): invalid {_WHAT[so.kind]}: {detail[:500]}"
            ) from None

    def _get_compiler(self):
        with self._lock:  # built once (about 2 s: the tokenizer's tables)
            return self._build_compiler()

    def _build_compiler(self):
        if self._compiler is None:
            try:
                import xgrammar as xgr
            except ImportError as e:  # a 400 naming what is missing, not a 500
                raise ValueError(
                    "structured outputs need the xgrammar package, which this worker "
                    "lacks (pip install 'pdserve[worker]')"
                ) from e

            info = xgr.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids
            )
            # our LRU is the cache; xgrammar's own would hold every grammar ever seen
            self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        return self._compiler

    def __len__(self) -> int:
        return len(self._cache)


def _compile_structural_tag(compiler, tag: dict):
    """vLLM's two shapes (router/structured.py): xgrammar's format object as it is, or
    the older structures + triggers, which xgrammar still takes as tag items."""
    import xgrammar as xgr

    if "format" in tag:
        return compiler.compile_structural_tag(tag)
    items = [
        xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
        for s in tag["structures"]
    ]
    return compiler.compile_structural_tag(items, tag["triggers"])


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of the strings (JSON string escapes are
    GBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarState:
    """One request's matcher. It only ever sees accepted output tokens, so it stays valid
    through preemption (the output is kept and recomputed, never resampled)."""

    def __init__(self, matcher, vocab_size: int):
        import xgrammar as xgr

        self.matcher = matcher
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def next_bitmask(self) -> torch.Tensor | None:
        """The allowed next tokens (bit t % 32 of int32 word t // 32), on the host; None
        when every token is allowed."""
        if not self.matcher.fill_next_token_bitmask(self._bitmask):
            return None
        return self._bitmask[0].clone()  # the buffer is refilled next step

    def accept(self, token: int) -> bool:
        """Advance with an output token; True when the grammar is done: its stop token was
        accepted, or the token broke it (never sampled here: the sampler lets the grammar
        win; a first token from a prefill worker that ignored the constraint could)."""
        if not self.matcher.accept_token(token):
            log.warning("token %d does not match the request's grammar: stopping", token)
            return True
        return self.matcher.is_terminated()
