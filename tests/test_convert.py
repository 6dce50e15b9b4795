"""The Hugging Face side of the converter: tiny random checkpoints written by the tests themselves,
the shared stories260K-hf folder, refused inputs, the CLI and the Hub download logic."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from checkpoints import (TINYLLAMA, assert_tinf_matches, fused_source, tinf_logits,  # noqa: E402
                         write_hf_llama)
from fake_hub import SnapshotDownload  # noqa: E402

from tinyinfer.convert import ConvertError, convert_checkpoint  # noqa: E402
from tinyinfer.convert import hub, pipeline  # noqa: E402
from tinyinfer.convert.cli import main  # noqa: E402
from tinyinfer.formats import encode, open_tinf  # noqa: E402


def convert(src, out, **kwargs):
    return convert_checkpoint(src, out, progress=False, **kwargs)


def assert_one_sentence(message: str):
    assert message.endswith(".") and "\n" not in message and ". " not in message, message


def assert_nothing_written(folder: Path):
    leftovers = [p.name for p in folder.iterdir() if ".tinf" in p.name]
    assert not leftovers, leftovers


def expected_tensors(weights, config):
    return fused_source(weights, {"num_hidden_layers": config["n_layers"]})


# ------------------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
@pytest.mark.parametrize("shards", [1, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_every_tensor_within_bound(tmp_path, dtype, shards, tied):
    src = tmp_path / "ckpt"
    weights = write_hf_llama(src, dtype=dtype, shards=shards, tied=tied, seed=shards + tied)
    assert (src / "model.safetensors.index.json").is_file() == (shards > 1)
    out = convert(src, tmp_path / "m.tinf", quant="q4")
    with open_tinf(out) as f:
        config = f.config
        encodings = {name: f.info(name).encoding for name in f.names}
    assert config["tied_embeddings"] is tied
    assert encodings["tok_embeddings"] == "f16" and encodings["norm"] == "f32"
    assert encodings["layers.0.attn_norm"] == "f32" and encodings["output"] == "q4"
    assert_tinf_matches(out, expected_tensors(weights, config))


@pytest.mark.parametrize("quant,group,head,search", [("q8", 64, None, True), ("f16", 64, None, True),
                                                     ("q4", 32, "f16", True), ("q4", 128, None, False)])
def test_encodings_and_fusion_order(tmp_path, quant, group, head, search):
    """Each tensor is exactly the encoder's output for the fused source (rows Q,K,V and gate,up)."""
    src = tmp_path / "ckpt"
    # ffn 80 is not a multiple of the group: exercises column padding of w_down.
    weights = write_hf_llama(src, dtype="bf16", ffn_dim=80, n_heads=4, n_kv_heads=4)
    out = convert(src, tmp_path / "m.tinf", quant=quant, group_size=group, head=head, scale_search=search,
                  calibrate=False)
    with open_tinf(out) as f:
        expected = expected_tensors(weights, f.config)
        for name in f.names:
            got = f.tensor(name)
            want = encode(expected[name], got.encoding, group, search)
            assert got.encoding == (f"{head}" if name == "output" and head else want.encoding)
            assert got.group == (group if got.encoding in ("q4", "q8") else None)
            np.testing.assert_array_equal(got.data, want.data, err_msg=name)
            if want.scales is not None:
                np.testing.assert_array_equal(got.scales, want.scales, err_msg=name)
        assert f.metadata["provenance"]["scale_search"] is search
    assert_tinf_matches(out, expected)


def test_q4_is_calibrated_by_default(tmp_path):
    """Each q4 matrix is the encoder's output weighted by its input's mean squares over the built-in
    text (convert.calibration), and the file records the tokens used; the other tensors are unchanged."""
    from tinyinfer.convert.calibration import input_importance

    src = tmp_path / "ckpt"
    weights = write_hf_llama(src, dtype="f32")
    out = convert(src, tmp_path / "m.tinf", quant="q4")
    model = pipeline.open_source(str(src), None, None, None, False)
    stats, tokens = input_importance(model.checkpoint, pipeline.tinf_shapes(model.checkpoint.config), model.tokenizer)
    assert tokens > 16 and set(stats) == {n for n in pipeline.tinf_shapes(model.checkpoint.config)
                                          if n.endswith(("wqkv", "wo", "w_gate_up", "w_down")) or n == "output"}
    with open_tinf(out) as f:
        assert f.metadata["provenance"]["calibration_tokens"] == tokens
        expected = expected_tensors(weights, f.config)
        changed = 0
        for name in f.names:
            got = f.tensor(name)
            if got.encoding != "q4":
                continue
            want = encode(expected[name], "q4", got.group, True, importance=stats[name])
            np.testing.assert_array_equal(got.scales, want.scales, err_msg=name)
            changed += not np.array_equal(want.scales, encode(expected[name], "q4", got.group).scales)
        assert changed > 0         # the statistics moved some scales
    plain = convert(src, tmp_path / "plain.tinf", quant="q4", calibrate=False)
    with open_tinf(plain) as f:
        assert f.metadata["provenance"]["calibration_tokens"] == 0


