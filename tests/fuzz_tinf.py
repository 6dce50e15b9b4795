"""Mutants of valid inputs for the adversarial suite (tests/adversary.py runs them).

Structure-aware mutants rewrite one value of a .tinf file's msgpack metadata (or of a JSON file of a
checkpoint, or of the tokenizer.json inside the metadata) and repack it with valid lengths and
offsets, so the attack gets past the preamble to the checks behind it. Byte mutants flip, overwrite,
truncate or insert raw bytes anywhere. Every mutant is a pure function of its seed and index, so a
failing one can be rebuilt from its name.
"""

from __future__ import annotations

import json
import math
import random
import struct
import tempfile
from pathlib import Path

import msgpack

from tinyinfer.formats.tinf import DATA_ALIGN, PREAMBLE, pack_header

CHAT_TEMPLATE = ("{% for m in messages %}{{ bos_token + m['role'] + ': ' + m['content'] + eos_token }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ 'assistant:' }}{% endif %}")


def nested(depth: int, leaf=0):
    value = leaf
    for _ in range(depth):
        value = [value]
    return value


INTERESTING = [0, -1, 1, 2, 3, 7, 16, 31, 32, 33, 63, 64, 65, 127, 128, 4096, 2**15, 2**16, 2**24, 2**24 + 1,
               2**31 - 1, 2**31, 2**32, 2**40, 2**53 + 1, 2**63 - 1, -2**63, 2**64 - 1, True, False, None,
               0.0, -0.0, 1e-30, 0.5, 1.5, 2.5, 32.0, 64.0, 1e308, -1e308, math.nan, math.inf, -math.inf, "", "x",
               "64", "llama", "q4", "q8", "f16", "f32", "bf16", "hf-json", "sentencepiece", "linear", "llama3",
               b"", b"\x00" * 8, [], [0], [-1], [2**40], [[]], [1.5], ["a"], {}, {"a": 1}, {"rope_type": "llama3"},
               nested(300), "A" * 20000, "{{ 'x' * 10**9 }}", "{% for i in range(10**9) %}{% endfor %}"]

# Chat templates an adversary writes (class 1 of the issue): hangs, memory, leaks and collisions.
ATTACK_TEMPLATES = {
    "power tower": "{{ 9**9**9**9 }}",
    "huge power": "{{ 10**100000000 }}",
    "string repetition": "{{ 'x' * 10**10 }}",
    "reversed repetition": "{{ 10**10 * 'ab' }}",
    "list repetition": "{% for x in messages * 1000000000 %}{% endfor %}",
    "huge range": "{% for i in range(10**12) %}{{ i }}{% endfor %}",
    "nested ranges": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested string loops": "{% for a in 'x' * 10000000 %}{% for b in 'y' * 10000000 %}{% endfor %}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "exponential recursion": "{% macro f(n) %}{% if n < 80 %}{{ f(n+1) }}{{ f(n+1) }}{% endif %}{% endmacro %}{{ f(0) }}",
    "recursive loop": "{% for m in [messages] * 3 recursive %}{{ loop([messages] * 3) }}{% endfor %}",
    "doubling concat": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling plus": "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "output flood": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
    "center": "{{ 'x' | center(10**10) }}",
    "center literal": "{{ 'x' | center(10000000000) }}",
    "ljust": "{{ 'x'.ljust(10000000000) }}",
    "percent width": "{{ '%099999999999d' % 1 }}",
    "format width": "{{ '{:>99999999999}'.format(1) }}",
    "format filter": "{{ '%0999999999d' | format(1) }}",
    "indent": "{{ 'a\\nb' | indent(10**10) }}",
    "wordwrap": "{{ ('a ' * 100000) | wordwrap(1) | length }}",
    "lipsum": "{{ lipsum(10**9) }}",
    "sort flood": "{{ (range(100000) | list * 1000) | sort | length }}",
    "replace growth": "{{ ('a' * 1000000) | replace('a', 'a' * 1000) | length }}",
    "zero division": "{{ 1 / 0 }}",
    "integer zero division": "{{ 1 // 0 }}",
    "modulo zero": "{{ 1 % 0 }}",
    "type error": "{{ 1 + 'a' }}",
    "value error": "{{ 'a' | int(base=99) }}",
    "overflow": "{{ (10**400) / 1.0 }}",
    "float overflow": "{{ 1e308 * 1e308 | int }}",
    "lone surrogate": "{{ '\\udcff' | tojson(ensure_ascii=False) }}",
    "attribute escape": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "format escape": "{{ '{0.__class__}'.format(1) }}",
    "globals escape": "{{ raise_exception.__globals__ }}",
    "cycler escape": "{{ cycler.__init__.__globals__ }}",
    "raise": "{{ raise_exception('no system messages') }}",
    "undefined call": "{{ nothing() }}",
    "syntax error": "{% for %}",
    "deep parentheses": "{{" + "(" * 20000 + "1" + ")" * 20000 + "}}",
    "deep ifs": "{% if true %}" * 5000 + "x" + "{% endif %}" * 5000,
    "deep lists": "{{ " + "[" * 5000 + "]" * 5000 + " }}",
    "long template": "{{ 'a' }}" * 200000,
    "collision messages": "{{ messages[0]['content'] }}",
    "collision generation prompt": "{% if add_generation_prompt %}A{% endif %}",
    "collision tools": "{{ tools }}",
    "strftime": "{{ strftime_now('%' * 100000) }}",
    "tojson deep": "{% set ns = namespace(x=[]) %}{% for i in range(3000) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | tojson }}",
    "dict items": "{% for k, v in messages[0] | dictsort %}{{ k }}{{ v }}{% endfor %}",
}
# Special-token names that collide with render()'s own arguments, plus their string values.
COLLIDING_SPECIAL_TOKENS = {"messages": "x", "add_generation_prompt": "x", "tools": "x", "documents": "x",
                            "bos_token": "<s>", "eos_token": "</s>"}


