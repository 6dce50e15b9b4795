"""Hugging Face Llama-family checkpoints (Llama, Mistral, Qwen2): config validation and mapping to
the tinf config, and tensor lookup with Q/K/V (and their biases) and gate/up fused per layer.

HF checkpoints already use the rotate-half RoPE row order the runtime expects, so rows are copied
as they are.
"""

from __future__ import annotations

import math
import re
from pathlib import Path, PurePosixPath

import numpy as np

from tinyinfer.convert.errors import ConvertError
from tinyinfer.convert.json_files import parse_json
from tinyinfer.convert.safetensors_io import SafetensorsFile
from tinyinfer.formats.errors import shown
from tinyinfer.formats.tinf import MAX_CONTEXT, MAX_DIM, MAX_TENSORS

# A .tinf file holds at most MAX_TENSORS tensors, seven per layer at most (with Q/K/V biases).
MAX_LAYERS = (MAX_TENSORS - 3) // 7
SUPPORTED = ("supported are Llama 1/2/3.x, TinyLlama, SmolLM2, Mistral (with or without a sliding window) "
             "and Qwen2/Qwen2.5 checkpoints in safetensors")
MODEL_TYPES = ("llama", "mistral", "qwen2")
MISTRAL_DEFAULT_WINDOW = 4096   # transformers' MistralConfig default when config.json has no sliding_window
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Buffers some old checkpoints saved; they are recomputed at run time.
IGNORED_TENSOR = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def read_json(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConvertError(f"cannot read {path} as JSON ({e}); fix or re-download that file.") from e
    value = parse_json(text, path)
    if not isinstance(value, dict):
        raise ConvertError(f"{path} does not hold a JSON object; fix or re-download that file.")
    return value


def read_hf_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not path.is_file():
        raise ConvertError(f"{folder} has no config.json; point SOURCE at a Hugging Face checkpoint "
                           f"folder, a Hub repo id or a llama2.c .bin file.")
    return read_json(path)


def tinf_config(hf: dict) -> dict:
    """Validate an HF config against what the runtime supports and map it to the tinf config."""
    refuse_unsupported(hf)
    dim = required_int(hf, "hidden_size")
    n_heads = required_int(hf, "num_attention_heads")
    n_kv_heads = optional_int(hf, "num_key_value_heads") or n_heads
    head_dim = optional_int(hf, "head_dim") or dim // n_heads
    if not hf.get("head_dim") and dim % n_heads:
        refuse(f"hidden_size {dim} is not a multiple of num_attention_heads {n_heads}")
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        refuse(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv_heads}")
    if head_dim % 2:
        refuse(f"head_dim {head_dim} is odd, which RoPE cannot rotate")
    rope = rope_parameters(hf)
    max_context = required_int(hf, "max_position_embeddings", MAX_CONTEXT)
    return {
        "architecture": "llama",
        "dim": dim,
        "n_layers": required_int(hf, "num_hidden_layers", MAX_LAYERS),
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "ffn_dim": required_int(hf, "intermediate_size"),
        "vocab_size": required_int(hf, "vocab_size"),
        "norm_eps": optional_float(hf, "rms_norm_eps", 1e-6, 1.0),
        "rope_theta": optional_float(rope, "rope_theta", optional_float(hf, "rope_theta", 10000.0)),
        "rope_scaling": rope_scaling(rope),
        "max_context": max_context,
        "tied_embeddings": optional_bool(hf, "tie_word_embeddings"),
        "qkv_bias": hf.get("model_type") == "qwen2",
        "sliding_window": sliding_window(hf, max_context),
    }


def refuse_unsupported(hf: dict) -> None:
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        refuse(f"model_type {shown(model_type)} is not supported")
    if hf.get("quantization_config"):
        refuse("already-quantized checkpoints (quantization_config) are not supported")
    activation = hf.get("hidden_act", hf.get("hidden_activation", "silu"))
    if activation != "silu":
        refuse(f"hidden_act {shown(activation)} is not supported (only silu is)")
    if hf.get("mlp_bias"):
        refuse("mlp_bias=true is not supported (MLP projections without biases only)")
    if hf.get("attention_bias") and model_type != "qwen2":
        refuse("attention_bias=true is not supported for this model type (it also puts a bias on the "
               "output projection; only Qwen2's Q/K/V biases are read)")


def sliding_window(hf: dict, max_context: int) -> int | None:
    """The attention window every layer uses (None: full causal attention), as transformers reads it:
    Mistral's sliding_window (4096 when the key is absent), Qwen2's only with use_sliding_window and
    then for the layers from max_window_layers on (or as layer_types says). A window as long as the
    context changes nothing, so it is dropped."""
    model_type = hf.get("model_type")
    if model_type == "mistral":
        window = hf["sliding_window"] if "sliding_window" in hf else MISTRAL_DEFAULT_WINDOW
    elif model_type == "qwen2" and hf.get("use_sliding_window"):
        window = hf.get("sliding_window", MISTRAL_DEFAULT_WINDOW)
        n_layers = required_int(hf, "num_hidden_layers", MAX_LAYERS)
        first = hf.get("max_window_layers", 28)
        if not isinstance(first, int) or isinstance(first, bool) or first < 0:
            refuse(f"max_window_layers {shown(first)} is not a non-negative integer")
        kinds = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                          for i in range(n_layers)]
        if not isinstance(kinds, list) or not all(isinstance(k, str) for k in kinds):
            refuse(f"layer_types {shown(kinds)} is not a list of strings")
        if window is not None and set(kinds) != {"sliding_attention"}:
            if "sliding_attention" in kinds:
                refuse("some layers use a sliding window and others full attention (layer_types), "
                       "which is not supported")
            window = None
    else:
        return None
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        refuse(f"sliding_window {shown(window)} is not a positive integer")
    return window if window < max_context else None


