"""SmolLM2-135M-Instruct, a real trained chat model, from its GGUF file (../shared/assets) against
transformers loading the same file with gguf_file= (it dequantizes every tensor to float32 with
gguf.quants, as the converter does).

Measured on CPU (NumPy backend, 64 chat-template positions):
- --quant f16 against transformers' float32 model: max relative logit error 3.1e-3 (weights and the
  Q8_0 embedding rounded to fp16), argmax equal everywhere; asserted <= 5e-3.
- the default conversion against transformers holding the .tinf's own dequantized weights: 7e-6 to
  1.3e-5 (float32 arithmetic only, over 30 layers); asserted <= 3e-5.
Tensors whose GGML blocks copy exactly (the tied head's Q8_0 as q8) equal transformers' weights bit
for bit.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from test_gguf import TRICKY  # noqa: E402

from tinyinfer.convert import convert_checkpoint  # noqa: E402
from tinyinfer.convert.gguf_blocks import exact_encodings  # noqa: E402
from tinyinfer.convert.gguf_checkpoint import open_gguf  # noqa: E402
from tinyinfer.runtime import load  # noqa: E402
from tinyinfer.runtime.chat import encode_chat, render_chat  # noqa: E402
from tinyinfer.runtime.sampling import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow
FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3? Answer with digits.\n"}],
]


@pytest.fixture(scope="module")
def folder(shared_assets):
    path = shared_assets / "smollm2-135m-instruct"
    if not (path / FILE).is_file():
        pytest.skip(f"{FILE} not found in {path}")
    return path


@pytest.fixture(scope="module")
def hf(folder):
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=FILE, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=FILE)
    return model, tokenizer


@pytest.fixture(scope="module")
def converted(folder, tmp_path_factory):
    """quant -> the converted model on the NumPy backend, converted and loaded once per module (the
    backend keeps its dequantized weights). Scale search only changes re-quantized tensors: skipped."""
    out, cache = tmp_path_factory.mktemp("smollm2"), {}

    def get(quant):
        if quant not in cache:
            path = convert_checkpoint(folder / FILE, out / f"{quant}.tinf", quant=quant, scale_search=False,
                                      progress=False)
            cache[quant] = load(path, device="cpu")
        return cache[quant]
    return get


@pytest.fixture(scope="module")
def prompt_ids(hf):
    _, tokenizer = hf
    text = tokenizer.apply_chat_template(CONVERSATIONS[2] + [{"role": "assistant", "content": "6, and the "
                                         "capital of France is Paris. Anything else?"}], tokenize=False)
    return tokenizer.encode(text)[:64]


def transformers_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


def relative_errors(ours, theirs):
    return np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)


def report(label, ours, theirs):
    errors = relative_errors(ours, theirs)
    agree = float((ours.argmax(-1) == theirs.argmax(-1)).mean())
    print(f"SmolLM2 {label}: max abs {np.abs(ours - theirs).max():.3g}, max relative {errors.max():.3g}, "
          f"argmax agreement {agree:.3f}")
    return errors, agree


def test_f16_logits_match_transformers(hf, converted, prompt_ids):
    model = converted("f16")
    ours, theirs = model.logits(prompt_ids), transformers_logits(hf[0], prompt_ids)
    errors, agree = report("f16 vs transformers", ours, theirs)
    assert len(prompt_ids) == 64 and errors.max() <= 5e-3 and agree == 1.0


def dequantized_reference(hf_model, tinf):
    """A copy of transformers' model holding exactly the .tinf file's dequantized weights, its head untied."""
    c = tinf.config
    model = copy.deepcopy(hf_model)
    w = lambda name: torch.from_numpy(tinf.tensor(name).to_float32().copy())  # noqa: E731
    q, kv, ffn = c["n_heads"] * c["head_dim"], c["n_kv_heads"] * c["head_dim"], c["ffn_dim"]
    state = {"model.embed_tokens.weight": w("tok_embeddings"), "model.norm.weight": w("norm")}
    for i in range(c["n_layers"]):
        p = f"model.layers.{i}."
        wqkv, gate_up = w(f"layers.{i}.wqkv"), w(f"layers.{i}.w_gate_up")
        state.update({p + "self_attn.q_proj.weight": wqkv[:q], p + "self_attn.k_proj.weight": wqkv[q:q + kv],
                      p + "self_attn.v_proj.weight": wqkv[q + kv:], p + "self_attn.o_proj.weight": w(f"layers.{i}.wo"),
                      p + "mlp.gate_proj.weight": gate_up[:ffn], p + "mlp.up_proj.weight": gate_up[ffn:],
                      p + "mlp.down_proj.weight": w(f"layers.{i}.w_down"),
                      p + "input_layernorm.weight": w(f"layers.{i}.attn_norm"),
                      p + "post_attention_layernorm.weight": w(f"layers.{i}.ffn_norm")})
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            parameters[name].copy_(value)
    model.lm_head.weight = torch.nn.Parameter(w("output"))   # the file quantizes its head on its own
    return model


def test_logits_are_arithmetic_only_against_the_files_own_weights(hf, converted, prompt_ids):
    quant = None
    model = converted(quant)
    ours = model.logits(prompt_ids)
    errors, agree = report(f"{quant or 'default'} vs transformers with the file's weights", ours,
                           transformers_logits(dequantized_reference(hf[0], model.tinf), prompt_ids))
    assert errors.max() <= 3e-5 and agree == 1.0
    report(f"{quant or 'default'} vs transformers", ours, transformers_logits(hf[0], prompt_ids))


def test_exactly_copied_tensors_equal_transformers_weights(folder, hf, converted):
    """Every tensor whose GGML type maps onto its .tinf encoding holds transformers' float32 weights bit for bit."""
    checkpoint = open_gguf(folder / FILE)
    state = hf[0].state_dict()
    c = checkpoint.config
    q, kv, ffn = c["n_heads"] * c["head_dim"], c["n_kv_heads"] * c["head_dim"], c["ffn_dim"]

    def hf_tensor(name):
        if name == "output":
            return state["lm_head.weight"]
        i, kind = name.split(".")[1:]
        p = f"model.layers.{i}."
        parts = {"wqkv": ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], "wo": ["self_attn.o_proj"],
                 "w_gate_up": ["mlp.gate_proj", "mlp.up_proj"], "w_down": ["mlp.down_proj"]}[kind]
        return torch.cat([state[p + part + ".weight"] for part in parts])

    load_tinf = converted(None).tinf
    compared = 0
    for name in load_tinf.names:
        info = load_tinf.info(name)
        if name == "tok_embeddings" or len(info.shape) != 2:
            continue
        if all((info.encoding, info.group) in exact_encodings(t) for t in checkpoint.source_types(name)):
            np.testing.assert_array_equal(load_tinf.tensor(name).to_float32(), hf_tensor(name).numpy(), err_msg=name)
            compared += 1
    assert compared >= 1 and q and kv and ffn


