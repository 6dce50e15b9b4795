"""Activation statistics for the q4 grid search: the float model run once over a built-in text.

A weight's quantization error reaches the output in proportion to the input it multiplies, so the
q4 search (formats.quant.q4_grid) weighs each column's error by that input's mean square: an
importance matrix, as llama.cpp's imatrix. The statistics come from the NumPy reference forward
pass over the checkpoint's own float weights (each matrix read from the checkpoint when used, so
memory stays near one matrix), over `calibration.txt`, a text written for this purpose (stories,
explanations, a recipe, code, a letter), tokenized with the model's own tokenizer.
"""

from __future__ import annotations

from importlib.resources import files

import numpy as np

from tinyinfer.formats import Tensor
from tinyinfer.runtime.numpy_backend import NumpyBackend
from tinyinfer.runtime.tokenizer import Tokenizer

# 512 tokens: SmolLM2-135M's wikitext perplexity ratio to f16 is 1.231 with 512 and 1.246 with 256
# (stories260K: 1.083 / 1.087 / 1.081 with 512 / 256 / 128); each costs a float forward pass at conversion.
CALIBRATION_TOKENS = 512


def calibration_ids(tokenizer_meta: dict, n_tokens: int) -> np.ndarray:
    text = files("tinyinfer.convert").joinpath("calibration.txt").read_text(encoding="utf-8")
    tokenizer = Tokenizer.from_metadata(tokenizer_meta)
    vocab = tokenizer.vocab_size
    ids = [i for i in tokenizer.encode(text) if 0 <= i < vocab][:n_tokens]
    return np.asarray(ids, dtype=np.int64)


class CheckpointView:
    """What NumpyBackend reads from a .tinf file, served from a checkpoint's float32 tensors."""

    def __init__(self, checkpoint, shapes: dict[str, tuple]):
        self.checkpoint = checkpoint
        self.config = checkpoint.config
        self.shapes = shapes
        self.names = list(shapes)

    def info(self, name: str):
        return Tensor("f32", self.shapes[name], np.empty((0, 0), np.float32))

    def tensor(self, name: str) -> Tensor:
        weights = self.checkpoint.load(name)
        return Tensor("f32", tuple(weights.shape), weights.reshape(-1, weights.shape[-1]))


class StatsBackend(NumpyBackend):
    """The reference forward pass, recording each matrix's mean square input per column."""

    def __init__(self, view: CheckpointView, n_positions: int, on_layer=None):
        super().__init__(view, max_context=n_positions, weight_cache_bytes=0)
        self.mean_squares: dict[str, np.ndarray] = {}
        self.on_layer = on_layer

    def linear(self, name: str, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        self.mean_squares[name] = np.einsum("ti,ti->i", x, x) / np.float32(len(x))
        if name == "output":               # the head's input is all that is needed of it
            return np.zeros((x.shape[0], 0), np.float32)
        if name.endswith("w_down") and self.on_layer is not None:
            self.on_layer()
        return super().linear(name, x, bias)


def input_importance(checkpoint, shapes: dict[str, tuple], tokenizer_meta: dict,
                     n_tokens: int | None = None, on_layer=None) -> tuple[dict[str, np.ndarray], int]:
    """({tinf matrix name: [cols] mean square of its input over the calibration text}, tokens used);
    n_tokens: CALIBRATION_TOKENS by default."""
    n_tokens = CALIBRATION_TOKENS if n_tokens is None else n_tokens
    ids = calibration_ids(tokenizer_meta, min(n_tokens, checkpoint.config["max_context"]))
    if ids.size < 2:
        return {}, 0
    backend = StatsBackend(CheckpointView(checkpoint, shapes), ids.size, on_layer)
    backend.forward(ids, 0)
    return backend.mean_squares, int(ids.size)
