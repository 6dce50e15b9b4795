"""The conversion driver: resolve the source, validate everything, then stream tensors into a .tinf.

Nothing is written until the config, tensors and tokenizer have been checked; the writer puts the
file in place only once every tensor is in it. Tensors are read, fused, encoded and written one at
a time, so memory stays around the size of the largest fused matrix.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tinyinfer.convert import hub
from tinyinfer.convert.errors import ConvertError, brief
from tinyinfer.convert.gguf_checkpoint import GgufCheckpoint, open_gguf
from tinyinfer.convert.hf import HfCheckpoint, read_hf_config, readme_license, tinf_config
from tinyinfer.convert.llama2c import Llama2cCheckpoint
from tinyinfer.convert.tokenizer_files import check_tokenizer, hf_tokenizer, sentencepiece_tokenizer
from tinyinfer.formats import TensorSpec, TinfWriter, encode, open_tinf
from tinyinfer.formats.stats import file_weight_stats
from tinyinfer.formats.tinf import is_tinf_file
from tinyinfer.formats.version import tinyinfer_version

QUANTS = ("q4", "q8", "f16")
GROUP_SIZES = (32, 64, 128)
DEFAULT_QUANT = "q4"
# Columns per scale by default: q4 at 32 (4.5 bits per weight; 64 measured clearly worse on trained
# models: BENCHMARKS.md, "Quality"), q8 at 64 (within 0.1% of f16 already). GGUF input takes 32, the
# group of GGML's Q8_0/Q4_0 blocks, which then copy exactly.
DEFAULT_GROUP = {"q4": 32, "q8": 64, "f16": 64}
GGUF_GROUP = 32
HEADS = (None, "f16")
F16_MAX = 65504.0
# How far beyond fp16 a quantized weight may go: its group's scale is an fp16 value times at most this
# (q4's signed scales put the largest weight at level -8).
QMAX = {"q4": 8, "q8": 127}


@dataclass
class Source:
    """A validated checkpoint plus everything that goes into the metadata beside the tensors."""

    checkpoint: HfCheckpoint | Llama2cCheckpoint | GgufCheckpoint
    tokenizer: dict
    chat_template: str | None = None
    generation: dict = field(default_factory=dict)
    license: str | None = None
    revision: str | None = None


def convert_checkpoint(source, out=None, quant=None, group_size=None, head=None, scale_search=True,
                       revision=None, token=None, tokenizer=None, progress=True, file=None,
                       calibrate=True, force=False) -> Path:
    """Convert a Hub repo id (with `file`: one .gguf file of it), a local HF folder, a .gguf file or a
    llama2.c .bin to a .tinf file; returns its path. quant/group_size None: q4 with its default group
    (DEFAULT_GROUP), and for GGUF input each matrix keeps the file's own encoding where tinyinfer holds
    it exactly. calibrate: weigh q4's scale search by activation statistics (convert.calibration).
    An existing .tinf at `out` is replaced; any other existing file only with force; an input never."""
    started = time.perf_counter()
    check_options(quant, group_size, head)
    if out is not None and Path(out).is_dir():
        raise ConvertError(f"output {out} is a folder; pass a file name such as {Path(out) / 'model.tinf'}.")
    model = open_source(str(source), revision, token, tokenizer, progress, file)
    specs, group_size = encoding_plan(model.checkpoint, quant, group_size, head)
    quant, group_size = layer_encoding(specs, group_size)
    out = Path(out) if out is not None else default_output(Path(file).stem if file else source, quant)
    check_output(out, input_paths(model, tokenizer), force)
    importance, calibration_tokens = {}, 0
    if calibrate and scale_search and any(spec.encoding == "q4" for spec in specs):
        importance, calibration_tokens = calibrate_inputs(model, progress)
    metadata = build_metadata(model, str(source) + (f"/{file}" if file else ""), quant, group_size, scale_search,
                              calibration_tokens)
    try:
        with terminate_as_exit():
            write_tensors(out, metadata, specs, model.checkpoint, scale_search, progress, importance)
    except OSError as e:
        raise ConvertError(f"cannot write {out} ({e.strerror or brief(e)}); check that its folder exists and is "
                           f"writable and that the disk has room.") from None
    if progress:
        print(summary(out, time.perf_counter() - started), file=sys.stderr)
    return out


def check_options(quant, group_size, head) -> None:
    if quant is not None and quant not in QUANTS:
        raise ConvertError(f"unknown quantization {quant!r}; choose one of {', '.join(QUANTS)}.")
    if group_size is not None and group_size not in GROUP_SIZES:
        raise ConvertError(f"group size {group_size} is not supported; choose 32, 64 or 128.")
    if head not in HEADS:
        raise ConvertError(f"unknown head encoding {head!r}; leave it out or pass f16.")


def default_output(source, quant: str) -> Path:
    """<source name>-<quant>.tinf in the current folder."""
    path = Path(source)
    name = path.resolve().name if path.exists() else str(source).rstrip("/").split("/")[-1]
    if path.is_file():
        name = path.stem
    return Path(f"{name}-{quant}.tinf")


def input_paths(model: Source, tokenizer) -> tuple[list[Path], list[Path]]:
    """(the checkpoint's input files, the folders every file of which is an input)."""
    checkpoint = model.checkpoint
    if isinstance(checkpoint, HfCheckpoint):
        return [], [checkpoint.folder]
    files = [Path(checkpoint.path)] + ([Path(tokenizer).expanduser()] if tokenizer else [])
    return files, []


def check_output(out: Path, inputs: tuple[list[Path], list[Path]], force: bool) -> None:
    """Replace an existing .tinf (atomically, as the writer does: no conversion reads one); never write
    over an input (a .bin, a shard, a .gguf, any file of the source folder, through links too); any
    other existing file only with force."""
    if not os.path.lexists(out) or existing_tinf(out):
        return
    files, folders = inputs
    target = out.resolve()
    for folder in folders:
        folder = folder.resolve()
        if target.is_relative_to(folder) or any(samefile(out, f) for f in folder.iterdir()):
            raise ConvertError(f"{out} is a file of the checkpoint being converted; pick an output path "
                               f"outside {folder}.")
    if any(samefile(out, f) for f in files):
        raise ConvertError(f"{out} is an input of this conversion; pick another output path.")
    if not force:
        raise ConvertError(f"{out} already exists and is not a .tinf file; pick another output path, or pass "
                           f"--force to replace it.")


def existing_tinf(path: Path) -> bool:
    try:
        return path.is_file() and is_tinf_file(path)
    except OSError:
        return False


def samefile(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


@contextmanager
def terminate_as_exit():
    """SIGTERM raises SystemExit while the file is written, so the writer removes its temporary file
    (a signal handler can only be set on the main thread; elsewhere the default stays)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, exit_on_signal)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def exit_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def open_source(source: str, revision, token, tokenizer, progress, file=None) -> Source:
    path = Path(source).expanduser()
    if tokenizer is not None and (not path.is_file() or path.suffix == ".gguf"):
        raise ConvertError("--tokenizer is only used with llama2.c .bin checkpoints; Hugging Face "
                           "checkpoints and GGUF files bring their own tokenizer.")
    if file is not None and (path.exists() or not hub.looks_like_repo_id(source)):
        raise ConvertError(f"--file picks one .gguf file of a Hub repo, but {source} is not a repo id; "
                           f"pass the local file itself as SOURCE.")
    if path.is_dir() or path.is_file():
        if revision is not None:
            raise ConvertError(f"--revision only applies to Hub downloads but {source} is a local path; drop it.")
        if path.is_file() and path.suffix == ".gguf":
            return open_gguf_source(path)
        return open_hf(path) if path.is_dir() else open_llama2c(path, tokenizer)
    if hub.looks_like_repo_id(source):
        if file is not None:
            model = open_gguf_source(hub.download_file(source, file, revision, token, progress))
            model.revision = hub.commit_of(model.checkpoint.path.parent) or revision
            return model
        return open_hub(source, revision, token, progress)
    raise ConvertError(f"{source} is neither an existing folder or .bin file nor a Hub repo id "
                       f"(org/name); check the spelling.")


def open_hf(folder: Path, download=None) -> Source:
    """Validate config and tokenizer first (before any weights are fetched), then the tensors."""
    hf_config = read_hf_config(folder)
    config = tinf_config(hf_config)
    tokenizer, template, generation = hf_tokenizer(folder, hf_config)
    check_tokenizer(tokenizer, config["vocab_size"])
    if download is not None:
        folder = download(folder)
    return Source(HfCheckpoint(folder), tokenizer, template, generation, readme_license(folder))


def open_hub(repo_id: str, revision, token, progress) -> Source:
    folder = hub.download_metadata(repo_id, revision, token, progress)
    model = open_hf(folder, lambda f: hub.download_weights(repo_id, f, revision, token, progress))
    model.revision = hub.commit_of(folder) or revision
    return model


def open_llama2c(path: Path, tokenizer) -> Source:
    if path.suffix == ".safetensors" or path.name == "config.json":
        raise ConvertError(f"{path} is part of a Hugging Face checkpoint; pass the folder that holds it.")
    if is_tinf_file(path):
        raise ConvertError(f"{path} is already a .tinf file, ready to run with `tinyrun {path}`; to change "
                           f"its quantization, convert the original checkpoint again.")
    if tokenizer is None:
        raise ConvertError(f"{path} is read as a llama2.c checkpoint, which needs --tokenizer PATH "
                           f"to its sentencepiece .model file.")
    checkpoint = Llama2cCheckpoint(path)
    tokenizer_meta = sentencepiece_tokenizer(Path(tokenizer).expanduser())
    check_tokenizer(tokenizer_meta, checkpoint.config["vocab_size"])
    return Source(checkpoint, tokenizer_meta)


def open_gguf_source(path: Path) -> Source:
    """A .gguf file: config, tensors, tokenizer and chat template all come from the one file."""
    checkpoint = open_gguf(path)
    missing = set(checkpoint.sources) - set(tinf_shapes(checkpoint.config))
    if missing:
        raise ConvertError(f"{path} has tensors this version cannot store (such as {sorted(missing)[0]}, "
                           f"from q/k/v biases); convert it with a newer tinyinfer.")
    return Source(checkpoint, checkpoint.tokenizer, checkpoint.chat_template, checkpoint.generation,
                  checkpoint.license)


def tinf_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the .tinf file, in file order, with its logical shape."""
    dim, hd, ffn, vocab = config["dim"], config["head_dim"], config["ffn_dim"], config["vocab_size"]
    qkv_rows = (config["n_heads"] + 2 * config["n_kv_heads"]) * hd
    shapes = {"tok_embeddings": (vocab, dim)}
    for i in range(config["n_layers"]):
        shapes.update({f"layers.{i}.attn_norm": (dim,), f"layers.{i}.wqkv": (qkv_rows, dim)})
        if config.get("qkv_bias"):
            shapes[f"layers.{i}.bqkv"] = (qkv_rows,)
        shapes.update({f"layers.{i}.wo": (dim, config["n_heads"] * hd), f"layers.{i}.ffn_norm": (dim,),
                       f"layers.{i}.w_gate_up": (2 * ffn, dim), f"layers.{i}.w_down": (dim, ffn)})
    shapes.update({"norm": (dim,), "output": (vocab, dim)})
    return shapes


def tensor_encoding(name: str, quant: str, head) -> str:
    """Embeddings f16, norms and biases f32, the head f16 on request, every other matrix `quant`."""
    if name == "tok_embeddings":
        return "f16"
    if name.endswith(("norm", "bqkv")):
        return "f32"
    if name == "output" and head == "f16":
        return "f16"
    return quant


def tensor_specs(config: dict, quant: str, group_size: int, head) -> list[TensorSpec]:
    specs = []
    for name, shape in tinf_shapes(config).items():
        encoding = tensor_encoding(name, quant, head)
        specs.append(TensorSpec(name, encoding, shape, group_size if encoding in QMAX else None))
    return specs


def encoding_plan(checkpoint, quant, group_size, head) -> tuple[list[TensorSpec], int]:
    """Every tensor's encoding: `quant` (default q4) with `group_size` (default DEFAULT_GROUP, 32 for
    GGUF); a GGUF file without --quant keeps each matrix role in its own encoding where that copies exactly."""
    gguf = isinstance(checkpoint, GgufCheckpoint)
    group = group_size or (GGUF_GROUP if gguf else DEFAULT_GROUP[quant or DEFAULT_QUANT])
    specs = tensor_specs(checkpoint.config, quant or DEFAULT_QUANT, group, head)
    if gguf:
        if quant is None:
            specs = checkpoint.own_encodings(specs, QMAX)
        note = checkpoint.requantized_note(specs)
        if note:
            print(note, file=sys.stderr)
    return specs, group


def layer_encoding(specs, group: int) -> tuple[str, int]:
    """(encoding, group) of the layers' matrices, recorded as the file's quantization."""
    spec = next(s for s in specs if s.name.endswith("w_gate_up"))
    return spec.encoding, spec.group or group


def calibrate_inputs(model: Source, progress: bool) -> tuple[dict, int]:
    """({matrix name: [cols] mean square input}, tokens) from the calibration pass."""
    from tinyinfer.convert.calibration import input_importance

    config = model.checkpoint.config
    with tqdm(total=config["n_layers"], unit="layer", desc="calibrating", disable=not progress) as bar:
        return input_importance(model.checkpoint, tinf_shapes(config), model.tokenizer, on_layer=bar.update)


def build_metadata(model: Source, source: str, quant: str, group_size: int, scale_search: bool,
                   calibration_tokens: int = 0) -> dict:
    provenance = {
        "source": source,
        "revision": model.revision,
        "converter": tinyinfer_version(),
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "quant": quant,
        "group_size": group_size,
        "scale_search": bool(scale_search),
        "calibration_tokens": int(calibration_tokens),
        "license": model.license,
    }
    return {"config": model.checkpoint.config, "tokenizer": model.tokenizer,
            "chat_template": model.chat_template, "generation": model.generation,
            "provenance": provenance, "autotune": {}}


def write_tensors(out: Path, metadata: dict, specs, checkpoint, scale_search, progress, importance=None) -> None:
    total = sum(math.prod(spec.shape) for spec in specs)
    with tqdm(total=total, unit="w", unit_scale=True, desc="converting", disable=not progress) as bar:
        with TinfWriter(out, metadata, specs) as writer:
            for spec in specs:
                writer.write(spec.name, encoded_tensor(checkpoint, spec, scale_search, (importance or {}).get(spec.name)))
                bar.update(math.prod(spec.shape))


def encoded_tensor(checkpoint, spec: TensorSpec, scale_search, importance=None):
    """The checkpoint's own blocks where they copy exactly (GGUF), else its float values encoded
    (q4 with its inputs' importance, where the calibration measured it)."""
    exact = checkpoint.exact(spec.name, spec.encoding, spec.group) if hasattr(checkpoint, "exact") else None
    weights = exact.to_float32() if exact is not None else checkpoint.load(spec.name)
    assert weights.shape == tuple(spec.shape), (spec.name, weights.shape, spec.shape)
    check_values(spec, weights)
    if exact is not None:
        return exact
    return encode(weights, spec.encoding, spec.group, scale_search,
                  importance=importance if spec.encoding == "q4" else None)


def check_values(spec: TensorSpec, weights: np.ndarray) -> None:
    """Refuse NaN/inf, and magnitudes a 16-bit value or a 16-bit scale cannot hold."""
    largest = max(abs(float(weights.max())), abs(float(weights.min()))) if weights.size else 0.0
    if not np.isfinite(largest):
        raise ConvertError(f"tensor {spec.name} contains NaN or infinite values; the checkpoint is "
                           f"corrupt, re-download or re-export it.")
    limit = F16_MAX * QMAX.get(spec.encoding, 1)
    if largest > limit:
        fix = {"tok_embeddings": "embeddings are always stored as f16, so this checkpoint cannot be converted",
               "output": "convert without --head f16"}.get(spec.name, "convert with --quant q8 or q4")
        raise ConvertError(f"tensor {spec.name} has a value of magnitude {largest:.6g}, beyond the "
                           f"{spec.encoding} range of {limit:.6g}; {fix}.")


def summary(out: Path, seconds: float) -> str:
    """The line tinyconvert ends with; the counts are those `tinyrun info` and the model card give."""
    with open_tinf(out) as f:
        stats = file_weight_stats(f)
    return f"wrote {out}: {stats.summary()}, {out.stat().st_size / 2**20:.1f} MiB, {seconds:.1f} s"
