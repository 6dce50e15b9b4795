"""Token sampling: the one definition that the NumPy and CUDA samplers both implement.

sample() follows these steps exactly (the device sampler is tested against it):
  1. repetition penalty over the set of history ids: logit / p if logit > 0 else logit * p;
  2. temperature == 0: argmax (lowest id wins ties), done;
  3. logits / temperature;
  4. top_k > 0: keep tokens whose logit >= the k-th largest logit (ties at the boundary are kept);
  5. softmax over kept tokens; top_p < 1: sort kept by prob desc (id asc on ties) and keep the
     shortest prefix whose cumulative prob >= top_p;
  6. min_p > 0: keep tokens with prob >= min_p * max prob;
  7. among kept tokens in ascending id order, probs renormalised, return the first token whose
     cumulative prob > u (the last kept token if rounding leaves none).
The caller draws u = rng.random() once per generated token, so a seed fixes the output.
Arithmetic is float64 so the reference is as exact as it can be.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tinyinfer.runtime.errors import SamplingError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        checks = [
            (self.temperature >= 0, "temperature must be >= 0 (0 means greedy)"),
            (self.top_k >= 0, "top_k must be >= 0 (0 disables it)"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1] (1 disables it)"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1] (0 disables it)"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0 (1 disables it)"),
        ]
        for ok, message in checks:
            if not ok:
                raise SamplingError(f"Invalid sampling parameter: {message}.")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def apply_repetition_penalty(logits: np.ndarray, history_ids, penalty: float) -> np.ndarray:
    if penalty == 1.0 or len(history_ids) == 0:
        return logits
    seen = np.unique(np.asarray(history_ids, dtype=np.int64))
    seen = seen[(seen >= 0) & (seen < logits.size)]
    logits[seen] = np.where(logits[seen] > 0, logits[seen] / penalty, logits[seen] * penalty)
    return logits


def sample(logits: np.ndarray, params: SamplingParams, history_ids, u: float) -> int:
    """Pick the next token from logits [vocab] with a uniform draw u in [0, 1)."""
    x = apply_repetition_penalty(np.array(logits, dtype=np.float64).ravel(), history_ids,
                                 params.repetition_penalty)
    if params.greedy:
        return int(np.argmax(x))
    x = x / params.temperature

    keep = np.ones(x.size, dtype=bool)
    if 0 < params.top_k < x.size:
        kth_largest = np.partition(x, x.size - params.top_k)[x.size - params.top_k]
        keep = x >= kth_largest

    probs = np.zeros(x.size)
    exp = np.exp(x[keep] - x[keep].max())
    probs[keep] = exp / exp.sum()

    if params.top_p < 1.0:
        kept_ids = np.flatnonzero(keep)
        by_prob = kept_ids[np.lexsort((kept_ids, -probs[kept_ids]))]   # prob desc, then id asc
        cumulative = np.cumsum(probs[by_prob])
        n_keep = min(int(np.searchsorted(cumulative, params.top_p, side="left")) + 1, by_prob.size)
        keep = np.zeros(x.size, dtype=bool)
        keep[by_prob[:n_keep]] = True

    if params.min_p > 0:
        keep &= probs >= params.min_p * probs[keep].max()

    kept_ids = np.flatnonzero(keep)
    cumulative = np.cumsum(probs[kept_ids] / probs[kept_ids].sum())
    first_above = int(np.searchsorted(cumulative, u, side="right"))
    return int(kept_ids[min(first_above, kept_ids.size - 1)])
