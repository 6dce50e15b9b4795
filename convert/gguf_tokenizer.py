"""The tokenizer a GGUF file describes in its metadata, rebuilt as a file the runtime already runs.

- `gpt2` (byte-level BPE: tokens, merges) becomes a tokenizer.json built with the `tokenizers`
  library. Its pre-tokenizer follows `tokenizer.ggml.pre`, which names the regex the merges were
  learned with, as llama.cpp splits text for that value.
- `llama` (SentencePiece: tokens, scores, token types) becomes a SentencePiece model (a ModelProto
  built with sentencepiece's own protobuf schema), so text is encoded by SentencePiece itself: the
  algorithm llama.cpp reimplements and the one the vocabulary was trained with.
Token ids (bos, eos, eot, ...) are checked against the model's vocabulary.
"""

from __future__ import annotations

from pathlib import Path

from tinyinfer.convert.errors import ConvertError, brief
from tinyinfer.convert.gguf_file import FLOAT_TYPES, INTEGER_TYPES, STRING, Metadata, refuse
from tinyinfer.convert.tokenizer_files import check_tokenizer
from tinyinfer.formats.errors import shown

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
GPT2_SPLIT = None   # ByteLevel's own regex: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (split before the byte-level step, digits split one by one first, ignore_merges)
PRE_TOKENIZERS = {
    **{name: (GPT2_SPLIT, False, False) for name in ("default", "gpt2", "gpt-2", "mpt", "olmo", "jais")},
    **{name: (GPT2_SPLIT, True, False) for name in ("smollm", "starcoder", "refact", "command-r", "codeshell")},
    **{name: (LLAMA3_SPLIT, False, True) for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx",
                                                      "falcon3")},
    **{name: (QWEN2_SPLIT, False, False) for name in ("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez")},
}
EOS_KEYS = ("eos_token_id", "eot_token_id", "eom_token_id")
SPECIAL_KEYS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                "pad_token": "padding_token_id"}


def gguf_tokenizer(meta: Metadata, vocab_size: int, path: Path) -> tuple[dict, str | None]:
    """(tokenizer metadata for the .tinf file, chat template) from the tokenizer.* keys."""
    model = meta.str("tokenizer.ggml.model")
    tokens = meta.array("tokenizer.ggml.tokens", {STRING}, "strings")
    if not tokens:
        raise refuse(path, "it has no tokenizer.ggml.tokens vocabulary")
    if len(tokens) > vocab_size:
        raise ConvertError(f"{path} lists {len(tokens)} tokens but its embedding has only {vocab_size} rows; "
                           f"the file is inconsistent, re-download it.")
    types = meta.array("tokenizer.ggml.token_type", INTEGER_TYPES, "integers") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise refuse(path, f"it has {len(types)} token types for {len(tokens)} tokens")
    ids = {key: token_id(meta, key, len(tokens), path) for key in ("bos_token_id", "unknown_token_id",
                                                                   "padding_token_id", *EOS_KEYS)}
    if model == "gpt2":
        pre = meta.str("tokenizer.ggml.pre", "default")
        tokenizer = {"kind": "hf-json", "tokenizer_json": byte_level_json(meta, tokens, types, pre, path),
                     "tokenizer_model": None}
        default_bos = PRE_TOKENIZERS.get(pre, (None, False, False))[2]   # llama.cpp adds BOS for Llama 3
    elif model == "llama":
        scores = meta.array("tokenizer.ggml.scores", FLOAT_TYPES, "numbers") or [0.0] * len(tokens)
        if len(scores) != len(tokens):
            raise refuse(path, f"it has {len(scores)} token scores for {len(tokens)} tokens")
        add_space = meta.bool("tokenizer.ggml.add_space_prefix", True)
        tokenizer = {"kind": "sentencepiece", "tokenizer_json": None,
                     "tokenizer_model": sentencepiece_model(tokens, scores, types, ids, add_space, path)}
        default_bos = True
    else:
        raise ConvertError(f"{path} has a {shown(model)} tokenizer; supported are gpt2 (byte-level BPE) and llama "
                           f"(SentencePiece) vocabularies.")
    tokenizer.update({
        "bos_id": ids["bos_token_id"],
        "eos_ids": sorted({ids[key] for key in EOS_KEYS if ids[key] is not None}),
        "add_bos": meta.bool("tokenizer.ggml.add_bos_token", default_bos) and ids["bos_token_id"] is not None,
        "special_tokens": {name: tokens[ids[key]] for name, key in SPECIAL_KEYS.items() if ids[key] is not None},
    })
    check_tokenizer(tokenizer, vocab_size)
    return tokenizer, meta.str("tokenizer.chat_template")


