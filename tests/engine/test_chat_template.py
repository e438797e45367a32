"""apply_chat_template's request options: chat_template_kwargs reach the template,
continue_final_message leaves the last message open, and the options that would clash
are ValueErrors (the worker's INVALID_ARGUMENT)."""

from __future__ import annotations

import pytest

from services.models.tokenizer import apply_chat_template, load_tokenizer

TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% if not loop.last or not "
    "continue_final_message %}[end]{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}[assistant]{% if mood is defined %}({{ mood }}){% endif %}"
    "{% endif %}"
)
MSGS = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def _text(tokenizer, **kw) -> str:
    return tokenizer.decode(apply_chat_template(tokenizer, MSGS, chat_template=TEMPLATE, **kw))


def test_template_kwargs_reach_the_template(tokenizer):
    assert _text(tokenizer).endswith("[end][assistant]")
    assert _text(tokenizer, template_kwargs={"mood": "calm"}).endswith("[assistant](calm)")


def test_continue_final_message_leaves_it_open(tokenizer):
    text = _text(tokenizer, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("[assistant]Hel")


def test_clashing_options_are_value_errors(tokenizer):
    with pytest.raises(ValueError, match="exclusive"):
        _text(tokenizer, continue_final_message=True)
    with pytest.raises(ValueError, match="may not set tokenize"):
        _text(tokenizer, template_kwargs={"tokenize": False})


def test_tools_reach_the_template(tokenizer):
    template = "{% for t in tools or [] %}<{{ t.function.name }}>{% endfor %}" + TEMPLATE
    tools = [{"type": "function", "function": {"name": "get_time"}}]
    text = tokenizer.decode(
        apply_chat_template(tokenizer, MSGS, chat_template=template, tools=tools)
    )
    assert text.startswith("<get_time>[user]hi")
    with pytest.raises(ValueError, match="may not set tools"):
        _text(tokenizer, template_kwargs={"tools": tools})
