"""The whole model on the GPU against the NumPy reference and against transformers.

Random models have the real TinyLlama-1.1B and Llama-2-7B layer shapes (hidden, heads, KV heads,
FFN, vocab) but only 2 layers: the shapes are what the kernels care about, and 2 layers keep the
NumPy reference fast. Logits are compared at 64 positions: ||gpu - ref|| / ||ref|| <= 1e-3 at every
position and the same argmax everywhere. Then: greedy and sampled generation give the reference's
tokens, and the trained stories260K model tells its story exactly in f16.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from checkpoints import randomize_llama_weights
from tinyinfer.formats import open_tinf
from tinyinfer.kernels import attention as attn_k
from tinyinfer.runtime import load
from tinyinfer.convert.pipeline import DEFAULT_GROUP
from tinyinfer.runtime.bench import synthetic_tokenizer, tinf_config, write_random_model
from tinyinfer.runtime.numpy_backend import NumpyBackend
from tinyinfer.runtime.sampling import SamplingParams

pytestmark = pytest.mark.gpu
N_POSITIONS = 64
MAX_ERROR = 1e-3
CONFIG_FILES = {"tinyllama": "tinyllama-1.1b-chat-v1.0/config.json", "llama-2-7b": "llama-2-7b-hf/config.json"}


def relative_errors(ours, theirs) -> np.ndarray:
    return np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)


def real_config(shared_assets, name: str, n_layers: int = 2) -> dict:
    hf = json.loads((shared_assets / CONFIG_FILES[name]).read_text())
    config = tinf_config(hf, n_layers=n_layers)
    config["max_context"] = 256
    return config


@pytest.fixture(scope="module", params=[(s, q) for s in CONFIG_FILES for q in ("q4", "q8", "f16")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def random_model(request, tmp_path_factory, shared_assets, cupy_gpu):
    shape, quant = request.param
    path = tmp_path_factory.mktemp("models") / f"{shape}-{quant}.tinf"
    write_random_model(path, real_config(shared_assets, shape), quant, DEFAULT_GROUP[quant], seed=len(shape) + len(quant))
    return shape, quant, path


def test_decode_logits_match_the_numpy_reference(random_model):
    shape, quant, path = random_model
    ids = np.random.default_rng(1).integers(0, 32000, N_POSITIONS)
    with load(path, device="cuda") as model:
        gpu = model.backend.decode_forward(ids, 0)      # the decode graph, one token per replay
    reference = NumpyBackend(open_tinf(path), max_context=N_POSITIONS).forward(ids, 0)
    errors = relative_errors(gpu, reference)
    print(f"{shape} {quant}: max relative error {errors.max():.2e}, mean {errors.mean():.2e}")
    assert gpu.shape == reference.shape == (N_POSITIONS, 32000)
    assert errors.max() <= MAX_ERROR
    assert np.array_equal(gpu.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("shape,quant", [("tinyllama", "q4"), ("llama-2-7b", "f16")])
def test_decode_with_split_k_gemvs_matches_the_numpy_reference(shared_assets, tmp_path, cupy_gpu, shape, quant):
    """The o and down projections in split-K clusters inside the captured graph (with PDL), whatever
    the tuner would pick on this GPU (the MLP unfused, so that the down projection is a GEMV)."""
    from dataclasses import replace

    from tinyinfer.kernels import gemv as gemv_k

    path = tmp_path / "m.tinf"
    write_random_model(path, real_config(shared_assets, shape), quant, DEFAULT_GROUP[quant], seed=7)
    ids = np.random.default_rng(2).integers(0, 32000, 16)
    with load(path, device="cuda") as model:
        backend = model.backend
        if not gemv_k.can_split(backend.shapes["w_down"], backend.compute_capability):
            pytest.skip("thread-block clusters need compute capability 9.0")
        backend.use_tuning({role: replace(config, split=2) if gemv_k.can_split(backend.shapes[role],
                                                                                 backend.compute_capability) else config
                            for role, config in backend.tuning.items() if role != "mlp"})   # the MLP as GEMVs
        assert backend.tuning["wo"].split == backend.tuning["w_down"].split == 2
        gpu = backend.decode_forward(ids, 0)
    reference = NumpyBackend(open_tinf(path), max_context=16).forward(ids, 0)
    errors = relative_errors(gpu, reference)
    assert errors.max() <= MAX_ERROR and np.array_equal(gpu.argmax(-1), reference.argmax(-1))


@pytest.mark.parametrize("shape,quant", [("tinyllama", "f16"), ("llama-2-7b", "q4")])
def test_decode_across_the_long_context_switch_matches_the_numpy_reference(shared_assets, tmp_path, cupy_gpu, shape,
                                                                          quant):
    """Positions on both sides of attn_plan.long_from, where the engine moves to the step graph whose
    attention spreads each KV head's rows over a cluster of blocks (before it, one block per KV
    head; after it, the cluster, through one more pass of one block's rows)."""
    path = tmp_path / "m.tinf"
    config = real_config(shared_assets, shape)
    config["max_context"] = 1024
    write_random_model(path, config, quant, DEFAULT_GROUP[quant], seed=5)
    with load(path, device="cuda") as model:
        plan = model.backend.attn_plan
        if plan.long_from == 0:
            pytest.skip("no long-context attention on this GPU (thread-block clusters need compute capability 9.0)")
        n = plan.long_from + attn_k.mma_pass_rows(config["head_dim"]) + 5
        ids = np.random.default_rng(3).integers(0, 32000, n)
        gpu = model.backend.decode_forward(ids, 0)
    reference = NumpyBackend(open_tinf(path), max_context=n).forward(ids, 0)
    errors = relative_errors(gpu, reference)
    print(f"{shape} {quant}, {n} positions ({plan.long_slices} blocks per KV head from {plan.long_from}): "
          f"max relative error {errors[:plan.long_from].max():.2e} before, {errors[plan.long_from:].max():.2e} from it")
    assert errors.max() <= MAX_ERROR
    # The same greedy token wherever the reference's top two logits are not a near-tie (random
    # weights over hundreds of positions give a few ties closer than 3e-3 of the logits' RMS).
    top2 = np.sort(reference, axis=-1)[:, -2:]
    near_tie = top2[:, 1] - top2[:, 0] <= 3e-3 * np.sqrt(np.mean(reference ** 2, axis=-1))
    mismatch = gpu.argmax(-1) != reference.argmax(-1)
    print(f"  argmax differs at {mismatch.sum()} positions, near-ties at {near_tie.sum()}")
    assert not np.any(mismatch & ~near_tie)