def token_id(meta: Metadata, key: str, n_tokens: int, path: Path) -> int | None:
    value = meta.int(f"tokenizer.ggml.{key}", None, low=-(2**31), high=2**32 - 1)
    if value is None or value in (-1, 2**32 - 1):
        return None    # llama.cpp writes -1 (or its uint32 form) for "none"
    if not 0 <= value < n_tokens:
        raise ConvertError(f"{path} sets tokenizer.ggml.{key} to {value}, outside its vocabulary of "
                           f"{n_tokens} tokens; the file is corrupt, re-download it.")
    return value


# ---------------------------------------------------------------------------- gpt2: byte-level BPE


def byte_level_json(meta: Metadata, tokens: list[str], types: list[int], pre: str, path: Path) -> str:
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    if pre not in PRE_TOKENIZERS:
        raise ConvertError(f"{path} names the pre-tokenizer {shown(pre)}, which this converter does not know; "
                           f"known are {', '.join(sorted(PRE_TOKENIZERS))}.")
    split, digits, ignore_merges = PRE_TOKENIZERS[pre]
    merges = meta.array("tokenizer.ggml.merges", {STRING}, "strings")
    if not merges:
        raise refuse(path, "its gpt2 vocabulary has no tokenizer.ggml.merges")
    pairs = [tuple(m.split(" ")) for m in merges]
    if any(len(p) != 2 for p in pairs):
        raise refuse(path, "a tokenizer.ggml.merges entry is not two tokens separated by one space")
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {}
    for i, token in enumerate(tokens):
        # Byte-level tokens are spelled in GPT-2's printable byte alphabet; respell any that is not.
        spelled = token if set(token) <= alphabet else "".join(p for p, _ in spell.pre_tokenize_str(token))
        vocab.setdefault(spelled, i)
    try:
        tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges))
    except Exception as e:   # tokenizers raises plain Exception for a merge naming an unknown token
        raise refuse(path, f"its BPE vocabulary cannot be built ({brief(e)})") from e
    steps = [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated")] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tokenizer.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, <|endoftext|>) match whole in text as special tokens, user-defined
    # ones (<think>) as plain added tokens, as llama.cpp and transformers treat them.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, types) if kind == CONTROL and set(t) <= alphabet])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, kind in zip(tokens, types) if kind == USER_DEFINED and t in vocab])
    return tokenizer.to_str()


# ---------------------------------------------------------------------------- llama: SentencePiece


def sentencepiece_model(tokens, scores, types, ids, add_space: bool, path: Path) -> bytes:
    """A serialized SentencePiece ModelProto (BPE) holding exactly the file's vocabulary."""
    try:
        from sentencepiece import sentencepiece_model_pb2 as pb
    except Exception as e:   # ImportError, or protobuf's runtime version check
        raise ConvertError(f"building a SentencePiece model needs protobuf matching sentencepiece "
                           f"({brief(e)}); run `pip install -U protobuf sentencepiece`.") from e
    proto = pb.ModelProto()
    for token, score, kind in zip(tokens, scores, types):
        piece = proto.pieces.add()
        piece.piece, piece.score = token, float(score)
        piece.type = kind if kind in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
    unknown = [i for i, kind in enumerate(types) if kind == UNKNOWN]
    if len(unknown) != 1:
        raise refuse(path, f"its SentencePiece vocabulary has {len(unknown)} unknown tokens instead of one")
    spec = proto.trainer_spec
    spec.model_type = pb.TrainerSpec.BPE
    spec.vocab_size = len(tokens)
    spec.byte_fallback = BYTE in types
    spec.unk_id = unknown[0]
    spec.bos_id = control_or_none(ids["bos_token_id"], types)
    spec.eos_id = control_or_none(ids["eos_token_id"], types)
    spec.pad_id = control_or_none(ids["padding_token_id"], types)
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = add_space
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    return proto.SerializeToString()


def control_or_none(token: int | None, types: list[int]) -> int:
    """SentencePiece requires its bos/eos/pad ids to be control pieces; -1 leaves one undefined."""
    return token if token is not None and types[token] == CONTROL else -1