# ------------------------------------------------------------------------------------------ .tinf


def seed_tinf(folder: Path) -> bytes:
    """A valid, runnable tiny model (tests/tinf_samples.py) with a chat template and sampling defaults."""
    from tinf_samples import write_runnable_tinf

    from tinyinfer.formats import rewrite_metadata

    path = write_runnable_tinf(Path(folder) / "seed.tinf")
    rewrite_metadata(path, path, {"chat_template": CHAT_TEMPLATE,
                                  "generation": {"do_sample": True, "temperature": 0.7, "top_p": 0.9,
                                                 "top_k": 20, "max_new_tokens": 8}})
    return path.read_bytes()


def split_tinf(data: bytes) -> tuple[dict, bytes]:
    _, _, _, _, meta_len, data_offset = PREAMBLE.unpack_from(data)
    metadata = msgpack.unpackb(data[PREAMBLE.size: PREAMBLE.size + meta_len], raw=False)
    return metadata, data[data_offset:]


def join_tinf(metadata: dict, data: bytes) -> bytes:
    """A file with this metadata and tensor data, its preamble's lengths and offsets consistent."""
    header, data_offset = pack_header(metadata)
    return header + b"\0" * (data_offset - len(header)) + data


def with_metadata(seed: bytes, **updates) -> bytes:
    """The seed with top-level metadata keys replaced (None deletes a key)."""
    metadata, data = split_tinf(seed)
    for key, value in updates.items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    return join_tinf(metadata, data)


def with_value(seed: bytes, path: tuple, value, delete: bool = False) -> bytes:
    """The seed with metadata[path[0]][path[1]]... replaced by value (or deleted)."""
    metadata, data = split_tinf(seed)
    container = metadata
    for key in path[:-1]:
        container = container[key]
    if delete:
        del container[path[-1]]
    else:
        container[path[-1]] = value
    return join_tinf(metadata, data)


def leaf_paths(value, prefix=()) -> list[tuple]:
    """Every (path) to a value inside nested dicts and lists, containers included."""
    paths = []
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        paths.append(prefix + (key,))
        paths.extend(leaf_paths(child, prefix + (key,)))
    return paths