@pytest.fixture(scope="module")
def tinyllama_q4(tmp_path_factory, shared_assets, cupy_gpu):
    path = tmp_path_factory.mktemp("gen") / "tinyllama-q4.tinf"
    return write_random_model(path, real_config(shared_assets, "tinyllama"), "q4", DEFAULT_GROUP["q4"], seed=11)


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(repetition_penalty=1.2),
                                    SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1),
                                    SamplingParams(temperature=1.0, min_p=0.05)], ids=str)
def test_device_generation_is_the_reference_sampler_on_the_gpu_logits(tinyllama_q4, params):
    """generate_ids (graph replays, device sampler, token feedback, one draw per token) gives exactly
    the tokens sample() picks from the decode engine's own logits along the same path. (The logits
    themselves are checked against NumPy above; comparing sampled tokens across backends would
    compare where 1e-4 logit differences fall against the draws' cumulative boundaries.)"""
    from tinyinfer.runtime.sampling import sample

    prompt = [1, 523, 9077, 42, 3001, 15]
    with load(tinyllama_q4, device="cuda") as model:
        rng = np.random.default_rng(7)
        gpu = list(model.backend.generate_ids(prompt, 0, params, 24, rng))
        next_draw = rng.random()
        logits = model.backend.decode_forward(prompt + gpu[:-1], 0)[len(prompt) - 1:]
    draws = np.random.default_rng(7)
    history, expected = list(prompt), []
    for step in range(24):
        expected.append(sample(logits[step], params, history, draws.random()))
        history.append(gpu[step])
    assert gpu == expected
    assert next_draw == draws.random()        # one draw per token, like the reference loop


