"""Sampling parameters the GPU samplers are tested with (tests/test_kernels_gpu.py, test_batch_gpu.py):
each step of runtime.sampling.sample alone and mixed, a repetition penalty with and without greedy."""

from __future__ import annotations

from tinyinfer.runtime.sampling import SamplingParams

SAMPLING = [
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1),
    SamplingParams(temperature=1.3, top_p=0.5),
    SamplingParams(temperature=0.8, top_k=1),
    SamplingParams(temperature=1.0, min_p=0.2),
    SamplingParams(temperature=2.0, top_k=7, top_p=0.95),
]