def mutate_value(value, rng: random.Random):
    """A nearby or an interesting value of another type."""
    choice = rng.random()
    if choice < 0.55:
        return rng.choice(INTERESTING)
    if isinstance(value, bool):
        return int(value) if choice < 0.8 else str(value)
    if isinstance(value, int):
        return rng.choice([value + 1, value - 1, -value, value * 2, value * 1024, value // 2, float(value),
                           str(value), value + 2**32, (value or 1) << 31])
    if isinstance(value, float):
        return rng.choice([value * 1e10, -value, 0.0, int(value) if math.isfinite(value) else 0, str(value),
                           value / 3])
    if isinstance(value, str):
        if len(value) > 200:
            return value[: rng.randrange(len(value))]
        return rng.choice([value + value, value[:-1], value.upper(), value + "\0", 0, [value]])
    if isinstance(value, (bytes, bytearray)):
        data = bytearray(value)
        for _ in range(rng.randint(1, 8)):
            if data:
                data[rng.randrange(len(data))] = rng.randrange(256)
        return bytes(data) if rng.random() < 0.7 else len(value)
    if isinstance(value, list):
        return rng.choice([value[:-1], value + value[-1:], value[::-1], value * 2, [value], None])
    if isinstance(value, dict):
        return rng.choice([{}, {**value, "unexpected": 1}, list(value), None])
    return rng.choice(INTERESTING)


def mutate_json_text(text: str, rng: random.Random) -> str:
    """tokenizer.json (or any JSON file) with one value mutated; its truncation and padding settings get
    absurd values often, as class 4 of the issue asks."""
    try:
        tree = json.loads(text)
    except ValueError:
        return text
    if isinstance(tree, dict) and rng.random() < 0.3:
        tree["truncation"] = rng.choice([
            {"direction": "Right", "max_length": rng.choice([0, 1, 2, 2**32, 2**64 - 1]), "strategy": "LongestFirst",
             "stride": rng.choice([0, 1, 5, 2**40])},
            {"direction": "Left", "max_length": 1, "strategy": "OnlyFirst", "stride": 0}, 5, "x", None])
        tree["padding"] = rng.choice([
            {"strategy": {"Fixed": rng.choice([1, 2**20, 2**40])}, "direction": "Right", "pad_to_multiple_of":
             rng.choice([None, 0, 3, 2**40]), "pad_id": rng.choice([0, -1, 2**40]), "pad_type_id": 0,
             "pad_token": "<pad>"}, {"strategy": "BatchLongest"}, None])
        return json.dumps(tree)
    paths = leaf_paths(tree)
    if not paths:
        return text
    path = rng.choice(paths)
    container = tree
    for key in path[:-1]:
        container = container[key]
    if rng.random() < 0.15 and isinstance(container, dict):
        del container[path[-1]]
    else:
        value = mutate_value(container[path[-1]], rng)
        container[path[-1]] = value if not isinstance(value, bytes) else value.decode("latin-1")
    try:
        return json.dumps(tree)
    except (ValueError, TypeError, RecursionError):   # NaN is written as NaN by json; deep values fail
        return text


def structured_mutant(seed: bytes, rng: random.Random) -> bytes:
    metadata, data = split_tinf(seed)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        roll = rng.random()
        if roll < 0.12 and isinstance(metadata.get("tokenizer"), dict) and isinstance(
                metadata["tokenizer"].get("tokenizer_json"), str):
            metadata["tokenizer"]["tokenizer_json"] = mutate_json_text(metadata["tokenizer"]["tokenizer_json"], rng)
            continue
        if roll < 0.2:
            metadata["chat_template"] = rng.choice(list(ATTACK_TEMPLATES.values()) + [CHAT_TEMPLATE[:rng.randrange(
                len(CHAT_TEMPLATE))]]) if rng.random() < 0.3 else CHAT_TEMPLATE[: rng.randrange(len(CHAT_TEMPLATE))]
            continue
        paths = [p for p in leaf_paths(metadata) if p[-1] != "tokenizer_json" or rng.random() < 0.05]
        path = rng.choice(paths)
        container = metadata
        for key in path[:-1]:
            container = container[key]
        if isinstance(container, dict) and rng.random() < 0.12:
            del container[path[-1]]
        elif isinstance(container, dict) and rng.random() < 0.05:
            container[rng.choice(["group", "extra", "pad_id", "rope_scaling", "sliding_window", "qkv_bias"])] = \
                rng.choice(INTERESTING)
        else:
            container[path[-1]] = mutate_value(container[path[-1]], rng)
    try:
        return join_tinf(metadata, data)
    except (ValueError, TypeError, OverflowError):   # not representable in msgpack: a raw mutant instead
        return byte_mutant(seed, rng)


