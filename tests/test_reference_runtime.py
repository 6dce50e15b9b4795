"""The NumPy runtime on a random model: KV cache, generation loop, stops, context checks, devices."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from tinyinfer.formats import FormatError
from tinyinfer.runtime import Model, SamplingParams, load
from tinyinfer.runtime import numpy_backend
from tinyinfer.runtime.backend import Backend
from tinyinfer.runtime.errors import ChatTemplateError, ContextOverflowError, DeviceError, LoadError
from tinyinfer.runtime.perplexity import log_softmax, perplexity

REPO = Path(__file__).resolve().parents[1]


def demo_module():
    spec = importlib.util.spec_from_file_location("demo_offline", REPO / "examples" / "demo_offline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def random_model_path(tmp_path_factory):
    from tinyinfer.convert import convert_checkpoint

    folder = demo_module().write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "random", max_context=96)
    return convert_checkpoint(folder, out=folder.parent / "random-q8.tinf", quant="q8", progress=False)


@pytest.fixture(scope="module")
def model(random_model_path):
    return load(random_model_path, device="cpu")


def test_prompt_batch_equals_token_by_token(model):
    ids = np.random.default_rng(0).integers(0, model.config["vocab_size"], 40)
    batch = model.logits(ids)
    assert batch.shape == (40, model.config["vocab_size"]) and batch.dtype == np.float32
    model.backend.reset()
    one_by_one = np.concatenate([model.backend.forward(ids[i:i + 1], i) for i in range(ids.size)])
    np.testing.assert_allclose(one_by_one, batch, rtol=1e-4, atol=1e-4)
    # a prompt in two chunks at different start positions gives the same logits too
    model.backend.reset()
    two_chunks = np.concatenate([model.backend.forward(ids[:17], 0), model.backend.forward(ids[17:], 17)])
    np.testing.assert_allclose(two_chunks, batch, rtol=1e-4, atol=1e-4)


def test_kv_cache_grows_without_changing_results(random_model_path, model, monkeypatch):
    monkeypatch.setattr(numpy_backend, "KV_CACHE_MIN_POSITIONS", 4)
    small = load(random_model_path, device="cpu")
    ids = np.random.default_rng(1).integers(0, model.config["vocab_size"], 50)
    chunks = [small.backend.forward(ids[i:i + 7], i) for i in range(0, 50, 7)]
    assert small.backend.k_cache.shape[1] == 56          # grown 7 -> 14 -> 28 -> 56 positions
    np.testing.assert_allclose(np.concatenate(chunks), model.logits(ids), rtol=1e-4, atol=1e-4)


def test_logits_start_from_an_empty_cache(model):
    ids = [5, 9, 2, 33]
    first = model.logits(ids)
    model.logits(list(range(50)))                  # fills the cache with something else
    np.testing.assert_array_equal(model.logits(ids), first)


def test_per_use_dequantization_gives_the_cached_results(random_model_path, model):
    uncached = load(random_model_path, device="cpu", weight_cache_bytes=0)
    assert not uncached.backend.cached_names and model.backend.cached_names
    ids = list(range(20))
    np.testing.assert_array_equal(uncached.logits(ids), model.logits(ids))


def test_greedy_generation_is_argmax_of_full_recomputation(model):
    prompt = model.tokenizer.encode("Once upon a time")
    ids = list(prompt)
    for _ in range(12):
        ids.append(int(np.argmax(model.logits(ids)[-1])))
    generated = list(model.backend.generate_ids(prompt, 0, SamplingParams(), 12, np.random.default_rng(0)))
    assert generated == ids[len(prompt):]
    text = "".join(model.generate("Once upon a time", max_tokens=12, stop=None))
    if not set(generated) & model.tokenizer.eos_ids:
        full = model.tokenizer.decode(ids)
        assert text == full[len(model.tokenizer.decode(prompt)):]


def test_same_seed_same_output(model):
    run = lambda seed: "".join(model.generate("The cat", max_tokens=30, temperature=1.0, seed=seed))
    assert run(7) == run(7)
    assert run(7) != run(8)


def test_chat_uses_the_template_and_system_message(model):
    ids = model.prompt_ids("Hello!", chat=True, system="Be nice.")
    text = model.tokenizer.decode(ids)
    assert ids[0] == model.tokenizer.bos_id and ids[1] != model.tokenizer.bos_id
    assert text.startswith("<|system|>\nBe nice.") and text.endswith("<|user|>\nHello!\n<|assistant|>\n")
    assert "".join(model.generate([{"role": "user", "content": "Hi"}], max_tokens=5)) is not None


def test_context_overflow_is_refused_before_any_work(model, monkeypatch):
    calls = []
    monkeypatch.setattr(model.backend, "forward", lambda *a: calls.append(a))
    with pytest.raises(ContextOverflowError, match="context of 96 tokens"):
        model.generate("hello", max_tokens=96)
    with pytest.raises(ContextOverflowError):
        model.logits(list(range(97)))
    assert calls == []


def test_default_max_tokens_fits_the_context(model):
    prompt = model.tokenizer.encode("hello " * 20)
    assert len(prompt) < 96
    list(model.generate("hello " * 20, temperature=1.0, seed=0))
    assert model.last_stats["prompt_tokens"] == len(prompt)
    assert model.last_stats["new_tokens"] <= 96 - len(prompt)


class ScriptedBackend(Backend):
    """Logits that force a given token sequence, to test the text side of generate()."""

    def __init__(self, script, vocab, max_context=64):
        self.script, self.vocab, self.max_context = list(script), vocab, max_context
        self.config = {"vocab_size": vocab}

    def reset(self):
        self.position = None

    def forward(self, token_ids, start_pos):
        rows = np.full((len(token_ids), self.vocab), -10.0, dtype=np.float32)
        step = start_pos + len(token_ids) - self.prompt_len
        rows[-1, self.script[min(step, len(self.script) - 1)]] = 10.0
        return rows

    def generate_ids(self, prompt_ids, start_pos, params, max_new_tokens, rng):
        self.prompt_len = start_pos + len(prompt_ids)   # prompt_ids may follow a reused cached prefix
        return super().generate_ids(prompt_ids, start_pos, params, max_new_tokens, rng)


def scripted_model(model, text, extra=()):
    script = model.tokenizer.encode(text, add_bos=False) + list(extra)
    scripted = Model(model.tinf, ScriptedBackend(script, model.config["vocab_size"]), model.tokenizer)
    return scripted, script


def test_stops_at_eos_without_printing_it(model):
    eos = min(model.tokenizer.eos_ids)
    scripted, script = scripted_model(model, "the cat sat", extra=[eos, 5, 6])
    assert "".join(scripted.generate("x", max_tokens=20)) == "the cat sat"
    assert scripted.last_stats["stop_reason"] == "eos"


def test_stop_strings_are_not_printed_even_across_tokens(model):
    scripted, script = scripted_model(model, "the cat sat on the mat and more")
    n = len(script)
    chunks = list(scripted.generate("x", max_tokens=n, stop=["on the m"]))
    assert "".join(chunks) == "the cat sat "
    assert scripted.last_stats["stop_reason"] == "stop_string"
    assert "".join(scripted.generate("x", max_tokens=n, stop=["zzz", "at on"])) == "the cat s"
    # a stop string that never completes: the held-back text comes out at the end
    assert "".join(scripted.generate("x", max_tokens=n, stop=["more!"])) == "the cat sat on the mat and more"
    assert "".join(scripted.generate("x", max_tokens=n, stop=["the"])) == ""


def test_max_tokens_counts_generated_tokens(model):
    scripted, script = scripted_model(model, "the cat sat on the mat")
    assert "".join(scripted.generate("x", max_tokens=3)) == model.tokenizer.decode(script[:3])
    assert scripted.last_stats["new_tokens"] == 3


def test_generation_defaults_follow_transformers_rules(model, monkeypatch):
    monkeypatch.setitem(model.metadata, "generation", {"temperature": 0.6, "top_p": 0.9})
    assert model.sampling_params() == SamplingParams()          # no do_sample: greedy, like transformers
    monkeypatch.setitem(model.metadata, "generation", {"do_sample": True, "temperature": 0.6, "top_p": 0.9})
    assert model.sampling_params() == SamplingParams(temperature=0.6, top_k=50, top_p=0.9)
    assert model.sampling_params(temperature=0.0, top_k=0).greedy


def test_device_errors(random_model_path):
    with pytest.raises(DeviceError, match="Unknown device"):
        load(random_model_path, device="tpu")
    from tinyinfer.runtime.model import cuda_backend_class

    if cuda_backend_class()[0] is None:
        with pytest.raises(DeviceError, match="No CUDA GPU is available"):
            load(random_model_path, device="cuda")
        assert type(load(random_model_path, device="auto").backend).__name__ == "NumpyBackend"


def test_load_errors(random_model_path, tmp_path):
    with pytest.raises(FormatError, match="no such file"):
        load(tmp_path / "missing.tinf")
    with pytest.raises(LoadError, match="folder"):
        load(tmp_path)
    truncated = tmp_path / "truncated.tinf"
    truncated.write_bytes(random_model_path.read_bytes()[:5000])
    with pytest.raises(FormatError):
        load(truncated)


def test_chat_without_template_is_a_clear_error(model, monkeypatch):
    monkeypatch.setattr(model, "chat_template", None)
    with pytest.raises(ChatTemplateError, match="no chat template"):
        model.generate([{"role": "user", "content": "hi"}])


def test_perplexity_is_exp_mean_nll(model):
    text = "the cat sat on the mat"
    ids = model.tokenizer.encode(text)
    logprobs = log_softmax(model.logits(ids[:-1]))
    nll = -np.mean([logprobs[i, ids[i + 1]] for i in range(len(ids) - 1)])
    assert perplexity(model, text) == pytest.approx(np.exp(nll), rel=1e-9)
    long_text = "the cat sat on the mat " * 40                # longer than the 96-token context: windows
    assert np.isfinite(perplexity(model, long_text))


def test_chat_turns_reuse_the_kv_cache(random_model_path, model, monkeypatch):
    """A second turn prefills only what follows the cached prefix, and gives what a fresh model gives."""
    forwarded = []
    real_forward = model.backend.forward
    monkeypatch.setattr(model.backend, "forward",
                        lambda ids, start: forwarded.append((start, len(ids))) or real_forward(ids, start))
    conversation = [{"role": "user", "content": "hello there"}]
    reply = "".join(model.generate(conversation, max_tokens=6))
    first_prompt = model.last_stats["prompt_tokens"]
    conversation += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and then?"}]
    forwarded.clear()
    second = "".join(model.generate(conversation, max_tokens=6))
    reused = model.last_stats["reused_tokens"]
    assert reused >= first_prompt > 0
    assert forwarded[0][0] == reused and sum(n for _, n in forwarded) <= model.last_stats["prompt_tokens"] - reused + 6

    fresh = load(random_model_path, device="cpu")
    assert "".join(fresh.generate(conversation, max_tokens=6)) == second
    assert fresh.last_stats["reused_tokens"] == 0
    model.logits([1, 2, 3])                       # scoring empties the cache: nothing is reused after it
    "".join(model.generate(conversation, max_tokens=2))
    assert model.last_stats["reused_tokens"] == 0


def test_sliding_window_attention_is_the_masked_softmax():
    """reference.attention with a window of W: the query at p sees exactly positions p-W+1 .. p (as
    transformers' sliding-window mask), computed here as a full softmax with the rest masked."""
    from tinyinfer.runtime import reference as ref

    rng = np.random.default_rng(4)
    n, heads, kv_heads, hd, window = 40, 4, 2, 8, 7
    q = rng.standard_normal((n, heads, hd)).astype(np.float32)
    k, v = (rng.standard_normal((n, kv_heads, hd)).astype(np.float32) for _ in range(2))
    positions = np.arange(n)
    scores = np.einsum("thd,shd->hts", q, np.repeat(k, 2, axis=1)) / np.sqrt(hd)
    visible = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
    scores = np.where(visible[None], scores, -np.inf)
    expected = np.einsum("hts,shd->thd", ref.softmax(scores), np.repeat(v, 2, axis=1)).reshape(n, -1)
    np.testing.assert_allclose(ref.attention(q, k, v, positions, window), expected, rtol=1e-5, atol=1e-6)
    assert not np.allclose(ref.attention(q, k, v, positions), expected, atol=1e-3)
    assert [ref.first_key(p, window) for p in (0, 6, 7, 39)] == [0, 0, 1, 33]
    assert ref.first_key(39, None) == 0


@pytest.mark.parametrize("updates", [{"qkv_bias": 1}, {"sliding_window": 0}, {"sliding_window": 2.5},
                                     {"sliding_window": True}, {"qkv_bias": True}])
def test_bias_and_window_settings_are_checked_on_load(random_model_path, tmp_path, updates):
    from tinyinfer.formats import open_tinf, rewrite_metadata

    with open_tinf(random_model_path) as f:
        config = {**f.config, **updates}
    bad = rewrite_metadata(random_model_path, tmp_path / "bad.tinf", {"config": config})
    with pytest.raises(FormatError, match="qkv_bias|bqkv"):
        load(bad, device="cpu")
