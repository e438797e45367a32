"""Models named by their Hugging Face Hub id. Nothing can be downloaded in the tests, so
each one builds the Hub's own cache layout (models--owner--name with refs/ and
snapshots/<commit>/, what huggingface_hub writes) and runs offline (HF_HUB_OFFLINE=1,
read by the library at import: in the worker process it configures): a real decode
worker started with `--model owner/name --download-dir <cache>` serves the cached
snapshot, `--revision` picks another, a repo the cache lacks is a clear error at start,
and the flags are refused where they cannot apply. Also: a folder's safetensors index
decides which weight files load (repos ship other weights beside them)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest
from safetensors.torch import save_file

from services.engine import LLM, SamplingParams
from tests.engine.helpers import assert_all_blocks_free, save_random_model
from tests.workers.procs import start_worker
from tests.workers.test_disaggregated import generate

REPO = "acme/tiny-qwen2"
COMMITS = {"main": "a" * 40, "v2": "b" * 40}
OFFLINE = {"HF_HUB_OFFLINE": "1"}
PROMPTS = [[random.Random(n).randrange(3, 512) for _ in range(n)] for n in (3, 20, 45)]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _cache_with(cache, repo: str, snapshots: dict) -> None:
    """The Hub cache as huggingface_hub lays it out: refs/<revision> holds the commit,
    snapshots/<commit>/ the files."""
    root = cache / f"models--{repo.replace('/', '--')}"
    for revision, folder in snapshots.items():
        commit = COMMITS[revision]
        shutil.copytree(folder, root / "snapshots" / commit)
        (root / "refs").mkdir(parents=True, exist_ok=True)
        (root / "refs" / revision).write_text(commit)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    main = save_random_model(root / "main", "qwen2", seed=0)
    v2 = save_random_model(root / "v2", "qwen2", seed=1)
    _cache_with(root / "cache", REPO, {"main": main, "v2": v2})
    return root


def _tokens(llm) -> list[list[int]]:
    return [o.output.token_ids for o in llm.generate(PROMPTS, PARAMS)]


def test_a_worker_serves_a_hub_id_from_the_cache(hub_cache):
    want = {rev: _tokens(LLM(str(hub_cache / rev))) for rev in ("main", "v2")}
    assert want["main"] != want["v2"]  # the revisions are different models
    cache = str(hub_cache / "cache")
    for revision in ("main", "v2"):
        args = ("--download-dir", cache) + (("--revision", revision) if revision != "main" else ())
        decode = start_worker("decode", *args, model=REPO, env=OFFLINE)
        try:
            got = [generate(decode, p, None, 8, ignore_eos=True)[0] for p in PROMPTS]
            assert got == want[revision]
            assert decode.load().model == REPO  # clients see the name they asked for
            report = decode.wait_all_blocks_free()
            assert report.num_free_blocks == report.num_total_blocks
        finally:
            decode.stop()


def _start_error(model: str, *args: str) -> str:
    """What a worker started with these flags says on its way out (it must not serve)."""
    cmd = [sys.executable, "-m", "pdserve", "decode", "--model", model, "--port", "0", *args]
    proc = subprocess.run(
        cmd, env={**os.environ, **OFFLINE}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0, proc.stdout
    return proc.stdout + proc.stderr


def test_a_hub_id_the_cache_lacks_is_a_clear_error_offline(hub_cache):
    out = _start_error("acme/not-cached", "--download-dir", str(hub_cache / "cache"))
    assert "acme/not-cached is not in the Hugging Face cache" in out
    assert "HF_HUB_OFFLINE" in out
    out = _start_error(REPO, "--download-dir", str(hub_cache / "cache"), "--revision", "v9")
    assert f"{REPO} at revision v9 is not in the Hugging Face cache" in out


def test_hub_flags_are_refused_for_local_models(hub_cache):
    with pytest.raises(ValueError, match="--revision applies to Hugging Face Hub ids"):
        LLM(str(hub_cache / "main"), revision="v2")
    with pytest.raises(ValueError, match="--download-dir applies to Hugging Face Hub ids"):
        LLM("smollm2-135m", download_dir=str(hub_cache))
    with pytest.raises(ValueError, match="not a folder, not a Hugging Face Hub id"):
        LLM(str(hub_cache / "no such folder"))


def test_the_index_decides_which_weights_load(tmp_path):
    """A sharded checkpoint with its index, and beside it a file of other weights (as
    Mistral's repos ship consolidated.safetensors): only the indexed files load."""
    from transformers import AutoModelForCausalLM

    plain = save_random_model(tmp_path / "plain", "qwen2")
    sharded = tmp_path / "sharded"
    model = AutoModelForCausalLM.from_pretrained(plain)
    model.save_pretrained(sharded, max_shard_size="200KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    save_file({"layers.0.attention.wq.weight": model.lm_head.weight.detach().clone()},
              sharded / "consolidated.safetensors")  # fmt: skip
    llm = LLM(str(sharded))
    assert _tokens(llm) == _tokens(LLM(str(plain)))
    assert_all_blocks_free(llm)
    # a file the index names but the folder lacks: said, not skipped
    (sharded / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(ValueError, match="which the folder lacks"):
        LLM(str(sharded))
