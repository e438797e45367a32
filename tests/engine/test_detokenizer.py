"""Incremental detokenization: token by token it builds exactly the text transformers'
decode gives for the whole output, on the Rust backend's decode where transformers
would only forward to it, and through transformers' decode where it would do more
(space clean-up)."""

from __future__ import annotations

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
        for token in ids:
            detok.add_tokens([token], check_stop=False)
        detok.flush()
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=skip), ids


def test_space_clean_up_keeps_transformers_decode(tokenizer):
    # a tokenizer that cleans up spaces after decoding: the backend alone would not
    tokenizer.clean_up_tokenization_spaces = True
    try:
        assert fast_decode(tokenizer) == tokenizer.decode
    finally:
        tokenizer.clean_up_tokenization_spaces = False