def rope_parameters(hf: dict) -> dict:
    """RoPE settings: transformers 5 keeps them in `rope_parameters`, older configs use `rope_scaling`."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if not isinstance(params, dict):
        refuse(f"rope scaling {shown(params)} is not a map")
    return params


def rope_scaling(params: dict) -> dict | None:
    """Pass llama3 and linear scaling through with `rope_type` as the key; refuse anything else."""
    kind = params.get("rope_type", params.get("type"))
    if kind in (None, "default"):
        return None
    needed = {"linear": ("factor",),
              "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    if kind not in needed:
        refuse(f"rope scaling type {shown(kind)} is not supported (only linear and llama3 are)")
    missing = [key for key in needed[kind] if not is_positive_number(params.get(key))]
    if missing:
        refuse(f"{kind} rope scaling lacks {', '.join(missing)}")
    scaling = {"rope_type": kind, **{key: float(params[key]) for key in needed[kind]}}
    if kind == "llama3":
        scaling["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    return scaling


def required_int(hf: dict, key: str, high: int = MAX_DIM - 1) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= high:
        refuse(f"config.json lacks a positive integer {key} (at most {high}), it has {shown(value)}")
    return value


def optional_int(hf: dict, key: str) -> int | None:
    """A positive integer, or None where the key is absent or null."""
    return None if hf.get(key) is None else required_int(hf, key)


def is_positive_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 < value < 1e30


def optional_float(hf: dict, key: str, default: float, high: float = 1e30) -> float:
    value = hf.get(key)
    if value is None:
        return default
    if not is_positive_number(value) or value >= high:
        refuse(f"config.json's {key} is {shown(value)}, not a positive number below {high:g}")
    return float(value)


def optional_bool(hf: dict, key: str) -> bool:
    value = hf.get(key, False)
    if not isinstance(value, bool):
        refuse(f"config.json's {key} is {shown(value)}, not true or false")
    return value


def refuse(problem: str):
    raise ConvertError(f"this checkpoint cannot be converted because {problem}; {SUPPORTED}.")


def source_names(config: dict) -> dict[str, list[str]]:
    """tinf tensor name -> the HF tensors concatenated (by rows) to make it."""
    names = {"tok_embeddings": ["model.embed_tokens.weight"]}
    for i in range(config["n_layers"]):
        p = f"model.layers.{i}."
        names[f"layers.{i}.attn_norm"] = [p + "input_layernorm.weight"]
        names[f"layers.{i}.wqkv"] = [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        if config["qkv_bias"]:
            names[f"layers.{i}.bqkv"] = [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        names[f"layers.{i}.wo"] = [p + "self_attn.o_proj.weight"]
        names[f"layers.{i}.ffn_norm"] = [p + "post_attention_layernorm.weight"]
        names[f"layers.{i}.w_gate_up"] = [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]
        names[f"layers.{i}.w_down"] = [p + "mlp.down_proj.weight"]
    names["norm"] = ["model.norm.weight"]
    tied = config["tied_embeddings"]
    names["output"] = ["model.embed_tokens.weight" if tied else "lm_head.weight"]
    return names


def source_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Expected shape of every HF tensor the conversion reads."""
    dim, hd, ffn = config["dim"], config["head_dim"], config["ffn_dim"]
    q_rows, kv_rows = config["n_heads"] * hd, config["n_kv_heads"] * hd
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], dim), "model.norm.weight": (dim,)}
    if not config["tied_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], dim)
    for i in range(config["n_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (dim,),
            p + "post_attention_layernorm.weight": (dim,),
            p + "self_attn.q_proj.weight": (q_rows, dim),
            p + "self_attn.k_proj.weight": (kv_rows, dim),
            p + "self_attn.v_proj.weight": (kv_rows, dim),
            p + "self_attn.o_proj.weight": (dim, q_rows),
            p + "mlp.gate_proj.weight": (ffn, dim),
            p + "mlp.up_proj.weight": (ffn, dim),
            p + "mlp.down_proj.weight": (dim, ffn),
        })
        if config["qkv_bias"]:
            shapes.update({p + "self_attn.q_proj.bias": (q_rows,), p + "self_attn.k_proj.bias": (kv_rows,),
                           p + "self_attn.v_proj.bias": (kv_rows,)})
    return shapes


def open_shards(folder: Path) -> dict[str, SafetensorsFile]:
    """tensor name -> the shard holding it; reads the index first when there is one."""
    index_path = folder / INDEX_FILE
    if index_path.is_file():
        return shards_from_index(folder, index_path)
    single = folder / SINGLE_FILE
    if not single.is_file():
        raise ConvertError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors "
                           f"checkpoints can be converted (re-save .bin/.pt weights with safetensors).")
    shard = SafetensorsFile(single)
    return {name: shard for name in shard.names}


