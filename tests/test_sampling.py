"""sample() against the exact seven-step definition (the CUDA sampler is tested against sample())."""

from __future__ import annotations

import math

import numpy as np
import pytest

from tinyinfer.runtime.errors import SamplingError
from tinyinfer.runtime.sampling import SamplingParams, sample


def slow_sample(logits, params, history, u):
    """The definition again, one step at a time in plain Python, as an independent oracle."""
    x = [float(v) for v in logits]
    if params.repetition_penalty != 1.0:
        for i in set(history):
            x[i] = x[i] / params.repetition_penalty if x[i] > 0 else x[i] * params.repetition_penalty
    if params.temperature == 0:
        return max(range(len(x)), key=lambda i: (x[i], -i))
    x = [v / params.temperature for v in x]
    kept = list(range(len(x)))
    if params.top_k > 0:
        kth = sorted(x, reverse=True)[min(params.top_k, len(x)) - 1]
        kept = [i for i in kept if x[i] >= kth]
    top = max(x[i] for i in kept)
    weights = {i: math.exp(x[i] - top) for i in kept}
    total = sum(weights.values())
    prob = {i: w / total for i, w in weights.items()}
    if params.top_p < 1.0:
        order = sorted(kept, key=lambda i: (-prob[i], i))
        cumulative, prefix = 0.0, []
        for i in order:
            prefix.append(i)
            cumulative += prob[i]
            if cumulative >= params.top_p:
                break
        kept = prefix
    if params.min_p > 0:
        best = max(prob[i] for i in kept)
        kept = [i for i in kept if prob[i] >= params.min_p * best]
    kept = sorted(kept)
    norm = sum(prob[i] for i in kept)
    cumulative = 0.0
    for i in kept:
        cumulative += prob[i] / norm
        if cumulative > u:
            return i
    return kept[-1]


def logits_of(probs):
    return np.log(np.asarray(probs, dtype=np.float64)).astype(np.float32)


def test_invalid_parameters_raise_one_clear_error():
    for bad in [dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5), dict(min_p=2),
                dict(repetition_penalty=0)]:
        with pytest.raises(SamplingError, match="Invalid sampling parameter"):
            SamplingParams(**bad)


def test_greedy_is_argmax_and_lowest_id_wins_ties():
    logits = np.array([0.1, 3.0, -2.0, 3.0], dtype=np.float32)
    assert sample(logits, SamplingParams(), [], 0.99) == 1


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, 1.9, -1.0, -1.2], dtype=np.float32)
    params = SamplingParams(repetition_penalty=1.5)
    assert sample(logits, params, [0], 0.0) == 1           # 2.0 / 1.5 < 1.9
    assert sample(logits, params, [0, 0, 0], 0.0) == 1      # a set: applied once however often seen
    assert sample(np.array([-1.0, -1.2]), params, [0], 0.0) == 1   # -1.0 * 1.5 < -1.2


def test_inverse_cdf_over_ascending_ids():
    logits = logits_of([0.1, 0.2, 0.3, 0.4])
    params = SamplingParams(temperature=1.0)
    assert [sample(logits, params, [], u) for u in (0.0, 0.09, 0.11, 0.29, 0.31, 0.59, 0.61, 0.999)] == \
        [0, 0, 1, 1, 2, 2, 3, 3]


def test_temperature_sharpens_the_distribution():
    logits = logits_of([0.1, 0.2, 0.3, 0.4])
    n = 10_000
    draws = np.array([sample(logits, SamplingParams(temperature=0.5), [], (i + 0.5) / n) for i in range(n)])
    expected = np.array([0.1, 0.2, 0.3, 0.4]) ** 2
    expected /= expected.sum()
    assert np.allclose(np.bincount(draws, minlength=4) / n, expected, atol=2 / n)


def test_top_k_keeps_ties_at_the_boundary():
    logits = np.array([1.0, 5.0, 5.0, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=1.0, top_k=1)
    assert {sample(logits, params, [], u) for u in np.linspace(0, 0.999, 50)} == {1, 2}


def test_top_p_keeps_the_shortest_prefix_reaching_p():
    logits = logits_of([0.15, 0.5, 0.05, 0.3])
    kept = lambda p: {sample(logits, SamplingParams(temperature=1.0, top_p=p), [], u)
                      for u in np.linspace(0, 0.999, 200)}
    assert kept(0.45) == {1}
    assert kept(0.75) == {1, 3}
    assert kept(0.9) == {0, 1, 3}
    assert kept(1.0) == {0, 1, 2, 3}
    equal = np.zeros(4, dtype=np.float32)                    # ties in probability: lower ids first
    assert {sample(equal, SamplingParams(temperature=1.0, top_p=0.5), [], u)
            for u in np.linspace(0, 0.999, 50)} == {0, 1}


def test_min_p_drops_tokens_below_a_fraction_of_the_best():
    logits = logits_of([0.15, 0.5, 0.05, 0.3])
    params = SamplingParams(temperature=1.0, min_p=0.35)    # keeps prob >= 0.175
    assert {sample(logits, params, [], u) for u in np.linspace(0, 0.999, 200)} == {1, 3}
    # renormalised over the kept pair, in ascending id order: token 1 has 0.625, token 3 0.375
    assert sample(logits, params, [], 0.62) == 1
    assert sample(logits, params, [], 0.63) == 3


def test_matches_the_step_by_step_definition_on_random_cases():
    rng = np.random.default_rng(0)
    for case in range(400):
        vocab = int(rng.integers(2, 40))
        logits = (rng.standard_normal(vocab) * rng.uniform(0.1, 4)).astype(np.float32)
        if case % 3 == 0:  # force ties
            logits[rng.integers(0, vocab, 3)] = logits.max()
        params = SamplingParams(
            temperature=float(rng.choice([0.0, 0.3, 0.7, 1.0, 1.8])),
            top_k=int(rng.choice([0, 1, 3, 10, 50])),
            top_p=float(rng.choice([1.0, 0.95, 0.7, 0.3])),
            min_p=float(rng.choice([0.0, 0.05, 0.3])),
            repetition_penalty=float(rng.choice([1.0, 1.3, 0.8])))
        history = list(rng.integers(0, vocab, int(rng.integers(0, 10))))
        u = float(rng.random())
        assert sample(logits, params, history, u) == slow_sample(logits, params, history, u), (case, params)


def test_does_not_modify_the_callers_logits():
    logits = np.array([1.0, 2.0, -1.0], dtype=np.float32)
    before = logits.copy()
    sample(logits, SamplingParams(temperature=1.0, repetition_penalty=2.0, top_k=2), [0, 1, 2], 0.5)
    assert np.array_equal(logits, before)
