"""Incremental detokenization and stop-string matching for one request.

Decoding only a small window of recent tokens keeps each step O(1) in the output
length; a window ending in U+FFFD (an incomplete UTF-8 sequence) waits for the next
token. Where the Rust backend decodes alone (no space clean-up), its DecodeStream runs
that same window algorithm in one call per token (0.7 against 1.5 us a token on a
2-core Xeon: two decodes and the list slicing in Python otherwise); the offsets are
kept either way, so a request whose stream errs carries on with the Python window
(counted through `on_fallback`, logged)."""

from __future__ import annotations

import logging

from services.engine.sampling_params import SamplingParams

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # an older tokenizers: the Python window only
    DecodeStream = None

log = logging.getLogger(__name__)


def fast_decode(tokenizer):
    """decode(ids, skip_special_tokens) for this tokenizer: the Rust backend's own when
    transformers' decode would only forward to it (no space clean-up), about a third
    of the cost per call; two calls per generated token add up at high concurrency."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend.decode
    return tokenizer.decode


def decode_stream_backend(tokenizer):
    """The Rust tokenizer a DecodeStream can drive for this tokenizer, or None (no
    backend, space clean-up after decoding, or a tokenizers release without it)."""
    if tokenizer is None or DecodeStream is None or fast_decode(tokenizer) == tokenizer.decode:
        return None
    return tokenizer.backend_tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, on_fallback=None):
        """on_fallback(): called once if this request's DecodeStream errs and the
        Python window takes over."""
        self.tokenizer = tokenizer
        self._decode_ids = fast_decode(tokenizer) if tokenizer is not None else None
        self.params = params
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._max_stop_len = max((len(s) for s in params.stop), default=0)
        self._backend = decode_stream_backend(tokenizer)
        self._stream = None
        if self._backend is not None:
            self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self._on_fallback = on_fallback

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.params.skip_special_tokens)

    def add_tokens(self, new_ids: list[int], check_stop: bool) -> str | None:
        """Append tokens; returns the stop string that matched, if any (text is then
        truncated at it)."""
        delta = self.step(new_ids)
        if delta and check_stop and self.params.stop:
            return self._truncate_at_stop(len(delta))
        return None

    def step(self, new_ids: list[int]) -> str:
        """Append tokens, matching no stop string; returns the text they add."""
        if self.tokenizer is None:
            return ""
        if self._stream is not None:
            delta = self._stream_delta(new_ids)
        else:
            self.token_ids.extend(new_ids)
            delta = self._window_delta()
        if delta:
            self.text += delta
        return delta

    def _window_delta(self) -> str:
        """The text the tokens past the read offset add, decoded with the window
        before them ("" while it ends in an incomplete character)."""
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        return full[len(prefix) :]

    def _stream_delta(self, new_ids: list[int]) -> str:
        """The same window, stepped by the DecodeStream (it moves its window exactly as
        _window_delta moves the offsets, which are kept for flush and a fallback)."""
        parts = []
        for i, token in enumerate(new_ids):
            self.token_ids.append(token)
            try:
                chunk = self._stream.step(self._backend, token)
            except Exception as exc:  # tokenizers' DecodeStreamError (an invalid prefix)
                return "".join(parts) + self._fall_back(exc, new_ids[i + 1 :])
            if chunk is not None:
                self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
                if len(new_ids) == 1:  # the usual call: one token, no join
                    return chunk
                parts.append(chunk)
        return "".join(parts)

    def _fall_back(self, exc: Exception, rest: list[int]) -> str:
        log.warning("DecodeStream failed (%s); this request decodes in Python", exc)
        self._stream = None
        if self._on_fallback is not None:
            self._on_fallback()
        self.token_ids.extend(rest)
        return self._window_delta()  # from the same offsets, the failed token included

    def _truncate_at_stop(self, delta_len: int) -> str | None:
        # A stop string may span the previous text and the new delta.
        search_from = max(0, len(self.text) - delta_len - self._max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            idx = self.text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        end = idx + len(stop) if self.params.include_stop_str_in_output else idx
        self.text = self.text[:end]
        return stop

    def stable_text(self, finished: bool) -> str:
        """Text safe to stream: while running, hold back a tail that could still
        become a stop string."""
        if finished or not self.params.stop:
            return self.text
        hold = 0
        for stop in self.params.stop:
            for k in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:k]):
                    hold = k
                    break
        return self.text[: len(self.text) - hold] if hold else self.text

    def flush(self) -> None:
        """At the end of a request: emit whatever is still pending, even if it is an
        incomplete character."""
        if self.tokenizer is None or self._read_offset == len(self.token_ids):
            return
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full = self._decode(self.token_ids[self._prefix_offset :])
        self.text += full[len(prefix) :]
        self._prefix_offset = self._read_offset = len(self.token_ids)