def test_metadata(tmp_path):
    src = tmp_path / "ckpt"
    write_hf_llama(src, rope_scaling={"type": "linear", "factor": 2.0}, max_context=256)
    out = convert(src, tmp_path / "m.tinf", quant="q8", group_size=32)
    with open_tinf(out) as f:
        meta = f.metadata
    assert meta["config"] == {
        "architecture": "llama", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 16,
        "ffn_dim": 96, "vocab_size": 256, "norm_eps": 1e-5, "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "max_context": 256, "tied_embeddings": False,
        "qkv_bias": False, "sliding_window": None}
    tok = meta["tokenizer"]
    assert tok["kind"] == "hf-json" and tok["tokenizer_json"] == (src / "tokenizer.json").read_text()
    assert tok["tokenizer_model"] is None and tok["bos_id"] == 1 and tok["add_bos"] is True
    assert tok["eos_ids"] == [2, 3]                      # config's 2 united with generation_config's [2, 3]
    assert tok["special_tokens"] == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    assert meta["chat_template"] == json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    assert meta["generation"] == {"temperature": 0.7, "top_p": 0.9, "do_sample": True}
    prov = meta["provenance"]
    assert prov["source"] == str(src) and prov["revision"] is None and prov["license"] == "apache-2.0"
    assert (prov["quant"], prov["group_size"], prov["scale_search"]) == ("q8", 32, True)
    assert prov["converter"].startswith("tinyinfer ") and prov["created"].endswith("Z")
    assert meta["autotune"] == {}


