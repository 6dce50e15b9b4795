"""Checks of a .tinf file's metadata before the runtime uses any of it: the config, the tokenizer map,
the generation defaults, and the token ids that reach a backend.

The file is untrusted input (models are shared on the Hub), so every value is checked for type and
range here, once, and every failure is a FormatError of one bounded sentence. Bounds come from what
the file itself holds (a layer count the tensor directory cannot back is refused before any per-layer
table is built) or from the format (formats.tinf.MAX_CONTEXT); memory is checked by the backends'
plans before they allocate.
"""

from __future__ import annotations

import math

import numpy as np

from tinyinfer.formats import FormatError
from tinyinfer.formats.errors import shown
from tinyinfer.formats.tinf import MAX_CONTEXT, MAX_DIM
from tinyinfer.runtime.errors import TokenIdError

DIMENSIONS = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "max_context")
TENSORS_PER_LAYER = 6          # attn_norm, wqkv, wo, ffn_norm, w_gate_up, w_down (+ bqkv with biases)
GLOBAL_TENSORS = 3             # tok_embeddings, norm, output
ROPE_SCALING_KEYS = {"linear": ("factor",),
                     "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
MAX_TOKENIZER_BYTES = 64 << 20  # the whole metadata block is bounded by this already
MAX_SPECIAL_TOKENS = 1000


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def refuse(path, problem: str):
    raise FormatError(f"{path}: {problem}; convert the model again with this tinyinfer.")


# ------------------------------------------------------------------------------------------ config


def check_config(config: dict, path, n_tensors: int) -> None:
    """Types and ranges of every config value the runtime reads; n_tensors bounds the layer count."""
    if config.get("architecture") != "llama":
        refuse(path, f"the architecture {shown(config.get('architecture'))} is not supported (only llama)")
    for key in DIMENSIONS:
        value = config.get(key)
        if not is_int(value) or not 1 <= value < MAX_DIM:
            refuse(path, f"config {key} is {shown(value)}, not a positive integer below 2^31")
    if config["n_layers"] > (n_tensors - GLOBAL_TENSORS) // TENSORS_PER_LAYER:
        refuse(path, f"config n_layers is {config['n_layers']} but the file holds only {n_tensors} tensors")
    if config["max_context"] > MAX_CONTEXT:
        refuse(path, f"config max_context {config['max_context']} exceeds the {MAX_CONTEXT} positions supported")
    if config["n_heads"] % config["n_kv_heads"] or config["head_dim"] % 2:
        refuse(path, "n_heads must be a multiple of n_kv_heads and head_dim even")
    for key, low, high in (("norm_eps", 0.0, 1.0), ("rope_theta", 0.0, 1e30)):
        value = config.get(key)
        if not is_number(value) or not low < value < high:
            refuse(path, f"config {key} is {shown(value)}, not a number in ({low:g}, {high:g})")
    check_rope_scaling(config.get("rope_scaling"), path)
    window = config.get("sliding_window")
    if not isinstance(config.get("qkv_bias", False), bool) or not (
            window is None or (is_int(window) and 1 <= window < MAX_DIM)):
        refuse(path, "qkv_bias must be a bool and sliding_window nil or a positive integer below 2^31")
    if not isinstance(config.get("tied_embeddings", False), bool):
        refuse(path, "tied_embeddings must be a bool")


def check_rope_scaling(scaling, path) -> None:
    if scaling is None:
        return
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    if kind not in ROPE_SCALING_KEYS:
        refuse(path, f"rope_scaling {shown(scaling)} is not nil or linear/llama3 scaling")
    for key in ROPE_SCALING_KEYS[kind]:
        if not is_number(scaling.get(key)) or not 0 < scaling[key] < 1e30:
            refuse(path, f"rope_scaling {key} is {shown(scaling.get(key))}, not a positive number")
    if kind == "llama3" and scaling["low_freq_factor"] == scaling["high_freq_factor"]:
        refuse(path, "rope_scaling low_freq_factor equals high_freq_factor")


# ------------------------------------------------------------------------------------------ tokenizer


def check_tokenizer_meta(meta, path, vocab_size: int) -> None:
    """The tokenizer map's fields have the types Tokenizer.from_metadata expects, and every id it names
    has an embedding row."""
    if not isinstance(meta, dict):
        refuse(path, "the tokenizer metadata is not a map")
    kind = meta.get("kind")
    field, field_type = {"hf-json": ("tokenizer_json", str), "sentencepiece": ("tokenizer_model", bytes)}.get(
        kind if isinstance(kind, str) else None, (None, None))
    if field is None or not isinstance(meta.get(field), field_type) or not meta[field]:
        raise FormatError(f"{path}: the model's tokenizer (kind {shown(kind)}) is missing or unsupported; "
                          "re-convert the checkpoint with a tokenizer.json or tokenizer.model.")
    for key in ("bos_id", "pad_id"):
        value = meta.get(key)
        if value is not None and not (is_int(value) and 0 <= value < vocab_size):
            refuse(path, f"tokenizer {key} {shown(value)} is not an id below the vocabulary size {vocab_size}")
    eos = meta.get("eos_ids", [])
    if eos is None:
        eos = []
    if not isinstance(eos, list) or len(eos) > MAX_SPECIAL_TOKENS or not all(
            is_int(i) and 0 <= i < vocab_size for i in eos):
        refuse(path, f"tokenizer eos_ids {shown(eos)} is not a list of ids below the vocabulary size {vocab_size}")
    if not isinstance(meta.get("add_bos", False), bool):
        refuse(path, f"tokenizer add_bos {shown(meta.get('add_bos'))} is not a bool")
    special = meta.get("special_tokens")
    if special is not None and (not isinstance(special, dict) or len(special) > MAX_SPECIAL_TOKENS or not all(
            isinstance(k, str) and isinstance(v, str) and len(v) <= 1024 for k, v in special.items())):
        refuse(path, f"tokenizer special_tokens {shown(special)} is not a map of names to strings")


def check_tokenizer_vocab(tokenizer, path, vocab_size: int) -> None:
    """A tokenizer that can emit an id the embedding has no row for is refused at load."""
    if tokenizer.max_id >= vocab_size:
        refuse(path, f"the tokenizer has ids up to {tokenizer.max_id} but the model only {vocab_size} embedding "
                     "rows")


# ------------------------------------------------------------------------------------------ generation

GENERATION_CHECKS = {
    "temperature": (is_number, lambda v: v >= 0, "a number >= 0"),
    "top_k": (is_int, lambda v: v >= 0, "an integer >= 0"),
    "top_p": (is_number, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (is_number, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (is_number, lambda v: v > 0, "a number > 0"),
    "max_new_tokens": (is_int, lambda v: v >= 0, "an integer >= 0"),
    "do_sample": (lambda v: isinstance(v, bool), lambda v: True, "a bool"),
}


def generation_problems(generation: dict) -> dict[str, str]:
    """{key: phrase} for each generation default of the wrong type or range (None values are unset)."""
    problems = {}
    for key, value in generation.items():
        check = GENERATION_CHECKS.get(key)
        if value is None or check is None:
            continue
        of_type, in_range, what = check
        if not of_type(value) or not in_range(value):
            problems[key] = f"generation {key} is {shown(value)}, not {what}"
    return problems


def check_generation(generation, path) -> None:
    if generation is None:
        return
    if not isinstance(generation, dict):
        refuse(path, "the generation defaults are not a map")
    problems = generation_problems(generation)
    if problems:
        refuse(path, next(iter(problems.values())))


# ------------------------------------------------------------------------------------------ token ids


def check_token_ids(ids, vocab_size: int) -> None:
    """Every id that reaches a backend indexes the embedding: out of range it would read another row
    (NumPy wraps -1) or out of bounds (the GPU gather)."""
    ids = np.asarray(ids)
    if ids.size == 0:
        raise TokenIdError("token_ids is empty; pass at least one token id.")
    if not np.issubdtype(ids.dtype, np.integer):
        raise TokenIdError("token ids must be integers; pass ids the model's tokenizer produces.")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise TokenIdError(f"token id {low if low < 0 else high} is outside the vocabulary [0, {vocab_size}); "
                           "pass ids the model's tokenizer produces.")
