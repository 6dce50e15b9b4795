"""Ctrl-C (KeyboardInterrupt) inside a generation leaves the KV cache in a known state, so the next
chat turn reuses it and answers as a fresh model over the same conversation does."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tinyinfer.runtime import load

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from tinyinfer.convert import convert_checkpoint

    spec = importlib.util.spec_from_file_location("demo_offline", REPO / "examples" / "demo_offline.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    folder = demo.write_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "random", max_context=160)
    return convert_checkpoint(folder, out=folder.parent / "random-q8.tinf", quant="q8", progress=False)


def interrupt_at_forward(monkeypatch, backend, n: int) -> list:
    """Make the backend's n-th forward() from now (1-based) raise KeyboardInterrupt after writing part
    of its K/V (the first layer runs, as when Ctrl-C lands mid-forward). Returns the forward log."""
    calls, real_forward, real_block = [], backend.forward, backend.attention_block

    def forward(ids, start):
        calls.append((start, len(ids)))
        if len(calls) == n:
            def block_then_interrupt(layer, x, positions):
                out = real_block(layer, x, positions)
                if layer == 0:
                    raise KeyboardInterrupt
                return out
            monkeypatch.setattr(backend, "attention_block", block_then_interrupt)
        try:
            return real_forward(ids, start)
        finally:
            monkeypatch.setattr(backend, "attention_block", real_block)

    monkeypatch.setattr(backend, "forward", forward)
    return calls


def stream_until_interrupted(model, conversation, max_tokens) -> str:
    text = []
    with pytest.raises(KeyboardInterrupt):
        for chunk in model.generate(conversation, max_tokens=max_tokens):
            text.append(chunk)
    return "".join(text)


def test_interrupt_mid_reply_keeps_the_tokens_fed_back(model_path, monkeypatch):
    model = load(model_path, device="cpu")
    conversation = [{"role": "user", "content": "Once upon a time"}]
    prompt = model.prompt_ids(conversation)
    interrupt_at_forward(monkeypatch, model.backend, 6)      # the prompt, then 4 decode steps, then Ctrl-C
    partial = stream_until_interrupted(model, conversation, 40)
    assert model.last_stats["stop_reason"] == "interrupted" and model.last_stats["new_tokens"] == 5
    # 5 tokens handed out; the 5th was being fed back when Ctrl-C came, so 4 are in the cache.
    assert len(model.cached_ids) == len(prompt) + 4 and model.cached_ids[: len(prompt)] == prompt
    monkeypatch.undo()

    conversation += [{"role": "assistant", "content": partial}, {"role": "user", "content": "and then?"}]
    second = "".join(model.generate(conversation, max_tokens=8))
    assert model.last_stats["reused_tokens"] >= len(prompt)
    fresh = load(model_path, device="cpu")
    assert "".join(fresh.generate(conversation, max_tokens=8)) == second
    assert fresh.last_stats["reused_tokens"] == 0


def test_interrupted_prefill_keeps_only_the_earlier_turns(model_path, monkeypatch):
    model = load(model_path, device="cpu")
    conversation = [{"role": "user", "content": "hello there"}]
    reply = "".join(model.generate(conversation, max_tokens=6))
    conversation += [{"role": "assistant", "content": reply}, {"role": "user", "content": "tell me a long story"}]
    before = list(model.cached_ids)
    calls = interrupt_at_forward(monkeypatch, model.backend, 1)   # Ctrl-C during the second turn's prefill
    stream_until_interrupted(model, conversation, 8)
    reused = model.last_stats["reused_tokens"]
    assert 0 < reused and calls[0][0] == reused
    assert model.cached_ids == before[:reused]                    # the prefix the prefill never touched
    monkeypatch.undo()

    third = "".join(model.generate(conversation, max_tokens=8))
    assert model.last_stats["reused_tokens"] == reused
    fresh = load(model_path, device="cpu")
    assert "".join(fresh.generate(conversation, max_tokens=8)) == third


def test_other_errors_still_empty_the_cache(model_path, monkeypatch):
    model = load(model_path, device="cpu")
    conversation = [{"role": "user", "content": "hi"}]
    "".join(model.generate(conversation, max_tokens=4))
    real_forward = model.backend.forward
    monkeypatch.setattr(model.backend, "forward", lambda ids, start: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(MemoryError):
        "".join(model.generate(conversation + [{"role": "assistant", "content": "x"},
                                               {"role": "user", "content": "y"}], max_tokens=4))
    assert model.cached_ids == []
    monkeypatch.setattr(model.backend, "forward", real_forward)
