"""Ctrl-C inside the CUDA backend's decode loop, while later steps are still queued (LOOKAHEAD): the
model keeps the tokens fed back, the queued steps only write positions past them, and the next turn
reuses the cache and answers as a fresh model does. (The NumPy path: test_interrupt.py.)"""

from __future__ import annotations

import json

import numpy as np
import pytest

from tinyinfer.runtime import load
from tinyinfer.runtime.bench import tinf_config, write_random_model

pytestmark = pytest.mark.gpu


class InterruptAt(np.ndarray):
    """A view of the pinned token buffer whose host read of token `trip` raises KeyboardInterrupt,
    as a Ctrl-C arriving while generate_ids waits for that token does."""

    trip = -1

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)) and index == self.trip:
            raise KeyboardInterrupt
        return super().__getitem__(index)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, shared_assets, cupy_gpu):
    hf = json.loads((shared_assets / "tinyllama-1.1b-chat-v1.0" / "config.json").read_text())
    config = tinf_config(hf, n_layers=2)
    config["max_context"] = 256
    return write_random_model(tmp_path_factory.mktemp("ctrl-c") / "m.tinf", config, "q4", 64, seed=5)


def test_interrupt_with_queued_steps_keeps_the_cache_consistent(model_path):
    prompt = "w523 w9077 w42 w3001 w15"
    with load(model_path, device="cuda") as model:
        tokens = model.backend.out_tokens
        model.backend.out_tokens = tokens.view(InterruptAt)
        model.backend.out_tokens.trip = 5                # 5 tokens handed out, up to 16 steps queued
        text = []
        with pytest.raises(KeyboardInterrupt):
            for chunk in model.generate(prompt, max_tokens=60):
                text.append(chunk)
        model.backend.out_tokens = tokens
        ids = model.prompt_ids(prompt)
        assert model.last_stats["new_tokens"] == 5 and len(model.cached_ids) == len(ids) + 4
        follow = prompt + "".join(text) + " w77 w78"
        second = "".join(model.generate(follow, max_tokens=20))
        assert model.last_stats["reused_tokens"] >= len(ids)
    with load(model_path, device="cuda") as fresh:
        assert "".join(fresh.generate(follow, max_tokens=20)) == second