def index_weight_map(folder: Path) -> dict[str, str]:
    """The index's tensor -> shard file map, with every shard name checked to stay inside `folder` by
    name: no absolute path, no '..' component. Where a name's file resolves to is not checked: in the
    Hub cache every shard is a link into ../../blobs/."""
    index_path = folder / INDEX_FILE
    weight_map = read_json(index_path).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConvertError(f"{index_path} has no weight_map of tensor name to file; re-download it.")
    for filename in set(weight_map.values()):
        name = PurePosixPath(filename.replace("\\", "/"))
        if not name.parts or name.is_absolute() or ".." in name.parts or not filename.endswith(".safetensors"):
            raise ConvertError(f"{index_path} names shard {shown(filename)}, which is not a .safetensors "
                               f"file inside {folder}; fix the index.")
    return weight_map


def shards_from_index(folder: Path, index_path: Path) -> dict[str, SafetensorsFile]:
    weight_map = index_weight_map(folder)
    for filename in sorted(set(weight_map.values())):
        if not (folder / filename).is_file():
            raise ConvertError(f"shard {filename} named in {index_path} is missing; download the "
                               f"complete checkpoint.")
    opened = {filename: SafetensorsFile(folder / filename) for filename in set(weight_map.values())}
    for name, filename in weight_map.items():
        if name not in opened[filename].entries:
            raise ConvertError(f"{index_path} puts tensor {shown(name)} in {shown(filename)}, which does not "
                               f"contain it; re-download the checkpoint.")
    return {name: opened[filename] for name, filename in weight_map.items()}


class HfCheckpoint:
    """A validated HF checkpoint folder; `load(tinf_name)` returns one fused float32 tensor."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.hf_config = read_hf_config(folder)
        self.config = tinf_config(self.hf_config)
        self.shards = open_shards(folder)
        self.sources = source_names(self.config)
        self.check_tensors()

    def check_tensors(self) -> None:
        """Every needed tensor present with its expected shape and a float dtype; nothing unexpected."""
        expected = source_shapes(self.config)
        for name, shape in expected.items():
            if name not in self.shards:
                refuse(f"tensor {name} is missing")
            found = self.shards[name].shape(name)
            if found != shape:
                refuse(f"tensor {name} has shape {list(found)} where the config implies {list(shape)}")
            dtype = self.shards[name].dtype(name)
            if dtype not in ("F32", "F16", "BF16"):
                refuse(f"tensor {name} is stored as {dtype} (only F32, F16 and BF16 are read)")
        tolerated = {"lm_head.weight"} if self.config["tied_embeddings"] else set()
        for name in self.shards:
            if name not in expected and name not in tolerated and not IGNORED_TENSOR.fullmatch(name):
                what = "bias tensors" if name.endswith(".bias") else "extra tensors"
                refuse(f"it has {what} such as {name}")

    def load(self, tinf_name: str) -> np.ndarray:
        """One tinf tensor; fused parts are read straight into their row block (no extra copy)."""
        names = self.sources[tinf_name]
        shapes = [self.shards[name].shape(name) for name in names]
        fused = np.empty((sum(s[0] for s in shapes), *shapes[0][1:]), np.float32)
        row = 0
        for name, shape in zip(names, shapes):
            self.shards[name].read(name, out=fused[row : row + shape[0]])
            row += shape[0]
        return fused


def readme_license(folder: Path) -> str | None:
    """The `license:` value of a model card's YAML front matter, if there is one."""
    readme = folder / "README.md"
    if not readme.is_file():
        return None
    lines = readme.read_text(encoding="utf-8", errors="replace").splitlines()
    if not lines or lines[0].strip() != "---":
        return None
    for line in lines[1:]:
        if line.strip() == "---":
            break
        key, _, value = line.partition(":")
        if key.strip() == "license" and value.strip():
            return value.strip().strip("'\"")
    return None