def test_tokenizer_matches_transformers(hf, converted, shared_assets):
    _, theirs = hf
    ours = converted("f16").tokenizer
    text = (shared_assets / "text" / "wikitext-2-raw-wiki.test.raw").read_text(encoding="utf-8")
    corpus = TRICKY + [line for line in text.splitlines() if line.strip()][:200] + [text[:20000]]
    for sample in corpus:
        assert ours.encode(sample) == theirs.encode(sample), sample[:80]
        assert ours.decode(ours.encode(sample)) == theirs.decode(theirs.encode(sample), skip_special_tokens=True)


def test_chat_template_matches_transformers(hf, converted):
    _, theirs = hf
    model = converted("f16")
    for messages in CONVERSATIONS:
        for generation_prompt in (True, False):
            want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
            assert render_chat(model.chat_template, messages, model.tokenizer.special_tokens,
                               add_generation_prompt=generation_prompt) == want
            ids = encode_chat(model.tokenizer, model.chat_template, messages, generation_prompt)
            assert ids == theirs.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt,
                                                     return_dict=False)


def until_eos(ids, model) -> list[int]:
    kept = []
    for token in ids:
        if token in model.tokenizer.eos_ids:
            break
        kept.append(int(token))
    return kept


@pytest.mark.parametrize("question,answer_part", [
    ("What is the capital of France?", "The capital of France is Paris."),
    ("Write three sentences about the ocean.", None),
])
def test_greedy_generation_matches_transformers(hf, converted, question, answer_part):
    hf_model, hf_tokenizer = hf
    model = converted("f16")
    ids = model.prompt_ids([{"role": "user", "content": question}])
    model.backend.reset()
    ours = until_eos(model.backend.generate_ids(ids, 0, SamplingParams(), 36, np.random.default_rng(0)), model)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=36, do_sample=False)
    theirs = until_eos(out[0, len(ids):].tolist(), model)
    assert ours == theirs
    text = model.tokenizer.decode(ours)
    print(f"SmolLM2 greedy ({len(ours)} tokens): {text!r}")
    if answer_part:
        assert answer_part in text
    else:
        assert len(ours) >= 32