def test_stopping_early_consumes_one_draw_per_token(tinyllama_q4):
    with load(tinyllama_q4, device="cuda") as model:
        rng = np.random.default_rng(3)
        taken = []
        for token in model.backend.generate_ids([1, 2, 3], 0, SamplingParams(temperature=1.0), 50, rng):
            taken.append(token)
            if len(taken) == 5:
                break
        after = rng.random()
        again = list(model.backend.generate_ids([1, 2, 3], 0, SamplingParams(temperature=1.0), 5,
                                                np.random.default_rng(3)))
    expected = np.random.default_rng(3)
    expected.random(5)
    assert after == expected.random()
    assert taken == again


def test_stories260k_story_exact_in_f16(shared_assets, tmp_path, cupy_gpu):
    from tinyinfer.convert import convert_checkpoint

    folder = shared_assets / "llama2c-stories260K"
    doc = (folder / "stories260K.md").read_text(encoding="utf-8")
    expected = re.search(r"-t 0\.0\n(.*?)\n```", doc, re.S).group(1)
    path = convert_checkpoint(folder / "stories260K.bin", out=tmp_path / "stories-f16.tinf", quant="f16",
                              tokenizer=folder / "tok512.model", progress=False)
    with load(path, device="cuda") as model:
        story = "".join(model.generate("", max_tokens=256, temperature=0.0))
        assert model.last_stats["new_tokens"] == 256
    assert story == expected


def test_tinyllama_shaped_f16_matches_transformers_on_the_gpu(shared_assets, tmp_path, cupy_gpu):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA here")
    from tinyinfer.convert import convert_checkpoint

    hf = json.loads((shared_assets / CONFIG_FILES["tinyllama"]).read_text())
    config = transformers.LlamaConfig(
        hidden_size=hf["hidden_size"], intermediate_size=hf["intermediate_size"], num_hidden_layers=2,
        num_attention_heads=hf["num_attention_heads"], num_key_value_heads=hf["num_key_value_heads"],
        vocab_size=hf["vocab_size"], max_position_embeddings=256, rms_norm_eps=hf["rms_norm_eps"],
        rope_theta=hf.get("rope_theta", 10000.0), tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).float().eval()
    randomize_llama_weights(hf_model)
    folder = tmp_path / "hf"
    hf_model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(synthetic_tokenizer(config.vocab_size)["tokenizer_json"])
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    path = convert_checkpoint(folder, out=tmp_path / "tl-f16.tinf", quant="f16", progress=False)
    ids = np.random.default_rng(2).integers(0, config.vocab_size, N_POSITIONS).tolist()
    torch.backends.cuda.matmul.allow_tf32 = False
    with torch.no_grad():
        theirs = hf_model.cuda()(torch.tensor([ids], device="cuda")).logits[0].float().cpu().numpy()
    with load(path, device="cuda") as model:
        ours = model.backend.decode_forward(ids, 0)
    errors = relative_errors(ours, theirs)
    print(f"tinyllama-shaped f16 vs transformers (CUDA, float32): max relative error {errors.max():.2e}")
    assert errors.max() <= MAX_ERROR
    assert np.array_equal(ours.argmax(-1), theirs.argmax(-1))


def test_verify_command_passes(tinyllama_q4):
    from tinyinfer.runtime.verify import run_verify

    result = run_verify(tinyllama_q4, 8)
    assert result["max_relative_error"] <= MAX_ERROR and not result["mismatches"]


def test_bench_reports_every_kernel(tinyllama_q4, tmp_path):
    from tinyinfer.runtime.bench import run_bench

    with load(tinyllama_q4, device="cuda") as model:
        result = run_bench(model, 32, 8, 1, json_path=tmp_path / "bench.json")
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["tok_s"] == result["tok_s"] > 0
    assert {row["kernel"] for row in result["kernels"]} >= {"gemv wqkv", "gemv output", "sample+embed"}
    assert 0 < result["pct_of_read_bandwidth"] < 100


def test_second_load_reuses_the_tuning(tinyllama_q4, tmp_path, monkeypatch):
    monkeypatch.setenv("TINYINFER_CACHE_DIR", str(tmp_path))
    with load(tinyllama_q4, device="cuda") as first:
        assert first.backend.tuning_source == "measured"
        chosen = first.backend.tuning
    with load(tinyllama_q4, device="cuda") as second:
        assert second.backend.tuning_source == "cache"
        assert second.backend.tuning == chosen
