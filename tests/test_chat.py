"""Chat templates render like transformers' apply_chat_template and encode without a second BOS."""

from __future__ import annotations

import json

import pytest

from tinyinfer.runtime.chat import encode_chat, render_chat
from tinyinfer.runtime.errors import ChatTemplateError
from tinyinfer.runtime.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3? 😀 日本"},
     {"role": "assistant", "content": " 6, with a leading space."}, {"role": "user", "content": "Thanks\n\nbye "}],
]
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def converted(folder, hf_config: dict):
    """(runtime tokenizer, chat template, special tokens) as tinyconvert embeds them for the folder."""
    from tinyinfer.convert.tokenizer_files import hf_tokenizer

    meta, template, _ = hf_tokenizer(folder, hf_config)
    return Tokenizer.from_metadata(meta), template, meta["special_tokens"]


@pytest.fixture(scope="module")
def tinyllama(shared_assets):
    folder = shared_assets / "tinyllama-1.1b-chat-v1.0"
    tokenizer, template, _ = converted(folder, json.loads((folder / "config.json").read_text()))
    return folder, template, tokenizer


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_tinyllama_template_renders_like_transformers(tinyllama, add_generation_prompt):
    transformers = pytest.importorskip("transformers")
    folder, template, _ = tinyllama
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
        assert render_chat(template, messages, SPECIALS, add_generation_prompt) == expected


def test_tinyllama_chat_ids_equal_transformers_plus_one_bos(tinyllama):
    """transformers encodes the rendered chat without special tokens; the TinyLlama template writes no
    BOS, so we add the one BOS the model was trained with (as llama.cpp does), and only that one."""
    transformers = pytest.importorskip("transformers")
    folder, template, tokenizer = tinyllama
    reference = transformers.AutoTokenizer.from_pretrained(str(folder))
    for messages in CONVERSATIONS:
        expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert expected[0] != 1
        assert encode_chat(tokenizer, template, messages) == [1] + expected


def test_template_that_writes_bos_gets_exactly_one(tinyllama, shared_assets):
    template = "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{{ eos_token }}{% endfor %}"
    _, _, hf = tinyllama
    sp = Tokenizer.from_metadata(dict(kind="sentencepiece", bos_id=1, eos_ids=[2], add_bos=True,
                                      special_tokens=SPECIALS,
                                      tokenizer_model=(shared_assets / "llama2-tokenizer" / "tokenizer.model").read_bytes()))
    for tok in (hf, sp):
        ids = encode_chat(tok, template, CONVERSATIONS[1])
        assert ids[:2] != [1, 1] and ids[0] == 1 and ids.count(1) == 1
        assert ids.count(2) == 2                       # eos_token written by the template -> the EOS id


def render(template, messages=CONVERSATIONS[0], **kwargs):
    return render_chat(template, messages, SPECIALS, **kwargs)


def test_environment_matches_transformers():
    # trim_blocks and lstrip_blocks: block tags leave no whitespace behind
    assert render("  {% if true %}\nA{% endif %}\n") == "A"
    # loopcontrols extension
    assert render("{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}") == "012"
    # tojson does not escape HTML and keeps non-ASCII characters
    assert render("{{ x | tojson }}", x={"a": "<b>&é"}) == '{"a": "<b>&é"}'
    # special tokens are variables, caller kwargs override them
    assert render("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}") == "<s>|</s>|True"
    assert render("{{ bos_token }}", bos_token="<BOS>") == "<BOS>"
    # strftime_now and {% generation %} blocks (used by training-mask templates) work
    assert len(render("{{ strftime_now('%Y-%m-%d') }}")) == 10
    assert render("{% generation %}x{% endgeneration %}") == "x"


def test_raise_exception_and_sandbox_become_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError):
        render("{{ messages.append({'role': 'user'}) }}")      # immutable sandbox
    with pytest.raises(ChatTemplateError):
        render("{{ ''.__class__.__mro__ }}")
    with pytest.raises(ChatTemplateError, match="syntax error"):
        render("{% for %}")


def test_no_template_and_bad_messages_give_clear_errors():
    with pytest.raises(ChatTemplateError, match="no chat template"):
        render_chat(None, CONVERSATIONS[0], SPECIALS)
    with pytest.raises(ChatTemplateError, match="'role' and 'content'"):
        render("x", messages=[{"text": "hi"}])


# ------------------------------------------------------------------ Llama 3 and Qwen2 style templates

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Its name"}},
                   "required": ["city"]}}}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "Use the tools."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None,
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "22 C, sunny"},
    {"role": "user", "content": "Thanks!"},
]
FAMILIES = {"llama3": {"model_type": "llama", "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]},
            "qwen2": {"model_type": "qwen2", "bos_token_id": 151643, "eos_token_id": 151645}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, AutoTokenizer, our tokenizer, template, special tokens) for a test-built Llama 3 or Qwen2 folder."""
    transformers = pytest.importorskip("transformers")
    from tokenizer_samples import write_llama3_tokenizer, write_qwen2_tokenizer

    folder = tmp_path_factory.mktemp(request.param)
    (write_llama3_tokenizer if request.param == "llama3" else write_qwen2_tokenizer)(folder)
    (folder / "config.json").write_text(json.dumps(FAMILIES[request.param]))
    tokenizer, template, specials = converted(folder, FAMILIES[request.param])
    return request.param, transformers.AutoTokenizer.from_pretrained(str(folder)), tokenizer, template, specials


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, TOOLS], ids=["no-tools", "tools"])
def test_family_templates_render_like_transformers(family, add_generation_prompt, tools):
    """Default system messages, a tools section (tojson), tool calls and results, trim, and Llama 3's
    date line: with date_string given, and from strftime_now (today's date in both renderings)."""
    name, reference, _, template, specials = family
    for messages in CONVERSATIONS + [TOOL_CONVERSATION]:
        for extra in ({}, {"date_string": "26 Jul 2024"}):
            expected = reference.apply_chat_template(messages, tools=tools, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt, **extra)
            ours = render_chat(template, messages, specials, add_generation_prompt, tools=tools, **extra)
            assert ours == expected, (name, messages, extra)
    if name == "llama3":
        assert "Today Date: 26 Jul 2024" in render_chat(template, CONVERSATIONS[0], specials, date_string="26 Jul 2024")


def test_family_chat_ids_equal_transformers(family):
    """The Llama 3 template writes <|begin_of_text|> itself and Qwen2 has no BOS: the ids are exactly
    transformers' (which encodes the rendered text without adding special tokens)."""
    name, reference, tokenizer, template, _ = family
    for messages in CONVERSATIONS + [TOOL_CONVERSATION]:
        expected = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
        assert encode_chat(tokenizer, template, messages) == expected, name
    first = encode_chat(tokenizer, template, CONVERSATIONS[0])
    assert (first[0] == 128000 and first.count(128000) == 1) if name == "llama3" else 151644 in first[:1]
