"""The README.md model card published next to a .tinf file: Hub metadata up front, then the facts.

Everything in the card is read from the file itself (its provenance, tensor directory and autotune
section) or measured from its bytes (size, sha256), so the card cannot drift from the file it describes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tinyinfer.formats import open_tinf
from tinyinfer.formats.quant import QUANTIZED
from tinyinfer.formats.stats import file_weight_stats

SHA256_CHUNK = 16 << 20


def file_sha256(path, progress: bool = False) -> str:
    """sha256 of a file, read in 16 MiB chunks so a multi-GB model never sits in memory."""
    from tqdm import tqdm

    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f, tqdm(total=path.stat().st_size, unit="B", unit_scale=True, desc="sha256",
                                     disable=None if progress else True, leave=False) as bar:
        while chunk := f.read(SHA256_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def model_card(tinf_path, repo_id: str, sha256: str | None = None) -> str:
    """README.md text for `tinf_path` published as `repo_id` (sha256 is computed when not given)."""
    tinf_path = Path(tinf_path)
    with open_tinf(tinf_path) as f:
        facts = card_facts(f, repo_id, sha256 or file_sha256(tinf_path))
        benchmarks = file_benchmarks(f.metadata)
    return front_matter(facts) + body(facts, benchmarks)


def card_facts(f, repo_id: str, sha256: str) -> dict:
    """The numbers and names the card reports, in one flat dict (the tests check each of them)."""
    prov = f.metadata.get("provenance") or {}
    stats = file_weight_stats(f)
    source = prov.get("source")
    revision = prov.get("revision")
    return {
        "repo_id": repo_id,
        "filename": f.path.name,
        "file_size": f.file_size,
        "sha256": sha256,
        "format": f"{f.version[0]}.{f.version[1]}",
        "source": source,
        "revision": revision,
        # A Hub download records the commit it read; a local folder or .bin records none.
        "base_model": source if revision and looks_like_repo_id(source) else None,
        "license": prov.get("license"),
        "quant": prov.get("quant"),
        "group_size": prov.get("group_size"),
        "scale_search": prov.get("scale_search"),
        "converter": prov.get("converter"),
        "created": prov.get("created"),
        "n_weights": stats.n_weights,
        "bits_per_weight": stats.bits_per_weight,
        "quantized_bits_per_weight": stats.quantized_bits_per_weight,
        "has_chat_template": bool(f.metadata.get("chat_template")),
        "architecture": f.config.get("architecture"),
        "max_context": f.config.get("max_context"),
    }


def looks_like_repo_id(source) -> bool:
    from tinyinfer.convert.hub import looks_like_repo_id as is_repo_id

    return isinstance(source, str) and is_repo_id(source)


def file_benchmarks(metadata: dict) -> list[tuple[str, dict]]:
    """(autotune key, benchmark numbers) for every autotune entry that carries a "bench" map."""
    rows = []
    for key, entry in sorted((metadata.get("autotune") or {}).items()):
        bench = entry.get("bench") if isinstance(entry, dict) else None
        if isinstance(bench, dict) and bench:
            rows.append((key, bench))
    return rows


def front_matter(facts: dict) -> str:
    """YAML the Hub reads: license (copied from the source), tags, and base_model for Hub sources.

    Values are written as JSON strings, which YAML reads verbatim whatever characters they hold.
    """
    lines = ["---"]
    if facts["license"]:
        lines.append(f"license: {json.dumps(facts['license'])}")
    if facts["base_model"]:
        lines += [f"base_model: {json.dumps(facts['base_model'])}", "base_model_relation: quantized"]
    lines.append("tags:")
    lines += [f"- {json.dumps(tag)}" for tag in ["tinyinfer", "tinf", facts["quant"]] if tag]
    return "\n".join(lines + ["---", "", ""])


def run_command(facts: dict) -> str:
    if facts["has_chat_template"]:
        prompt = '--chat --prompt "Hello! Who are you?"'
    else:
        prompt = '--prompt "Once upon a time"'
    return f"tinyrun {facts['repo_id']}/{facts['filename']} {prompt}"


def body(facts: dict, benchmarks: list[tuple[str, dict]]) -> str:
    name = facts["repo_id"].split("/")[-1]
    source = facts["source"] or "an unrecorded source"
    revision = f" at revision `{facts['revision']}`" if facts["revision"] else ""
    license_line = (f"`{facts['license']}`, copied from the source model; the source's terms apply"
                    if facts["license"] else "not declared by the source; check the source model's terms")
    lines = [
        f"# {name}",
        "",
        f"`{facts['filename']}` is a single-file tinyinfer model "
        f"(format `.tinf` {facts['format']}) converted from `{source}`{revision}.",
        "",
        "## Run it",
        "",
        "```sh",
        'pip install -e ".[cuda12]"   # in a checkout of tinyinfer; or ".[cuda13]"; plain "." runs on the CPU',
        run_command(facts),
        "```",
        "",
        "## The file",
        "",
        "| | |",
        "|---|---|",
        f"| file | `{facts['filename']}` |",
        f"| size | {facts['file_size']} bytes ({facts['file_size'] / 2**20:.1f} MiB) |",
        f"| sha256 | `{facts['sha256']}` |",
        f"| quantization | {quant_line(facts)} |",
        f"| bits per weight | {bits_line(facts)} |",
        f"| weights | {facts['n_weights']:,} ({facts['architecture']}, context {facts['max_context']}) |",
        f"| source model | `{source}` |",
        f"| source revision | {revision_cell(facts['revision'])} |",
        f"| license | {license_line} |",
        f"| converted by | {facts['converter'] or 'unknown'}, {facts['created'] or 'date unknown'} |",
        "",
    ]
    lines += benchmark_lines(benchmarks)
    lines += [
        "## Check the download",
        "",
        "```sh",
        f"sha256sum {facts['filename']}            # compare with the sha256 above",
        f"tinyrun info {facts['repo_id']}/{facts['filename']} --check   # verifies every tensor checksum",
        "```",
        "",
    ]
    return "\n".join(lines)


def revision_cell(revision) -> str:
    return f"`{revision}`" if revision else "not recorded (converted from a local checkpoint)"


def quant_line(facts: dict) -> str:
    if not facts["quant"]:
        return "not recorded"
    if facts["quant"] not in QUANTIZED:
        return facts["quant"]
    search = {True: "clipping search", False: "max-abs scales"}.get(facts["scale_search"], "scales unknown")
    return f"{facts['quant']}, group size {facts['group_size']}, {search}"


def bits_line(facts: dict) -> str:
    text = f"{facts['bits_per_weight']:.2f} over all tensors (embeddings and norms included)"
    if facts["quantized_bits_per_weight"] is not None:
        text += f", {facts['quantized_bits_per_weight']:.2f} in the quantized layers (scales included)"
    return text


def benchmark_lines(benchmarks: list[tuple[str, dict]]) -> list[str]:
    if not benchmarks:
        return []
    lines = ["## Benchmarks", "", "Stored in the file's autotune section, one line per GPU and kernel build.", ""]
    for key, bench in benchmarks:
        numbers = ", ".join(f"{k} {format_number(v)}" for k, v in bench.items() if isinstance(v, (int, float, str)))
        lines.append(f"- `{key}`: {numbers}")
    return lines + [""]


def format_number(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
