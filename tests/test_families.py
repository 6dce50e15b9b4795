"""Llama 3.x, Qwen2.5 and Mistral end to end on the CPU, against transformers.

Each family is a random model built with transformers' own class at the real model's vocabulary and
head layout (dims and layers scaled down), its weights rounded to fp16 values so that the f16 file
holds exactly the same numbers, saved with a tokenizer and chat template of the real structure
(tokenizer_samples.py; Mistral with the shared Llama 2 tokenizer, which Mistral-7B's resembles),
config.json and generation_config.json as the real repos have them, and converted by tinyconvert:
- the chat prompt's ids are apply_chat_template's;
- the prompt's logits are transformers' (float32 arithmetic differs: relative error <= 1e-4, the
  same argmax everywhere; Mistral's prompt crosses its window of 16 positions);
- greedy generation gives transformers' greedy tokens and text;
- every end-of-sequence id of config.json and generation_config.json stops generation.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from checkpoints import TINYLLAMA, randomize_llama_weights  # noqa: E402
from tinyinfer.convert import convert_checkpoint  # noqa: E402
from tinyinfer.runtime import Model, SamplingParams, load  # noqa: E402
from tinyinfer.runtime.backend import Backend  # noqa: E402
from tokenizer_samples import write_llama3_tokenizer, write_qwen2_tokenizer  # noqa: E402

N_NEW = 12
MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name three colours, then count from one to twelve in words, please."}]
LLAMA32_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
FAMILIES = {
    # Llama-3.2-1B: 4 query heads per KV head of 64, vocabulary 128,256, theta 500000 with llama3 scaling, tied
    "llama-3.2": dict(model="LlamaForCausalLM", config="LlamaConfig", tokenizer="llama3",
                      shape=dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=1,
                                 vocab_size=128256, rope_theta=500000.0, rope_scaling=LLAMA32_ROPE,
                                 tie_word_embeddings=True, bos_token_id=128000, eos_token_id=[128001, 128008, 128009]),
                      generation={"bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
                                  "do_sample": True, "temperature": 0.6, "top_p": 0.9}),
    # Qwen2.5-0.5B: 7 query heads per KV head of 64, 151,936 embeddings for 151,665 tokens, theta 1e6, tied, biases
    "qwen-2.5": dict(model="Qwen2ForCausalLM", config="Qwen2Config", tokenizer="qwen2",
                     shape=dict(hidden_size=448, intermediate_size=608, num_attention_heads=7, num_key_value_heads=1,
                                vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True,
                                bos_token_id=151643, eos_token_id=151645),
                     generation={"bos_token_id": 151643, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
                                 "do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                 "repetition_penalty": 1.05}),
    # Mistral-7B: 4 query heads per KV head of 128, vocabulary 32,000, theta 1e4, a window (16 here, 4096 there)
    "mistral": dict(model="MistralForCausalLM", config="MistralConfig", tokenizer="llama2",
                    shape=dict(hidden_size=256, intermediate_size=512, head_dim=128, num_attention_heads=4,
                               num_key_value_heads=1, vocab_size=32000, rope_theta=10000.0, sliding_window=16,
                               tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
                    generation={"bos_token_id": 1, "eos_token_id": 2}),
}


def write_tokenizer(kind: str, folder) -> None:
    if kind == "llama3":
        write_llama3_tokenizer(folder)
    elif kind == "qwen2":
        write_qwen2_tokenizer(folder)
    else:    # the Llama 2 tokenizer as TinyLlama ships it (with its chat template), declared LlamaTokenizer
        if not TINYLLAMA.is_dir():
            pytest.skip(f"test assets not found at {TINYLLAMA}")
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copyfile(TINYLLAMA / name, folder / name)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, folder, transformers model, AutoTokenizer, converted f16 Model)."""
    spec = FAMILIES[request.param]
    config = getattr(transformers, spec["config"])(num_hidden_layers=2, max_position_embeddings=2048,
                                                   rms_norm_eps=1e-5, **spec["shape"])
    torch.manual_seed(3)
    hf_model = getattr(transformers, spec["model"])(config).float().eval()
    randomize_llama_weights(hf_model)
    with torch.no_grad():
        for p in hf_model.parameters():
            if p.ndim == 2:
                p.copy_(p.half().float())        # the values an f16 file holds exactly
    folder = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(folder, safe_serialization=True)
    (folder / "generation_config.json").write_text(json.dumps(spec["generation"]))
    write_tokenizer(spec["tokenizer"], folder)
    path = convert_checkpoint(folder, out=folder / "model-f16.tinf", quant="f16", progress=False)
    return (request.param, folder, hf_model, transformers.AutoTokenizer.from_pretrained(str(folder)),
            load(path, device="cpu"))