def test_llama3_rope_gqa_and_chat_template_file(tmp_path):
    src = tmp_path / "ckpt"
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    write_hf_llama(src, n_heads=8, n_kv_heads=1, rope_scaling=scaling, rope_theta=500000.0, tied=True,
                   eos_token_id=[2, 4])
    config = json.loads((src / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (src / "tokenizer_config.json").write_text(json.dumps(config))
    (src / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    with open_tinf(convert(src, tmp_path / "m.tinf")) as f:
        assert f.config["rope_scaling"] == scaling and f.config["rope_theta"] == 500000.0
        assert (f.config["n_heads"], f.config["n_kv_heads"]) == (8, 1)
        assert f.metadata["chat_template"] == "{{ messages[0]['content'] }}"
        assert f.metadata["tokenizer"]["eos_ids"] == [2, 3, 4]


@pytest.mark.parametrize("overrides,window", [
    ({"model_type": "mistral", "sliding_window": None}, None),
    ({"model_type": "mistral", "sliding_window": 32}, 32),
    ({"model_type": "mistral"}, None),                          # transformers' default 4096: beyond the context
    ({"model_type": "mistral", "sliding_window": 128}, None),   # as long as the context: no window
    ({"model_type": "llama", "sliding_window": 32}, None),      # Llama has none
])
def test_sliding_window_as_transformers_reads_it(tmp_path, overrides, window):
    src = tmp_path / "ckpt"
    write_hf_llama(src, **overrides)
    with open_tinf(convert(src, tmp_path / "m.tinf")) as f:
        assert f.config["architecture"] == "llama" and f.config["qkv_bias"] is False
        assert f.config["sliding_window"] == window


@pytest.mark.parametrize("overrides,window", [
    ({}, None),
    ({"sliding_window": 32}, None),                                       # used only with use_sliding_window
    ({"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 0}, 32),
    ({"use_sliding_window": True, "sliding_window": 32, "max_window_layers": 2}, None),   # no layer has it
])
def test_qwen2_biases_and_window(tmp_path, overrides, window):
    src = tmp_path / "ckpt"
    weights = write_hf_llama(src, model_type="qwen2", tied=True, **overrides)
    out = convert(src, tmp_path / "m.tinf", quant="q8")
    with open_tinf(out) as f:
        assert f.config["qkv_bias"] is True and f.config["sliding_window"] == window
        assert f.names.index("layers.0.bqkv") == f.names.index("layers.0.wqkv") + 1
        assert f.info("layers.1.bqkv").encoding == "f32" and f.info("layers.1.bqkv").shape == (128,)
    assert_tinf_matches(out, expected_tensors(weights, {"n_layers": 2}))


def test_default_output_name(tmp_path, monkeypatch):
    write_hf_llama(tmp_path / "tiny-llama")
    monkeypatch.chdir(tmp_path)
    out = convert_checkpoint("tiny-llama", quant="q8", progress=False)
    assert out == Path("tiny-llama-q8.tinf") and (tmp_path / "tiny-llama-q8.tinf").is_file()


def test_logits_match_transformers(tmp_path):
    """The converted file run through the NumPy reference gives transformers' logits: checks the
    fused row order and RoPE convention end to end (f16 weights, so only rounding differs)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    src = tmp_path / "ckpt"
    write_hf_llama(src, dtype="f32", n_heads=4, n_kv_heads=2, n_layers=2)
    out = convert(src, tmp_path / "m.tinf", quant="f16", head="f16")
    ids = [1, 17, 42, 99, 5, 200, 31, 64]
    ours = tinf_logits(out, ids)
    model = transformers.LlamaForCausalLM.from_pretrained(src, torch_dtype=torch.float32)
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    scale = np.abs(theirs).max()
    assert np.abs(ours - theirs).max() < 2e-3 * scale
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))


# ------------------------------------------------------------------------------------ shared assets


def test_stories260k_hf(tmp_path, shared_assets):
    from tinyinfer.convert.safetensors_io import SafetensorsFile

    src = shared_assets / "derived" / "stories260K-hf"
    out = convert(src, tmp_path / "s.tinf", quant="q8")
    st = SafetensorsFile(src / "model.safetensors")
    weights = {name: st.read(name) for name in st.names}
    with open_tinf(out) as f:
        assert f.config["vocab_size"] == 512 and f.config["tied_embeddings"] is True
        tok = f.metadata["tokenizer"]
        assert tok["kind"] == "sentencepiece" and tok["tokenizer_model"] == (src / "tokenizer.model").read_bytes()
        assert tok["special_tokens"]["bos_token"] == "<s>" and tok["eos_ids"] == [2]
        config = f.config
    assert_tinf_matches(out, expected_tensors(weights, config))


def test_tinyllama_tokenizer_files(tmp_path, shared_assets):
    src = tmp_path / "ckpt"
    write_hf_llama(src, tokenizer="tinyllama", dim=32, n_heads=2, n_kv_heads=1, ffn_dim=64, n_layers=1)
    with open_tinf(convert(src, tmp_path / "m.tinf", head="f16")) as f:
        meta = f.metadata
    tok = meta["tokenizer"]
    assert tok["kind"] == "hf-json" and tok["tokenizer_model"] == (TINYLLAMA / "tokenizer.model").read_bytes()
    assert tok["special_tokens"] == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
                                     "pad_token": "</s>"}
    assert "<|assistant|>" in meta["chat_template"]


# ------------------------------------------------------------------------------------ refused inputs


def break_config(**changes):
    def apply(src: Path):
        config = json.loads((src / "config.json").read_text())
        config.update(changes)
        (src / "config.json").write_text(json.dumps(config))
    return apply


def edit_index(change):
    def apply(src: Path):
        index = json.loads((src / "model.safetensors.index.json").read_text())
        change(index["weight_map"])
        (src / "model.safetensors.index.json").write_text(json.dumps(index))
    return apply


def edit_tensors(edit):
    """A mutation rewriting the single-file checkpoint with edit(arrays) applied to its tensors."""
    def apply(src: Path):
        from checkpoints import write_safetensors
        from tinyinfer.convert.safetensors_io import SafetensorsFile
        st = SafetensorsFile(src / "model.safetensors")
        arrays = {n: st.read(n) for n in st.names}
        edit(arrays)
        write_safetensors(src / "model.safetensors", arrays, "f32")
    return apply


def drop_tensor(name):
    """Rewrite the single-file checkpoint without one tensor."""
    return edit_tensors(lambda arrays: arrays.pop(name, None))


def add_tensor(name, shape):
    def edit(arrays):
        arrays[name] = np.zeros(shape, np.float32)
    return edit_tensors(edit)


def set_value(name, value):
    def edit(arrays):
        arrays[name].flat[3] = value
    return edit_tensors(edit)


def remove(filename):
    return lambda src: (src / filename).unlink()


BAD_INPUTS = {
    "no config": (remove("config.json"), "has no config.json", {}),
    "architecture": (break_config(model_type="gpt_neox"), "model_type 'gpt_neox' is not supported", {}),
    "rope scaling": (break_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "'yarn' is not supported", {}),
    "attention bias": (break_config(attention_bias=True), "attention_bias=true is not supported", {}),
    "mlp bias": (break_config(mlp_bias=True), "mlp_bias=true is not supported", {}),
    "activation": (break_config(hidden_act="gelu"), "hidden_act 'gelu'", {}),
    "mixed windows": (break_config(model_type="qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1),
                      "some layers use a sliding window and others full attention", {}),
    "bad window": (break_config(model_type="mistral", sliding_window=0), "sliding_window 0 is not a positive", {}),
    "quantized": (break_config(quantization_config={"quant_method": "gptq"}), "already-quantized", {}),
    "shape": (break_config(intermediate_size=100), "has shape [96, 64] where the config implies [100, 64]", {}),
    "missing tensor": (drop_tensor("model.layers.1.mlp.up_proj.weight"), "tensor model.layers.1.mlp.up_proj.weight is missing", {}),
    "bias tensor": (add_tensor("model.layers.0.self_attn.q_proj.bias", (64,)), "bias tensors such as", {}),
    "no weights": (remove("model.safetensors"), "only safetensors checkpoints", {}),
    "no tokenizer": (remove("tokenizer.json"), "neither tokenizer.json nor tokenizer.model", {}),
    "tokenizer too big": (break_config(vocab_size=200), "the tokenizer has 256 tokens but the model only 200", {}),
    "nan": (set_value("model.layers.0.mlp.down_proj.weight", np.nan), "NaN or infinite", {}),
    "f16 overflow": (set_value("model.layers.1.self_attn.o_proj.weight", 1e5), "beyond the f16 range", {"quant": "f16"}),
    "bad quant": (lambda src: None, "unknown quantization 'q3'", {"quant": "q3"}),
    "bad group": (lambda src: None, "group size 48 is not supported", {"group_size": 48}),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_refused_with_one_sentence_and_no_output(tmp_path, case):
    breaker, fragment, kwargs = BAD_INPUTS[case]
    src = tmp_path / "ckpt"
    write_hf_llama(src, dtype="f32")
    breaker(src)
    with pytest.raises(ConvertError) as info:
        convert(src, tmp_path / "out" / "m.tinf", **kwargs)
    assert fragment in str(info.value)
    assert_one_sentence(str(info.value))
    if (tmp_path / "out").exists():
        assert_nothing_written(tmp_path / "out")


SHARDED_BAD = {
    "shard missing": (remove("model-00002-of-00003.safetensors"), "shard model-00002-of-00003.safetensors named in"),
    "path outside": (edit_index(lambda m: m.update({"model.norm.weight": "../elsewhere.safetensors"})),
                     "names shard '../elsewhere.safetensors', which is not a .safetensors file inside"),
    "absolute path": (edit_index(lambda m: m.update({"model.norm.weight": "/etc/passwd"})), "names shard '/etc/passwd'"),
    "dot-dot name": (edit_index(lambda m: m.update({"model.norm.weight": "sub/../model-00003-of-00003.safetensors"})),
                     "names shard 'sub/../model-00003-of-00003.safetensors'"),
    "backslash dot-dot": (edit_index(lambda m: m.update({"model.norm.weight": "..\\elsewhere.safetensors"})),
                          "which is not a .safetensors file inside"),
    "tensor in wrong shard": (edit_index(lambda m: m.update({"model.norm.weight": "model-00001-of-00003.safetensors"})),
                              "which does not contain it"),
    "tensor not in index": (edit_index(lambda m: m.pop("lm_head.weight")), "tensor lm_head.weight is missing"),
}


@pytest.mark.parametrize("case", list(SHARDED_BAD))
def test_bad_index_refused(tmp_path, case):
    breaker, fragment = SHARDED_BAD[case]
    src = tmp_path / "ckpt"
    write_hf_llama(src, shards=3)
    (tmp_path / "elsewhere.safetensors").write_bytes((src / "model-00003-of-00003.safetensors").read_bytes())
    breaker(src)
    with pytest.raises(ConvertError) as info:
        convert(src, tmp_path / "m.tinf")
    assert fragment in str(info.value)
    assert_one_sentence(str(info.value))
    assert_nothing_written(tmp_path)


def test_failure_while_writing_leaves_nothing(tmp_path, monkeypatch):
    src = tmp_path / "ckpt"
    write_hf_llama(src)
    calls = []

    def failing_encode(*args, **kwargs):
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return encode(*args, **kwargs)

    monkeypatch.setattr(pipeline, "encode", failing_encode)
    with pytest.raises(KeyboardInterrupt):
        convert(src, tmp_path / "m.tinf")
    assert len(calls) == 5
    assert_nothing_written(tmp_path)


def test_unknown_source(tmp_path):
    with pytest.raises(ConvertError, match="neither an existing folder"):
        convert(str(tmp_path / "missing" / "dir"), tmp_path / "m.tinf")


def test_options_that_do_not_apply(tmp_path):
    src = tmp_path / "ckpt"
    write_hf_llama(src)
    with pytest.raises(ConvertError, match="--revision only applies to Hub downloads"):
        convert(src, tmp_path / "m.tinf", revision="main")
    with pytest.raises(ConvertError, match="--tokenizer is only used with llama2.c"):
        convert(src, tmp_path / "m.tinf", tokenizer=src / "tokenizer.json")
    with pytest.raises(ConvertError, match="is a folder"):
        convert(src, tmp_path)
    with pytest.raises(ConvertError, match="PyTorch \\(zip\\) checkpoint"):
        (tmp_path / "pytorch_model.bin").write_bytes(b"PK\x03\x04" + bytes(300))
        convert(tmp_path / "pytorch_model.bin", tmp_path / "m.tinf", tokenizer=src / "tokenizer.json")
    assert_nothing_written(tmp_path)


# ---------------------------------------------------------------------------------------------- CLI


def test_cli_success_and_summary(tmp_path):
    src = tmp_path / "ckpt"
    write_hf_llama(src)
    out = tmp_path / "cli.tinf"
    result = CliRunner().invoke(main, [str(src), "-o", str(out), "--quant", "q8", "--group-size", "32",
                                       "--head", "f16", "--no-scale-search"])
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.stderr and "bits/weight" in result.stderr
    with open_tinf(out) as f:
        assert f.info("output").encoding == "f16" and f.info("layers.0.wo").group == 32
        assert f.metadata["provenance"]["scale_search"] is False


def test_cli_error_is_one_line(tmp_path):
    result = CliRunner().invoke(main, [str(tmp_path), "-o", str(tmp_path / "x.tinf")])
    assert result.exit_code == 1
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1
    assert "Traceback" not in result.output


# ---------------------------------------------------------------------------------------------- Hub


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    import huggingface_hub

    remote = tmp_path / "remote"
    write_hf_llama(remote, shards=2)
    (remote / "pytorch_model.bin").write_bytes(b"not needed")
    (remote / "consolidated.safetensors").write_bytes(b"not needed either")
    fake = SnapshotDownload(remote, tmp_path / "cache")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    return fake


def test_hub_downloads_only_needed_files(tmp_path, fake_hub, monkeypatch):
    """A sharded checkpoint laid out as the Hub cache does (every shard a relative link into
    ../../blobs/) converts, and only the shards the index names are fetched, at the metadata's commit."""
    monkeypatch.chdir(tmp_path)
    out = convert_checkpoint("someone/tiny-llama", revision="main", token="hf_x", progress=False)
    assert out == Path("tiny-llama-q4.tinf")
    metadata_call, weights_call = fake_hub.calls
    assert metadata_call["revision"] == "main" and metadata_call["token"] == "hf_x"
    assert not any(p.endswith(".safetensors") for p in metadata_call["patterns"])
    assert weights_call["revision"] == SnapshotDownload.COMMIT      # weights pinned to the metadata's commit
    assert sorted(weights_call["patterns"]) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    snapshot = fake_hub.cache / "models--someone--tiny-llama" / "snapshots" / SnapshotDownload.COMMIT
    downloaded = {p.name for p in snapshot.iterdir()}
    assert "pytorch_model.bin" not in downloaded and "consolidated.safetensors" not in downloaded
    shard = snapshot / "model-00001-of-00002.safetensors"
    assert shard.is_symlink() and Path(os.readlink(shard)).parts[:2] == ("..", "..")
    with open_tinf(out) as f:
        assert f.metadata["provenance"]["source"] == "someone/tiny-llama"
        assert f.metadata["provenance"]["revision"] == SnapshotDownload.COMMIT


def test_sharded_checkpoint_through_the_real_hub_client(tmp_path):
    """tinyconvert ORG/REPO in a subprocess, huggingface_hub itself downloading from the FakeHub on
    127.0.0.1 into a fresh HF_HOME: its cache holds the shards as links into ../../blobs/, and they
    convert to the checkpoint's tensors."""
    import subprocess
    import sys

    from fake_hub import FakeHub, hub_env

    remote = tmp_path / "remote"
    weights = write_hf_llama(remote, shards=3, dtype="f32")
    with FakeHub() as server:
        commit = server.add_repo("org/sharded", {p.name: p.read_bytes() for p in remote.iterdir()})
        proc = subprocess.run([sys.executable, "-m", "tinyinfer.convert.cli", "org/sharded", "-o", "m.tinf",
                               "--quant", "f16"], cwd=tmp_path, env=hub_env(tmp_path / "hf", server.url),
                              capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    snapshot = tmp_path / "hf" / "hub" / "models--org--sharded" / "snapshots" / commit
    shards = sorted(snapshot.glob("*.safetensors"))
    assert len(shards) == 3 and all(p.is_symlink() and os.readlink(p).startswith("../../blobs/") for p in shards)
    assert_tinf_matches(tmp_path / "m.tinf", expected_tensors(weights, {"n_layers": 2}))


def test_hub_config_refused_before_weights_are_fetched(tmp_path, fake_hub):
    break_config(model_type="falcon")(fake_hub.remote)
    with pytest.raises(ConvertError, match="model_type 'falcon'"):
        convert("someone/tiny-llama", tmp_path / "m.tinf")
    assert len(fake_hub.calls) == 1          # only the small metadata files were requested


@pytest.mark.parametrize("error,fragment", [("RepositoryNotFoundError", "not found on the Hub"),
                                            ("GatedRepoError", "is gated"),
                                            ("RevisionNotFoundError", "does not exist in"),
                                            ("LocalEntryNotFoundError", "cannot download")])
def test_hub_errors_are_one_sentence(tmp_path, monkeypatch, error, fragment):
    import huggingface_hub
    from huggingface_hub import errors

    def raising(*args, **kwargs):
        cls = getattr(errors, error)
        exc = cls.__new__(cls)            # the HTTP errors' __init__ wants a real response object
        Exception.__init__(exc, "boom\nsecond line")
        raise exc

    monkeypatch.setattr(huggingface_hub, "snapshot_download", raising)
    with pytest.raises(ConvertError) as info:
        convert("someone/tiny-llama", tmp_path / "m.tinf", revision="v9")
    assert fragment in str(info.value)
    assert_one_sentence(str(info.value))


def test_repo_id_detection():
    assert hub.looks_like_repo_id("TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    assert not hub.looks_like_repo_id("a/b/c") and not hub.looks_like_repo_id("../x")


def test_add_bos_defaults_to_what_the_post_processor_does():
    """Without add_bos_token or add_eos_token in tokenizer_config.json, BOS is added only if
    tokenizer.json's template adds one; with either, exactly when add_bos_token is true (transformers)."""
    from tinyinfer.convert.tokenizer_files import adds_bos, default_add_bos

    def tokenizer_json(post_processor):
        return json.dumps({"post_processor": post_processor})

    llama = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}]}
    qwen = {"type": "ByteLevel"}
    assert default_add_bos(tokenizer_json(llama)) is True
    assert default_add_bos(tokenizer_json({"type": "Sequence", "processors": [qwen, llama]})) is True
    assert default_add_bos(tokenizer_json(qwen)) is False
    assert default_add_bos(tokenizer_json(None)) is False
    assert default_add_bos(None) is True   # bare sentencepiece model
    assert adds_bos({"add_bos_token": False}, tokenizer_json(llama)) is False
    assert adds_bos({"add_eos_token": True}, tokenizer_json(llama)) is False
    assert adds_bos({"add_bos_token": True}, tokenizer_json(qwen)) is True
