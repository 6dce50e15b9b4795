"""Perplexity of a model on text: exp(mean negative log-likelihood of each next token)."""

from __future__ import annotations

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def negative_log_likelihood(model, text: str) -> tuple[float, int]:
    """(sum of -log p(token | previous tokens), number of predicted tokens) for one document.

    The document is encoded as the model would see a prompt (BOS first when the model uses one).
    Longer than the context, it is scored in consecutive windows, each from an empty cache.
    """
    ids = np.asarray(model.tokenizer.encode(text), dtype=np.int64)
    total, count = 0.0, 0
    for start in range(0, max(ids.size - 1, 0), model.max_context):
        window = ids[start: start + model.max_context + 1]     # predicts window[1:] from window[:-1]
        logprobs = log_softmax(model.logits(window[:-1]))
        total -= float(logprobs[np.arange(window.size - 1), window[1:]].sum())
        count += window.size - 1
    return total, count


def perplexity(model, texts) -> float:
    """Perplexity over one text or a list of documents (each scored separately, tokens pooled)."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    results = [negative_log_likelihood(model, t) for t in texts]
    total, count = sum(r[0] for r in results), sum(r[1] for r in results)
    if count == 0:
        raise ValueError("the text is too short to score; it needs at least two tokens.")
    return float(np.exp(total / count))