def chat_ids(reference, messages) -> list[int]:
    ids = reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_chat_prompt_ids_are_transformers(family):
    name, _, _, reference, model = family
    ours = model.prompt_ids(MESSAGES)
    expected = chat_ids(reference, MESSAGES)
    if name == "mistral":    # the Llama 2 template writes no BOS: tinyinfer adds the one the model wants
        expected = [1] + expected
    assert ours == expected
    assert len(ours) > 40      # Mistral's prompt crosses its 16-position window more than twice


def test_prompt_logits_match_transformers(family):
    name, _, hf_model, _, model = family
    ids = model.prompt_ids(MESSAGES)
    ours = model.logits(ids)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0].numpy()
    errors = np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)
    agree = np.mean(ours.argmax(-1) == theirs.argmax(-1))
    print(f"{name}: {len(ids)} positions, max abs error {np.abs(ours - theirs).max():.2e}, max relative error "
          f"{errors.max():.2e}, argmax agrees at {agree:.0%}")
    assert ours.shape == theirs.shape == (len(ids), hf_model.config.vocab_size)
    assert errors.max() <= 1e-4
    assert agree == 1.0


def test_greedy_generation_is_transformers(family):
    name, _, hf_model, reference, model = family
    ids = model.prompt_ids(MESSAGES)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, min_new_tokens=N_NEW,
                                eos_token_id=None, pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    tokens = list(model.backend.generate_ids(ids, 0, SamplingParams(), N_NEW, np.random.default_rng(0)))
    assert tokens == expected
    # The streamed text is the continuation as transformers decodes it after the prompt (in context:
    # a first "▁word" keeps its space, which decoding the new ids alone would strip).
    text = "".join(model.generate(MESSAGES, max_tokens=N_NEW, temperature=0.0))
    stopped = next((i for i, t in enumerate(expected) if t in model.tokenizer.eos_ids), N_NEW)
    prompt_text = reference.decode(ids, skip_special_tokens=True)
    assert text == reference.decode(ids + expected[:stopped], skip_special_tokens=True)[len(prompt_text):]


class ScriptedBackend(Backend):
    """Generates a fixed list of ids (the runtime's stopping rules are what is tested)."""

    def __init__(self, script, vocab: int):
        self.script, self.vocab, self.max_context = script, vocab, 4096

    def forward(self, token_ids, start_pos):
        logits = np.zeros((len(token_ids), self.vocab), np.float32)
        logits[:, self.script[0]] = 1.0
        return logits

    def reset(self) -> None:
        pass

    def generate_ids(self, prompt_ids, start_pos, params, max_new_tokens, rng):
        yield from self.script[:max_new_tokens]


def test_every_end_of_sequence_id_stops_generation(family):
    """config.json's and generation_config.json's eos_token_id lists, all of them."""
    name, folder, _, _, model = family
    config = json.loads((folder / "config.json").read_text())
    generation = json.loads((folder / "generation_config.json").read_text())
    expected = {*np.atleast_1d(config["eos_token_id"]).tolist(), *np.atleast_1d(generation["eos_token_id"]).tolist()}
    assert model.tokenizer.eos_ids == expected
    words = model.tokenizer.encode(" one two three", add_bos=False)
    for eos in sorted(expected):
        scripted = Model(model.tinf, ScriptedBackend(words + [eos] + words, model.config["vocab_size"]), model.tokenizer)
        assert "".join(scripted.generate("x", max_tokens=30)).strip() == "one two three"
        assert scripted.last_stats["stop_reason"] == "eos" and scripted.last_stats["new_tokens"] == len(words) + 1
