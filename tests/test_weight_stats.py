"""One count of weights and bits per weight, reported alike by tinyconvert, tinyrun info and the model card."""

from __future__ import annotations

import math
import re

from checkpoints import write_hf_llama  # noqa: E402
from console_scripts import run  # noqa: E402
from tinf_samples import TENSORS, write_tiny_tinf  # noqa: E402
from tinyinfer.convert.model_card import card_facts  # noqa: E402
from tinyinfer.formats import open_tinf, tensor_nbytes  # noqa: E402
from tinyinfer.formats.stats import file_weight_stats, format_count  # noqa: E402


def test_counts_follow_the_spec_size_formula(tmp_path):
    path = write_tiny_tinf(tmp_path / "t.tinf")
    with open_tinf(path) as f:
        stats = file_weight_stats(f)
    n_weights = sum(math.prod(shape) for shape, _, _ in TENSORS.values())
    n_bytes = sum(tensor_nbytes(enc, shape, group) for shape, enc, group in TENSORS.values())
    q_items = [(shape, group) for shape, enc, group in TENSORS.values() if enc == "q4"]
    q_bytes = sum(tensor_nbytes("q4", shape, group) for shape, group in q_items)
    assert (stats.n_weights, stats.n_bytes) == (n_weights, n_bytes)
    assert stats.quantized_weights == sum(math.prod(shape) for shape, _ in q_items)
    assert stats.bits_per_weight == 8 * n_bytes / n_weights
    assert stats.quantized_bits_per_weight == 8 * q_bytes / stats.quantized_weights
    assert format_count(1_100_048_384) == "1.10B" and format_count(289_536) == "0.29M"


def test_tinyconvert_tinyrun_info_and_the_card_agree(tmp_path):
    src = tmp_path / "ckpt"
    write_hf_llama(src)
    out = tmp_path / "m.tinf"
    converted = run("tinyconvert", src, "-o", out)
    assert converted.returncode == 0, converted.stderr
    info = run("tinyrun", "info", out)
    assert info.returncode == 0, info.stderr
    with open_tinf(out) as f:
        stats = file_weight_stats(f)
        facts = card_facts(f, "org/m", "0" * 64)
    line = stats.summary()
    assert f"wrote {out}: {line}," in converted.stderr
    assert line in info.stdout
    assert (facts["n_weights"], facts["bits_per_weight"]) == (stats.n_weights, stats.bits_per_weight)
    assert facts["quantized_bits_per_weight"] == stats.quantized_bits_per_weight
    # the numbers themselves, as printed: weights count and two bits-per-weight figures
    assert re.search(r"\d+\.\d\dM weights in all tensors \(embeddings included\) at \d\.\d\d bits/weight; "
                     r"the q4/q8 matrices at \d\.\d\d bits/weight", info.stdout)
