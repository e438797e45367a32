"""Prompt logprobs (vLLM's prompt_logprobs) equal transformers' log-softmax through
chunked prefill and prefix-cache hits; logit_bias, bad_words, allowed_token_ids and
truncate_prompt_tokens shape what the engine samples (random-weight Llama, fp32)."""

from __future__ import annotations

import pytest
import torch

from services.engine import LLM, SamplingParams
from services.engine.sampler import Sampler, SamplingRequest
from tests.engine.helpers import assert_all_blocks_free, hf_load, hf_logprobs, save_random_model

PROMPT = [1, *range(40, 77)]  # 38 tokens: three chunks of 16, two full blocks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_random_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def llm(model_dir):
    # chunks of 16 tokens, blocks of 16: a 38-token prompt takes three steps. The torch
    # backend: these logprobs are held to 1e-4 of transformers', and the default (tuned)
    # backend's picks change with the CPU (on an AVX-512 Zen 4 its C RMSNorm's own sum
    # order moved one by 1.7e-4); the kernels' numerics are tested against torch apart
    return LLM(
        str(model_dir),
        kernel_backend="torch",
        max_num_batched_tokens=16,
        block_size=16,
        num_kv_blocks=64,
    )


@pytest.fixture(scope="module")
def reference(model_dir):
    return hf_logprobs(hf_load(model_dir), PROMPT)


@pytest.fixture(autouse=True)
def no_leaks(llm):
    yield
    assert_all_blocks_free(llm)


def check_prompt_logprobs(out, reference, top_n):
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(PROMPT) and lps[0] is None
    for j in range(1, len(PROMPT)):
        row = reference[j - 1]  # position j - 1 predicts token j
        entry = lps[j]
        tok = PROMPT[j]
        assert abs(entry[tok].logprob - row[tok].item()) < 1e-4, j
        assert entry[tok].rank == int((row > row[tok]).sum()) + 1
        top = torch.topk(row, top_n).indices.tolist() if top_n else []
        assert set(entry) == set(top) | {tok}
        for r, t in enumerate(top, 1):
            assert entry[t].rank == r and abs(entry[t].logprob - row[t].item()) < 1e-4


def test_prompt_logprobs_chunked_and_cached(llm, reference):
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    first = llm.generate([PROMPT], params)[0]
    check_prompt_logprobs(first, reference, 3)
    # the prompt's blocks are cached now: a second request must still get them all
    again = llm.generate([PROMPT], params)[0]
    check_prompt_logprobs(again, reference, 3)
    assert again.num_cached_tokens == 0
    # without prompt_logprobs the cache is used, and nothing is reported
    plain = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=2))[0]
    assert plain.num_cached_tokens == 32 and plain.prompt_logprobs is None
    assert plain.output.token_ids == first.output.token_ids
    # top-0: only the prompt token itself
    check_prompt_logprobs(
        llm.generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=0))[0], reference, 0
    )


def test_logit_bias_forces_and_bans(llm):
    base = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=6))[0].output.token_ids
    forced = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=6, logit_bias={7: 100})
    )[0]
    assert forced.output.token_ids == [7] * 6
    banned = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=6, logit_bias={base[0]: -100})
    )[0].output.token_ids
    assert banned[0] != base[0]
    # sampled rows are biased too (the device path of Sampler.sample)
    drawn = llm.generate(
        [PROMPT], SamplingParams(temperature=1.0, seed=3, max_tokens=6, logit_bias={9: 100})
    )[0]
    assert drawn.output.token_ids == [9] * 6


def test_allowed_token_ids_restrict_every_token(llm):
    allowed = [11, 12, 13]
    for params in (
        SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed),
        SamplingParams(temperature=1.0, seed=5, max_tokens=8, allowed_token_ids=allowed),
        # logprobs take the host path of the sampler
        SamplingParams(temperature=0, max_tokens=8, allowed_token_ids=allowed, logprobs=1),
    ):
        out = llm.generate([PROMPT], params)[0].output.token_ids
        assert len(out) == 8 and set(out) <= set(allowed)


def test_truncate_prompt_tokens_equals_the_truncated_prompt(llm):
    params = SamplingParams(temperature=0, max_tokens=5)
    short = llm.generate([PROMPT[-10:]], params)[0]
    cut = llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=5, truncate_prompt_tokens=10)
    )[0]
    assert cut.prompt_token_ids == PROMPT[-10:]
    assert cut.output.token_ids == short.output.token_ids


def test_bad_words_multi_token_ban_only_after_their_prefix():
    """The sampler bans a multi-token word's last token only right after its prefix."""
    logits = torch.zeros(2, 8)
    logits[:, 5] = 1.0  # token 5 is the argmax everywhere
    params = SamplingParams(temperature=0)

    def req(output):
        return SamplingRequest(params, [0, *output], 1, [], None, None, [[3, 5]])

    out = Sampler()(logits, [req([1, 3]), req([3, 1])])
    assert out.token_ids[0] != 5 and out.token_ids[1] == 5


def test_bad_words_through_the_tokenizer(colocated):
    llm = colocated
    prompt = "The capital of France is"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].output
    word = llm.tokenizer.decode(base.token_ids[:1]).strip()
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, bad_words=[word]))[0]
    banned = {
        t for p in ("", " ") for t in llm.tokenizer.encode(p + word, add_special_tokens=False)
    }
    assert not banned & set(out.output.token_ids)
    assert out.output.token_ids != base.token_ids
    assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(logit_bias={1: 101}),
        dict(logit_bias={-1: 1}),
        dict(allowed_token_ids=[]),
        dict(prompt_logprobs=21),
        dict(truncate_prompt_tokens=0),
        dict(bad_words=[" "]),
    ],
)
def test_bad_params_refused(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_token_ids_beyond_the_vocab_refused(llm):
    for kwargs in (dict(logit_bias={512: 1.0}), dict(allowed_token_ids=[3, 600])):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            llm.generate([PROMPT], SamplingParams(**kwargs))


def test_prompt_logprobs_survive_preemption(model_dir, reference):
    """A pool too small for all of them preempts sequences mid-prefill and mid-decode;
    each recomputes without collecting a prompt logprob twice."""
    llm = LLM(str(model_dir), max_num_batched_tokens=16, block_size=16, num_kv_blocks=8)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    outs = llm.generate([PROMPT] * 3, params)
    assert llm.engine.scheduler.num_preemptions > 0
    alone = llm.generate([PROMPT], params)[0]
    for out in outs:
        check_prompt_logprobs(out, reference, 1)
        assert out.output.token_ids == alone.output.token_ids
    assert_all_blocks_free(llm)
