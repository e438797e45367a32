"""The sampler's grammar mask: xgrammar's kernel (CPU) and the torch unpacking (GPU, run
here on the CPU) forbid exactly the tokens whose bit is 0, in the grammar rows only,
with columns past the bitmask (a padded LM head) forbidden and the input untouched."""

from __future__ import annotations

import pytest
import torch

from services.engine.sampler import SamplingRequest, _apply_grammar, _mask_with_torch

NEG_INF = float("-inf")


def reference(logits: torch.Tensor, bitmasks: dict[int, torch.Tensor]) -> torch.Tensor:
    out = logits.clone()
    for row, words in bitmasks.items():
        for token in range(out.shape[1]):
            word = token // 32
            if word >= words.numel() or not (int(words[word]) >> (token % 32)) & 1:
                out[row, token] = NEG_INF
    return out


# (batch, vocab columns of the logits, bitmask words, grammar rows)
SHAPES = [
    (4, 64, 2, [1, 3]),  # mixed batch
    (3, 100, 3, [0, 1, 2]),  # a padded LM head: columns 96..99 are past the bitmask
    (2, 50, 2, [1]),  # the bitmask covers more than the logits
    (1, 320, 10, [0]),
]


@pytest.mark.parametrize("batch,vocab,words,rows", SHAPES)
def test_both_paths_forbid_exactly_the_zero_bits(batch, vocab, words, rows):
    gen = torch.Generator().manual_seed(batch * vocab)
    logits = torch.randn(batch, vocab, generator=gen)
    bits = torch.randint(-(2**31), 2**31 - 1, (batch, words), dtype=torch.int32, generator=gen)
    bits[rows[0], 0] = -1  # a word allowing every token
    bitmasks = {i: bits[i] for i in rows}
    want = reference(logits, bitmasks)
    requests = [
        SamplingRequest(None, [], 0, [], None, grammar_bitmask=bitmasks.get(i))
        for i in range(batch)
    ]
    before = logits.clone()
    got = _apply_grammar(logits, requests, rows)
    assert torch.equal(got, want) and torch.equal(logits, before)
    width = min(words * 32, vocab)
    by_torch = logits.clone()
    _mask_with_torch(by_torch, bits[rows], rows, width)
    by_torch[rows, width:] = NEG_INF
    assert torch.equal(by_torch, want)
