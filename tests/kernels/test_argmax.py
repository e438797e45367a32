"""The two-stage greedy argmax (triton/argmax.py) against torch.argmax, index for
index: ties inside a chunk and across chunks, NaN, all -inf rows, vocabularies that
are not a multiple of the chunk. Small rows under Triton's interpreter on the CPU;
128k-vocabulary rows on a GPU (marked gpu)."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _argmax_rows(logits):
    from services.kernels.triton.argmax import argmax_rows

    return argmax_rows(logits)


def _check(logits):
    got = _argmax_rows(logits.to(DEVICE))
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == torch.argmax(logits, dim=-1).tolist()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [1, 7, 256, 1000])
def test_random_rows_equal_torch(dtype, vocab):
    g = torch.Generator().manual_seed(vocab)
    _check(torch.randn(5, vocab, generator=g).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_pick_the_first_index_inside_and_across_chunks(dtype):
    # the interpreter's chunks are 256 wide: 100 and 200 share one, 700 is two later
    logits = torch.zeros(4, 1000, dtype=dtype)
    logits[0, [200, 100, 700]] = 5.0  # first tie inside the first chunk
    logits[1, [700, 300]] = 5.0  # tie across chunks: 300 comes first
    logits[2, [999, 998]] = 3.0  # at the end of a partial last chunk
    logits[3] = 1.0  # every entry ties: index 0
    _check(logits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_ranks_above_every_number_as_in_torch(dtype):
    logits = torch.zeros(4, 1000, dtype=dtype)
    logits[0, 600] = float("nan")
    logits[0, 10] = float("inf")  # NaN still wins, as torch ranks it
    logits[1, [900, 400]] = float("nan")  # the first NaN
    logits[2, [30, 5, 800]] = float("nan")  # two in one chunk: 5
    logits[3] = float("-inf")  # nothing above -inf: index 0
    _check(logits)


def test_strided_rows_and_bad_shapes():
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(3, 1200, generator=g)
    _check(wide[:, :1000])  # rows 1200 apart
    with pytest.raises(ValueError, match="rows, vocab"):
        _argmax_rows(torch.zeros(10, device=DEVICE))
    with pytest.raises(ValueError, match="empty vocabulary"):
        _argmax_rows(torch.zeros(2, 0, device=DEVICE))
    assert _argmax_rows(torch.zeros(0, 10, device=DEVICE)).shape == (0,)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_vocabulary_sized_rows_on_a_gpu(rows, dtype):
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 128256, generator=g).to(dtype)
    logits[0, [70000, 5000]] = 100.0  # a tie across the 2048-wide chunks
    got = _argmax_rows(logits.cuda())
    assert got.cpu().tolist() == torch.argmax(logits, dim=-1).tolist()
    assert got[0].item() == 5000
