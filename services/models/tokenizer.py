"""A model folder's tokenizer, its end-of-sequence ids and its chat template: what the
engine reads from the checkpoint besides the weights."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them
# (they have request fields of their own, or would change what the call returns).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "add_generation_prompt",
        "continue_final_message",
        "add_special_tokens",
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


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


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    *,
    add_special_tokens: bool = False,
    template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
    **kwargs,
) -> list[int]:
    """Token ids of one conversation through the model's chat template, with the
    generation prompt unless kwargs say otherwise. template_kwargs (a request's
    chat_template_kwargs: the template's own variables such as Qwen3's enable_thinking)
    reach the template and may not set apply_chat_template's arguments. Special
    tokens are not added by default (vLLM's chat default: the template writes them).
    Raises ValueError for anything the template refuses (empty conversation, bad roles
    or order, generation prompt together with continue_final_message). tools (OpenAI's
    [{"type": "function", "function": {...}}]) are the template's `tools`; messages may
    carry tool_calls (arguments as objects) and tool results (role "tool")."""
    if tokenizer is None:
        raise ValueError("this model has no tokenizer: send token ids")
    if not messages:
        raise ValueError("messages must not be empty")
    if template_kwargs:
        taken = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if taken:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(taken)}")
        kwargs = {**template_kwargs, **kwargs}
    if tools:
        kwargs["tools"] = tools
    kwargs.setdefault("add_generation_prompt", True)
    if kwargs["add_generation_prompt"] and kwargs.get("continue_final_message"):
        raise ValueError("add_generation_prompt and continue_final_message are exclusive")
    try:
        if add_special_tokens:
            text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
            return list(tokenizer.encode(text, add_special_tokens=True))
        ids = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    except Exception as e:  # jinja errors, raise_exception() in the template
        raise ValueError(f"cannot apply the chat template: {e}") from None
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
