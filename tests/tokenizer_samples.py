"""Byte-level BPE tokenizers with the structure of Llama 3's and Qwen2's, built by the tests.

Neither real tokenizer is in the shared assets (nor may one of unclear licence be committed), so
these are trained here with the `tokenizers` library on a little text and padded to the real
vocabulary sizes, with the real pre-tokenizer patterns, normalizers, post-processors and special
tokens at their real ids:
- Llama 3: 128,000 BPE entries (merges ignored for whole words in the vocabulary, as Llama 3's
  model sets), the tiktoken-style split (digits in runs of up to three), then 256 special tokens
  from 128000: <|begin_of_text|>, <|end_of_text|>, <|start_header_id|>, <|end_header_id|>,
  <|eom_id|>, <|eot_id|> ... at Llama 3.1's ids; BOS added by the post-processor.
- Qwen2: NFC, the split with single digits, 151,643 BPE entries, then <|endoftext|> 151643,
  <|im_start|> 151644, <|im_end|> 151645 and 19 more to 151664; no BOS. The model's embedding has
  151,936 rows, more than the tokenizer's ids (a padded vocabulary).
The padding entries contain U+2400, which no byte-level pre-token can hold, so they are never produced.
The chat templates are written here with the structure of the real ones (Llama 3.x's date line
from strftime_now, Qwen2.5's default system message and tools section).
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path

SHARED_TEXT = Path(os.environ.get("TINYINFER_SHARED", Path(__file__).resolve().parents[2] / "shared")) / "assets" / "text"
LLAMA3_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                  r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
LLAMA3_BASE, LLAMA3_VOCAB = 128000, 128256
QWEN2_BASE, QWEN2_EMBEDDINGS = 151643, 151936
LLAMA3_NAMED = {128000: "<|begin_of_text|>", 128001: "<|end_of_text|>", 128004: "<|finetune_right_pad_id|>",
                128006: "<|start_header_id|>", 128007: "<|end_header_id|>", 128008: "<|eom_id|>",
                128009: "<|eot_id|>", 128010: "<|python_tag|>"}
QWEN2_ADDED = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
               "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
               "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>",
               "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
QWEN2_NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>",
                     "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
BUILTIN_TEXT = """Once upon a time, in 1987, there was a little girl named Lily. She didn't like the rain;
she'd rather play outside in the park with her dog, who was 12 years old. "Look!" she said. "It's 3:45 pm."
The café on the corner sold naïve crêpes for €4.50 — or 5,000 yen (日本円) — every Tuesday.
def main(argv=None) -> int:\n    return 0\n\n\tTabs, newlines\n\nand   spaces   everywhere.
"""

LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}
    {%- if strftime_now is defined %}
        {%- set date_string = strftime_now("%d %b %Y") %}
    {%- else %}
        {%- set date_string = "1 Jan 2025" %}
    {%- endif %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\\n" }}
{%- endif %}
{{- "Today Date: " + date_string + "\\n\\n" }}
{%- if tools is not none %}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- for message in messages %}
    {%- if message.role == 'tool' or message.role == 'ipython' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls | length == 1 %}
            {{- raise_exception("Only one tool call at a time is supported.") }}
        {%- endif %}
        {%- set call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + call.name + '", "parameters": ' }}
        {{- call.arguments | tojson }}
        {{- "}<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN2_STYLE_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nFunction signatures within <tools></tools>:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def training_text() -> list[str]:
    """Real English text where the shared assets are present, else a few built-in lines."""
    lines = BUILTIN_TEXT.splitlines()
    wiki = SHARED_TEXT / "wikitext-2-raw-wiki.test.raw"
    if wiki.is_file():
        lines += [line for line in wiki.read_text(encoding="utf-8").replace("\r\n", "\n").split("\n")
                  if line.strip()][:3000]
    return lines


def byte_level_bpe(pattern: str, n_entries: int, nfc: bool, ignore_merges: bool, merges: int = 3000) -> dict:
    """tokenizer.json (as a dict) of a byte-level BPE split by `pattern`, padded to n_entries entries."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if nfc:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=256 + merges, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(training_text(), trainer)
    spec = json.loads(tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), n_entries):
        vocab[f"\u2400{i}"] = i
    spec["model"]["ignore_merges"] = ignore_merges
    return spec


@lru_cache(maxsize=None)
def llama3_tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer

    spec = byte_level_bpe(LLAMA3_PATTERN, LLAMA3_BASE, nfc=False, ignore_merges=True)
    spec["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000],
                                                  "tokens": ["<|begin_of_text|>"]}}}]}
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.add_special_tokens([AddedToken(content, special=True) for content in llama3_specials().values()])
    return tokenizer.to_str()


def llama3_specials() -> dict[int, str]:
    reserved = iter(range(1000))
    return {i: LLAMA3_NAMED.get(i) or f"<|reserved_special_token_{next(reserved)}|>"
            for i in range(LLAMA3_BASE, LLAMA3_VOCAB)}


@lru_cache(maxsize=None)
def qwen2_tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer

    spec = byte_level_bpe(QWEN2_PATTERN, QWEN2_BASE, nfc=True, ignore_merges=False)
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": False}
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    tokenizer.add_tokens([AddedToken(content, special=content not in QWEN2_NOT_SPECIAL, normalized=False)
                          for content in QWEN2_ADDED])
    return tokenizer.to_str()


def added_tokens_decoder(tokenizer_json: str) -> dict:
    """tokenizer_config.json's added_tokens_decoder for a tokenizer.json's added tokens."""
    return {str(t["id"]): {k: t[k] for k in ("content", "lstrip", "normalized", "rstrip", "single_word", "special")}
            for t in json.loads(tokenizer_json)["added_tokens"]}


def write_llama3_tokenizer(folder, tokenizer_class: str = "PreTrainedTokenizerFast") -> Path:
    """tokenizer.json and tokenizer_config.json as a Llama 3.x Instruct repo has them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = llama3_tokenizer_json()
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    config = {"added_tokens_decoder": added_tokens_decoder(text), "bos_token": "<|begin_of_text|>",
              "chat_template": LLAMA3_STYLE_TEMPLATE, "clean_up_tokenization_spaces": True,
              "eos_token": "<|eot_id|>", "model_input_names": ["input_ids", "attention_mask"],
              "model_max_length": 131072, "tokenizer_class": tokenizer_class}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder


def write_qwen2_tokenizer(folder) -> Path:
    """tokenizer.json and tokenizer_config.json as a Qwen2.5 Instruct repo has them."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = qwen2_tokenizer_json()
    (folder / "tokenizer.json").write_text(text, encoding="utf-8")
    config = {"add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added_tokens_decoder(text),
              "additional_special_tokens": [t for t in QWEN2_ADDED[1:14]], "bos_token": None,
              "chat_template": QWEN2_STYLE_TEMPLATE, "clean_up_tokenization_spaces": False,
              "eos_token": "<|im_end|>", "errors": "replace", "model_max_length": 131072,
              "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
              "unk_token": None}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return folder
