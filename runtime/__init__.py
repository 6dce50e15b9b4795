"""Run .tinf models: load(path, device) -> Model with logits(), generate() and a tokenizer."""

from tinyinfer.runtime.model import Model, load
from tinyinfer.runtime.sampling import SamplingParams

__all__ = ["Model", "SamplingParams", "load"]
