"""A model folder's tokenizer, its end-of-sequence ids and its chat template: what the
engine reads from the checkpoint besides the weights."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def load_tokenizer(model_path: Path):
    """The folder's tokenizer, or None when it ships none (random-weight and benchmark
    checkpoints often do not: their prompts are token ids)."""
    from transformers import AutoTokenizer

    if not any((model_path / n).exists() for n in _TOKENIZER_FILES):
        log.warning("no tokenizer files in %s: only token-id prompts will work", model_path)
        return None
    return AutoTokenizer.from_pretrained(model_path)


def eos_token_ids(model_path: Path, tokenizer, hf_config) -> list[int]:
    """generation_config.json's eos ids, else the tokenizer's, else config.json's."""
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path)
        eos = gen.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except Exception:
        pass  # no generation_config.json: fall back to the tokenizer / model config
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    if not ids and getattr(hf_config, "eos_token_id", None) is not None:
        eos = hf_config.eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos])
    return sorted(ids)


def apply_chat_template(tokenizer, messages: list[dict], **kwargs) -> list[int]:
    """Token ids of one conversation through the model's chat template, with the
    generation prompt unless kwargs say otherwise. Raises ValueError for anything the
    template refuses (empty conversation, bad roles or order): the caller's mistake."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: send token ids")
    if not messages:
        raise ValueError("messages must not be empty")
    kwargs.setdefault("add_generation_prompt", True)
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise ValueError(f"cannot apply the chat template: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
