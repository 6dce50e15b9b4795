"""The interface every backend (NumPy reference, CUDA) implements, with the default decode loop."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from tinyinfer.runtime.errors import NonFiniteLogitsError
from tinyinfer.runtime.sampling import SamplingParams, sample


def check_finite(logits: np.ndarray) -> np.ndarray:
    """Logits a sampler can use: NaN or inf (from corrupt weights) would leave it no token to pick."""
    if not np.isfinite(logits).all():
        raise NonFiniteLogitsError("The model computed NaN or infinite logits, so its weights are likely corrupt; "
                                   "check the file with `tinyrun info FILE --check` and download or convert it again.")
    return logits


class Backend:
    config: dict
    max_context: int

    def reset(self) -> None:
        """Empty the KV cache."""
        raise NotImplementedError

    def forward(self, token_ids: np.ndarray, start_pos: int) -> np.ndarray:
        """Process tokens at positions start_pos.. (appending their K/V to the cache);
        return float32 logits [len(token_ids), vocab]."""
        raise NotImplementedError

    def generate_ids(self, prompt_ids, start_pos: int, params: SamplingParams, max_new_tokens: int,
                     rng: np.random.Generator) -> Iterator[int]:
        """Forward the prompt as one batch, then sample and forward one token at a time.

        Exactly one rng.random() is drawn per generated token (also when greedy), so every backend
        turns the same seed into the same tokens.
        """
        history = [int(t) for t in prompt_ids]
        logits = self.forward(np.asarray(history, dtype=np.int64), start_pos)[-1]
        pos = start_pos + len(history)
        for i in range(max_new_tokens):
            token = sample(check_finite(logits), params, history, rng.random())
            yield token
            history.append(token)
            if i + 1 < max_new_tokens:   # no forward for a token nobody will sample from
                logits = self.forward(np.array([token], dtype=np.int64), pos)[-1]
                pos += 1

    def close(self) -> None:
        """Release device memory (nothing to do for NumPy)."""
