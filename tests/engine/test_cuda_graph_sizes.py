"""Which decode batch sizes get a CUDA graph (services/engine/cuda_graph.py): every batch
the engine can run must round up to a captured size, also past 256 streams."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from services.engine.cuda_graph import capture_sizes  # noqa: E402


@pytest.mark.parametrize("max_batch", [1, 3, 8, 100, 256, 300, 512, 1024])
def test_every_batch_rounds_up_to_a_captured_size(max_batch):
    sizes = capture_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
    for batch in range(1, max_batch + 1):
        padded = min(s for s in sizes if s >= batch)
        # padding is bounded: a replay never computes many more rows than the batch has
        assert padded - batch <= max(15, batch // 8), (batch, padded)


def test_sizes_past_256_step_by_32():
    assert capture_sizes(512)[-9:] == [256, 288, 320, 352, 384, 416, 448, 480, 512]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]


def test_a_pick_that_cannot_be_captured_keeps_large_batches_eager(caplog):
    """Decode batches past 256 tokens take the prefill class's picks; an override that
    cannot be captured there caps the decode graphs at 256 (logged) instead of failing
    the capture."""
    from types import SimpleNamespace

    from services.engine.cuda_graph import decode_graph_max_batch
    from services.kernels.shape_classes import graph_blocker

    safe = {"store_kv_cache.prefill": "triton", "paged_attention.mixed": "sdpa"}
    assert graph_blocker(safe, [512]) is None  # the mixed attention pick is not used
    unsafe = {**safe, "store_kv_cache.prefill": "torch"}
    assert "store_kv_cache.prefill" in graph_blocker(unsafe, [512])
    assert graph_blocker(unsafe, [256]) is None  # decode classes only

    def ops(picks):
        return SimpleNamespace(graph_blocker=lambda counts: graph_blocker(picks, counts))

    assert decode_graph_max_batch(512, ops(safe)) == 512
    assert decode_graph_max_batch(200, ops(unsafe)) == 200
    with caplog.at_level("WARNING"):
        assert decode_graph_max_batch(512, ops(unsafe)) == 256
    assert "decode batches over 256 run eagerly: store_kv_cache.prefill" in caplog.text
