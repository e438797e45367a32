"""Incremental detokenization: token by token it builds exactly the text transformers'
decode gives for the whole output: through the Rust DecodeStream where transformers'
decode would only forward to the backend, through transformers' decode where it would
do more (space clean-up), and when a request's DecodeStream fails midway (a fault
injected here) the Python window carries on with the same text, counted."""

from __future__ import annotations

import functools
import random

import pytest

from services.engine.detokenizer import IncrementalDetokenizer, fast_decode
from services.engine.sampling_params import SamplingParams
from services.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def _outputs(tokenizer, n: int = 300) -> list[list[int]]:
    rng = random.Random(0)
    special = sorted(tokenizer.all_special_ids)
    outs = []
    for _ in range(n):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 24))]
        if rng.random() < 0.3:  # special tokens mid-output (skip_special_tokens matters)
            ids.insert(rng.randrange(len(ids)), rng.choice(special))
        outs.append(ids)
    # multi-byte characters split over tokens: the window waits for the whole character
    outs.append(tokenizer.encode("naïve café — 東京 🙂 ok", add_special_tokens=False))
    return outs


@pytest.mark.parametrize("skip", [True, False])
def test_token_by_token_equals_whole_decode(tokenizer, skip):
    assert fast_decode(tokenizer) == tokenizer.backend_tokenizer.decode  # the fast path
    params = SamplingParams(skip_special_tokens=skip)
    for ids in _outputs(tokenizer):
        detok = IncrementalDetokenizer(tokenizer, params)
        assert detok._stream is not None  # the Rust DecodeStream runs it
        for token in ids:
            detok.add_tokens([token], check_stop=False)
        detok.flush()
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip), ids


class _FailingStream:
    """A DecodeStream that fails at its `fail_at`-th step (an injected fault)."""

    def __init__(self, real, fail_at: int):
        self.real, self.fail_at, self.steps = real, fail_at, 0

    def step(self, backend, token):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("injected: invalid prefix")
        return self.real.step(backend, token)


@pytest.mark.parametrize("batch", [1, 3])
def test_a_failing_stream_falls_back_to_the_same_text(tokenizer, batch):
    params = SamplingParams(skip_special_tokens=True)
    outputs = _outputs(tokenizer, n=40)
    for ids in outputs[-6:]:  # the multi-byte one among them
        for fail_at in range(1, len(ids) + 1, 3):
            fallbacks = []
            detok = IncrementalDetokenizer(
                tokenizer, params, functools.partial(fallbacks.append, 1)
            )
            detok._stream = _FailingStream(detok._stream, fail_at)
            for start in range(0, len(ids), batch):  # tokens one by one or a few at once
                detok.add_tokens(ids[start : start + batch], check_stop=False)
            detok.flush()
            assert detok.text == tokenizer.decode(ids, skip_special_tokens=True), (ids, fail_at)
            assert fallbacks == [1] and detok._stream is None


def test_several_tokens_at_once_give_the_same_text(tokenizer):
    params = SamplingParams(skip_special_tokens=False)
    for ids in _outputs(tokenizer, n=60):
        detok = IncrementalDetokenizer(tokenizer, params)
        for start in range(0, len(ids), 4):
            detok.add_tokens(ids[start : start + 4], check_stop=False)
        detok.flush()
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=False), ids


def test_space_clean_up_keeps_transformers_decode(tokenizer):
    # a tokenizer that cleans up spaces after decoding: the backend alone would not
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert fast_decode(tokenizer) == tokenizer.decode
        detok = IncrementalDetokenizer(tokenizer, SamplingParams())
        assert detok._stream is None  # the stream would skip the clean-up too
        ids = tokenizer.encode("Hello , world ! It 's fine .", add_special_tokens=False)
        for token in ids:
            detok.add_tokens([token], check_stop=False)
        detok.flush()
        assert detok.text == tokenizer.decode(ids)
    finally:
        tokenizer.clean_up_tokenization_spaces = False
