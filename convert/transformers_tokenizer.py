"""tokenizer.json as transformers' AutoTokenizer builds it from a checkpoint's files.

transformers 5 does not always run tokenizer.json as written: for some tokenizer classes it keeps
the file's vocabulary, merges and post-processor and rebuilds the rest in the class's constructor.
LlamaTokenizer (TinyLlama, Llama 2) replaces the file's Prepend/Replace normalizer with a Metaspace
pre-tokenizer whose dummy prefix follows `legacy` and `add_prefix_space` (with legacy false, only
the start of the text gets one: " leading" no longer encodes a lone "▁" first, and neither does
the text after a special token typed in it); Qwen2Tokenizer and GPT2Tokenizer rebuild their
byte-level pre-tokenizers the same way. Which class runs depends on config.json's model_type and
tokenizer_config.json's tokenizer_class (transformers' AutoTokenizer.from_pretrained; Mistral and
files that declare TokenizersBackend or PreTrainedTokenizerFast run as written).

The converter embeds the tokenizer that class builds, so the runtime only runs a tokenizer.json.
"""

from __future__ import annotations

import json

from tinyinfer.convert.errors import ConvertError, brief
from tinyinfer.formats.errors import shown

# Qwen2Tokenizer's pre-tokenizer split: digits one at a time (Llama 3's takes up to three).
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
AS_WRITTEN = "TokenizersBackend"
REBUILT = ("LlamaTokenizer", "Qwen2Tokenizer", "GPT2Tokenizer")
# The special tokens each class's constructor defaults to when tokenizer_config.json names none.
CLASS_DEFAULTS = {
    "LlamaTokenizer": {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"},
    "Qwen2Tokenizer": {"unk_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    "GPT2Tokenizer": {"unk_token": "<|endoftext|>", "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"},
}
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def tokenizer_class(model_type, tokenizer_config: dict, tokenizer_json: str) -> str:
    """The class AutoTokenizer picks: Qwen2 always gets Qwen2Tokenizer and Mistral the file as written
    (without mistral-common's tekken.json); a declared LlamaTokenizer whose file is byte-level (Llama 3
    style) runs as written too; otherwise the declared class."""
    declared = tokenizer_config.get("tokenizer_class")
    declared = declared.removesuffix("Fast") if isinstance(declared, str) else None
    if model_type == "qwen2":
        return "Qwen2Tokenizer"
    if model_type == "mistral" or declared in (None, "PreTrainedTokenizer", AS_WRITTEN):
        return AS_WRITTEN
    if declared == "LlamaTokenizer" and '"ByteLevel"' in tokenizer_json:
        return AS_WRITTEN
    return declared


def transformers_tokenizer_json(tokenizer_json: str, tokenizer_config: dict, model_type) -> str:
    """The tokenizer.json AutoTokenizer would run for these files (the file itself when its class
    runs it as written, or a class tinyinfer does not rebuild: REBUILT)."""
    cls = tokenizer_class(model_type, tokenizer_config, tokenizer_json)
    if cls not in REBUILT:
        return tokenizer_json
    try:
        original = json.loads(tokenizer_json)
        if original["model"]["type"] != "BPE":
            return tokenizer_json
        tokenizer = rebuild(cls, original, tokenizer_config)
        add_tokens(tokenizer, cls, original, tokenizer_config)
        return tokenizer.to_str()
    except ConvertError:
        raise
    except Exception as e:   # malformed files: KeyError, TypeError, ValueError, or the tokenizers library's own
        raise ConvertError(f"tokenizer.json cannot be rebuilt the way transformers' {cls} builds it ({brief(e)}); "
                           f"fix or re-download tokenizer.json and tokenizer_config.json.") from e


def setting(tokenizer_config: dict, key: str, default: bool) -> bool:
    value = tokenizer_config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConvertError(f"tokenizer_config.json's {key} is {shown(value)}, not true or false; fix that file.")
    return value


def rebuild(cls: str, original: dict, tokenizer_config: dict):
    """The class constructor's tokenizer: the file's vocabulary, merges and post-processor, the
    class's own model options, normalizer, pre-tokenizer and decoder."""
    from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
    from tokenizers.models import BPE

    vocab = original["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in original["model"].get("merges", [])]
    if cls == "LlamaTokenizer":
        prefix = setting(tokenizer_config, "add_prefix_space", True)
        legacy = setting(tokenizer_config, "legacy", False)
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
        tokenizer.normalizer = None
        scheme = ("always" if legacy else "first") if prefix else "never"
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=False)
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    elif cls == "Qwen2Tokenizer":
        prefix = setting(tokenizer_config, "add_prefix_space", False)
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None,
                                  continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                                  byte_fallback=False))
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=prefix, use_regex=False)])
        tokenizer.decoder = decoders.ByteLevel()
    else:   # GPT2Tokenizer
        prefix = setting(tokenizer_config, "add_prefix_space", False)
        tokenizer = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                                  end_of_word_suffix="", fuse_unk=False))
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=prefix)
        tokenizer.decoder = decoders.ByteLevel()
    if original.get("post_processor") is not None:
        carrier = {**empty_tokenizer(), "post_processor": original["post_processor"]}
        tokenizer.post_processor = Tokenizer.from_str(json.dumps(carrier)).post_processor
    return tokenizer


def empty_tokenizer() -> dict:
    """A tokenizer.json with nothing in it, to parse one component of another file through."""
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
            "pre_tokenizer": None, "post_processor": None, "decoder": None,
            "model": {"type": "BPE", "vocab": {}, "merges": []}}


def add_tokens(tokenizer, cls: str, original: dict, tokenizer_config: dict) -> None:
    """The added tokens transformers gives the rebuilt tokenizer, in its order: tokenizer_config.json's
    added_tokens_decoder (else tokenizer.json's added_tokens) by id, then the named special tokens
    (tokenizer_config.json's, else the class's defaults) not among them."""
    from tokenizers import AddedToken

    declared = tokenizer_config.get("added_tokens_decoder")
    if isinstance(declared, dict) and declared:
        entries = sorted(((int(i), token) for i, token in declared.items()), key=lambda item: item[0])
    else:
        entries = sorted(((token["id"], token) for token in original.get("added_tokens") or []),
                         key=lambda item: item[0])
    tokens = [AddedToken(token["content"], **{k: bool(token[k]) for k in TOKEN_FLAGS if k in token})
              for _, token in entries]
    present = {str(t.content) for t in tokens}
    for key in SPECIAL_KEYS:
        value = tokenizer_config.get(key, CLASS_DEFAULTS[cls].get(key))
        content = value.get("content") if isinstance(value, dict) else value
        if not isinstance(content, str) or content in present:
            continue
        flags = {k: bool(value[k]) for k in TOKEN_FLAGS if isinstance(value, dict) and k in value}
        tokens.append(AddedToken(content, **{**flags, "special": True}))
        present.add(content)
    tokenizer.add_tokens(tokens)