def byte_mutant(seed: bytes, rng: random.Random) -> bytes:
    data = bytearray(seed)
    header_end = PREAMBLE.unpack_from(seed)[5]
    roll = rng.random()
    if roll < 0.1:
        return bytes(data[: rng.randrange(len(data))])
    if roll < 0.2:
        at = rng.randrange(len(data))
        return bytes(data[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))) + data[at:])
    if roll < 0.35:
        at = rng.randrange(0, min(header_end, PREAMBLE.size + 4096) - 8)
        data[at: at + 8] = struct.pack("<Q", rng.choice([0, 1, 2**31, 2**32 - 1, 2**63, 2**64 - 1, len(seed),
                                                         DATA_ALIGN, rng.randrange(2**64)]))
        return bytes(data)
    in_header = rng.random() < 0.7
    for _ in range(rng.randint(1, 8)):
        at = rng.randrange(header_end) if in_header else rng.randrange(header_end, len(data))
        data[at] ^= 1 << rng.randrange(8) if rng.random() < 0.7 else rng.randrange(1, 256)
    return bytes(data)


def tinf_mutants(seed: bytes, count: int, base_seed: int = 0):
    """(name, ("tinf", bytes)) for `count` mutants: about three in four structure-aware."""
    for i in range(count):
        rng = random.Random(base_seed * 1_000_003 + i)
        kind = "structured" if rng.random() < 0.75 else "bytes"
        mutant = structured_mutant(seed, rng) if kind == "structured" else byte_mutant(seed, rng)
        yield f"tinf {kind} mutant {base_seed}:{i}", ("tinf", mutant)


# ------------------------------------------------------------------------------------------ converters


def seed_hf_files() -> dict[str, bytes]:
    from checkpoints import write_hf_llama

    with tempfile.TemporaryDirectory() as tmp:
        write_hf_llama(Path(tmp), dim=64, n_layers=2, vocab_size=64, ffn_dim=96, max_context=64)
        return {p.name: p.read_bytes() for p in Path(tmp).iterdir() if p.is_file()}


def hf_mutants(seed: dict[str, bytes], count: int, base_seed: int = 0):
    json_files = sorted(name for name in seed if name.endswith(".json"))
    for i in range(count):
        rng = random.Random(7_000_001 * (base_seed + 1) + i)
        files = dict(seed)
        if rng.random() < 0.8:
            name = rng.choice(json_files + ["config.json"] * 4)
            files[name] = mutate_json_text(files[name].decode(), rng).encode()
            what = name
        else:
            name = "model.safetensors"
            data = bytearray(files[name])
            (header_len,) = struct.unpack_from("<Q", data)
            for _ in range(rng.randint(1, 6)):
                at = rng.randrange(8 + header_len) if rng.random() < 0.8 else rng.randrange(len(data))
                data[at] = rng.randrange(256)
            files[name] = bytes(data)
            what = "safetensors bytes"
        yield f"hf mutant {base_seed}:{i} ({what})", ("hf", files)


def seed_gguf() -> bytes:
    from gguf_files import write_gguf

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seed.gguf"
        write_gguf(path, dim=64, n_layers=2, vocab=300, matrix_type="Q8_0")
        return path.read_bytes()


def gguf_mutants(seed: bytes, count: int, base_seed: int = 0):
    """Raw mutants of a GGUF file, mostly in its key-value and tensor-info header (the first few KiB)."""
    header_end = min(len(seed), 16384)
    for i in range(count):
        rng = random.Random(9_000_011 * (base_seed + 1) + i)
        data = bytearray(seed)
        roll = rng.random()
        if roll < 0.1:
            data = data[: rng.randrange(len(data))]
        elif roll < 0.5:
            at = rng.randrange(4, header_end - 8)
            data[at: at + 8] = struct.pack("<Q", rng.choice([0, 1, 3, 2**31, 2**32 - 1, 2**40, 2**63, 2**64 - 1,
                                                             rng.randrange(2**64)]))
        else:
            for _ in range(rng.randint(1, 8)):
                at = rng.randrange(header_end) if rng.random() < 0.8 else rng.randrange(len(data))
                data[at] ^= 1 << rng.randrange(8)
        yield f"gguf mutant {base_seed}:{i}", ("gguf", bytes(data))
