"""Tokenizer, chat template and generation defaults gathered into .tinf metadata.

The tokenizer is embedded so the runtime needs nothing beside the .tinf file: tokenizer.json as
transformers' AutoTokenizer builds it from the checkpoint's files (convert/transformers_tokenizer.py:
for Llama 2 tokenizers that is not the file as written), or the SentencePiece tokenizer.model as
bytes where there is no tokenizer.json.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tinyinfer.convert.errors import ConvertError, brief
from tinyinfer.convert.json_files import parse_json
from tinyinfer.convert.transformers_tokenizer import CLASS_DEFAULTS, tokenizer_class, transformers_tokenizer_json
from tinyinfer.runtime.validate import generation_problems

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")
GENERATION_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "max_new_tokens", "do_sample")
LLAMA2C_BOS, LLAMA2C_EOS = 1, 2


def load_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"cannot read {path} ({brief(e)}); fix or re-download that file.") from e
    value = parse_json(text, path)
    return value if isinstance(value, dict) else {}


def token_ids(value) -> list[int]:
    """An id field that may be missing, one int, or a list of ints."""
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def token_text(value) -> str | None:
    """A special token given as a string or as {"__type": "AddedToken", "content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def chat_template(folder: Path, tokenizer_config: dict) -> str | None:
    """The template from tokenizer_config (a string, or a list of named ones: "default"), else
    chat_template.jinja, else chat_template.json."""
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template
                 if isinstance(t, dict) and isinstance(t.get("name"), str)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = load_json(folder / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) else None


def special_tokens(tokenizer_config: dict, special_map: dict, defaults: dict) -> dict[str, str]:
    """The named special tokens a chat template sees: tokenizer_config.json's, else
    special_tokens_map.json's, else the tokenizer class's defaults (an explicit null stays unset)."""
    tokens = {}
    for key in SPECIAL_TOKENS:
        if key in tokenizer_config:
            text = token_text(tokenizer_config[key])
        else:
            text = token_text(special_map.get(key)) or defaults.get(key)
        if text is not None:
            tokens[key] = text
    return tokens


def hf_tokenizer(folder: Path, hf_config: dict) -> tuple[dict, str | None, dict]:
    """(tokenizer metadata, chat template, generation defaults) for a Hugging Face checkpoint folder."""
    json_path, model_path = folder / "tokenizer.json", folder / "tokenizer.model"
    if not json_path.is_file() and not model_path.is_file():
        raise ConvertError(f"{folder} has neither tokenizer.json nor tokenizer.model; add the model's "
                           f"tokenizer files to the folder.")
    tokenizer_config = load_json(folder / "tokenizer_config.json")
    generation_config = load_json(folder / "generation_config.json")
    eos_ids = token_ids(hf_config.get("eos_token_id")) + token_ids(generation_config.get("eos_token_id"))
    bos_ids = token_ids(hf_config.get("bos_token_id")) or token_ids(generation_config.get("bos_token_id"))
    tokenizer_json, defaults = None, {}
    if json_path.is_file():
        written = json_path.read_text(encoding="utf-8")
        model_type = hf_config.get("model_type")
        tokenizer_json = transformers_tokenizer_json(written, tokenizer_config, model_type)
        defaults = CLASS_DEFAULTS.get(tokenizer_class(model_type, tokenizer_config, written), {})
    tokenizer = {
        "kind": "hf-json" if json_path.is_file() else "sentencepiece",
        "tokenizer_json": tokenizer_json,
        "tokenizer_model": model_path.read_bytes() if model_path.is_file() else None,
        "bos_id": bos_ids[0] if bos_ids else None,
        "eos_ids": sorted(set(eos_ids)),
        "add_bos": adds_bos(tokenizer_config, tokenizer_json),
        "special_tokens": special_tokens(tokenizer_config, load_json(folder / "special_tokens_map.json"), defaults),
    }
    if tokenizer["kind"] == "sentencepiece":
        tokenizer["special_tokens"] = {**sentencepiece_special_tokens(tokenizer["tokenizer_model"]),
                                       **tokenizer["special_tokens"]}
    generation = {k: generation_config[k] for k in GENERATION_KEYS if generation_config.get(k) is not None}
    for key, problem in generation_problems(generation).items():   # transformers warns and ignores them too
        print(f"note: {problem}; it is left out of the file.", file=sys.stderr)
        del generation[key]
    return tokenizer, chat_template(folder, tokenizer_config), generation


def adds_bos(tokenizer_config: dict, tokenizer_json: str | None) -> bool:
    """Whether encoding prepends BOS, as transformers decides: with add_bos_token or add_eos_token in
    tokenizer_config.json, add_bos_token (false when absent); else what the tokenizer's post-processor
    does (default_add_bos)."""
    if "add_bos_token" in tokenizer_config or "add_eos_token" in tokenizer_config:
        return bool(tokenizer_config.get("add_bos_token"))
    return default_add_bos(tokenizer_json)


def default_add_bos(tokenizer_json: str | None) -> bool:
    """What the tokenizer itself does: tokenizer.json's post-processor adds BOS when its single-sequence
    template starts with a special token (Llama does, Qwen-style tokenizers do not); a bare
    sentencepiece model (Llama 1/2, llama2.c) adds it, as Llama's SentencePiece tokenizers always did."""
    if tokenizer_json is None:
        return True
    parsed = parse_json(tokenizer_json, "tokenizer.json")
    processor = (parsed.get("post_processor") if isinstance(parsed, dict) else None) or {}
    if not isinstance(processor, dict):
        return False
    processors = processor.get("processors", [processor]) if processor.get("type") == "Sequence" else [processor]
    for step in processors if isinstance(processors, list) else []:
        if isinstance(step, dict) and step.get("type") == "TemplateProcessing":
            single = step.get("single") or []
            return (isinstance(single, list) and bool(single) and isinstance(single[0], dict)
                    and "SpecialToken" in single[0])
    return False


def sentencepiece_tokenizer(model_path: Path) -> dict:
    """Tokenizer metadata for a llama2.c checkpoint: its sentencepiece model, BOS 1, EOS 2. BOS is also
    an end-of-sequence id: llama2.c's run.c stops when it samples BOS, the delimiter between training stories."""
    try:
        model = model_path.read_bytes()
    except OSError as e:
        raise ConvertError(f"cannot read tokenizer {model_path}: {e.strerror or e}; pass the "
                           f"checkpoint's sentencepiece .model file with --tokenizer.") from e
    return {"kind": "sentencepiece", "tokenizer_json": None, "tokenizer_model": model,
            "bos_id": LLAMA2C_BOS, "eos_ids": [LLAMA2C_BOS, LLAMA2C_EOS], "add_bos": True,
            "special_tokens": sentencepiece_special_tokens(model)}


def load_sentencepiece(model: bytes):
    import sentencepiece
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(model)
    except Exception as e:  # sentencepiece raises RuntimeError/OSError depending on the version
        raise ConvertError(f"the sentencepiece tokenizer model cannot be loaded ({brief(e)}); pass the "
                           f"checkpoint's own tokenizer.model.") from e
    return processor


def sentencepiece_special_tokens(model: bytes) -> dict[str, str]:
    """bos/eos/unk/pad piece strings as the sentencepiece model defines them."""
    processor = load_sentencepiece(model)
    ids = {"bos_token": processor.bos_id(), "eos_token": processor.eos_id(),
           "unk_token": processor.unk_id(), "pad_token": processor.pad_id()}
    return {key: processor.IdToPiece(i) for key, i in ids.items() if 0 <= i < processor.GetPieceSize()}


def tokenizer_vocab_size(tokenizer: dict) -> int:
    """Number of ids the tokenizer can produce (added tokens included)."""
    if tokenizer["kind"] == "hf-json":
        from tokenizers import Tokenizer
        try:
            return Tokenizer.from_str(tokenizer["tokenizer_json"]).get_vocab_size(with_added_tokens=True)
        except BaseException as e:  # plain Exception subclasses, or a Rust panic (a BaseException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            raise ConvertError(f"tokenizer.json cannot be loaded ({brief(e)}); fix or re-download it.") from e
    return load_sentencepiece(tokenizer["tokenizer_model"]).GetPieceSize()


def check_tokenizer(tokenizer: dict, vocab_size: int) -> None:
    """Refuse a tokenizer that can emit ids the model has no embedding for."""
    n_tokens = tokenizer_vocab_size(tokenizer)
    if n_tokens > vocab_size:
        raise ConvertError(f"the tokenizer has {n_tokens} tokens but the model only {vocab_size} "
                           f"embeddings; use the tokenizer that belongs to this checkpoint.")
    ids = [tokenizer["bos_id"]] if tokenizer["bos_id"] is not None else []
    bad = [i for i in ids + tokenizer["eos_ids"] if not 0 <= i < vocab_size]
    if bad:
        raise ConvertError(f"special token id {bad[0]} is outside the model's vocabulary of "
                           f"{vocab_size}; fix bos/eos_token_id in config.json.")

