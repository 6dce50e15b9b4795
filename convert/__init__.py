"""Checkpoint conversion to .tinf: Hugging Face Llama-family folders or Hub repos, and llama2.c .bin files."""

from tinyinfer.convert.errors import ConvertError
from tinyinfer.convert.pipeline import convert_checkpoint

__all__ = ["ConvertError", "convert_checkpoint"]
