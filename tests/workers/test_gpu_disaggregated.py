"""Prefill and decode workers on GPUs, KV through Mooncake's nvlink_intra: on two GPUs
(over NVLink), or both on one GPU (two processes, the copy inside the GPU). Token for
token what the colocated engine produces on one GPU. The decode worker runs its engine
in a process of its own, its default on a GPU, so the KV memory it registers with the
transfer engine lives there."""

from __future__ import annotations

import random

import pytest
import torch

from services.engine import LLM, SamplingParams
from tests.engine.helpers import save_random_model
from tests.workers.procs import start_worker
from tests.workers.test_disaggregated import generate

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("decode_device", ["cuda:1", "cuda:0"], ids=["two GPUs", "one GPU"])
def test_nvlink_disaggregated_equals_colocated(tmp_path, decode_device):
    needed = int(decode_device[-1]) + 1
    if not torch.cuda.is_available() or torch.cuda.device_count() < needed:
        pytest.skip(f"needs {needed} GPU(s)")
    model = str(save_random_model(tmp_path / "llama", "llama"))
    env = {"MC_INTRANODE_NVLINK": "1"}
    common = ("--dtype", "bfloat16", "--transfer-protocol", "nvlink_intra")
    prefill = start_worker("prefill", "--device", "cuda:0", *common, model=model, env=env)
    decode = start_worker("decode", "--device", decode_device, *common, model=model, env=env)
    try:
        colocated = LLM(model, device="cuda:0", dtype="bfloat16", num_kv_blocks=256)
        rng = random.Random(3)
        prompts = [[rng.randrange(3, 512) for _ in range(n)] for n in (5, 16, 40, 200, 700)]
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
        for prompt in prompts:
            ref = colocated.generate(prompt, params)[0].output.token_ids
            tokens, last = generate(decode, prompt, prefill, max_tokens=16, ignore_eos=True)
            assert tokens == ref
            assert not last.timings.prefill_fallback
        assert any("engine process" in line and "ready" in line for line in decode.log)
        report = prefill.load()
        assert report.kv_transfers_ok == len(prompts) and report.kv_transfers_failed == 0
        for w in (prefill, decode):
            r = w.wait_all_blocks_free()
            assert r.num_free_blocks == r.num_total_blocks
    finally:
        prefill.stop()
        decode.stop()
