"""How many weights a .tinf file holds and how many bits each costs: the one definition every tool reports.

Weights are the elements of every tensor in the directory: embeddings, norms, output head and the
linear layers, as stored (a tied output head is stored, so counted, on its own). Bytes are the tensors'
own bytes (codes plus their fp16 scales), without the metadata block or alignment padding. The
quantized matrices (q4/q8) are also counted on their own, since that is the number a quantization
scheme is known by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .quant import QUANTIZED


@dataclass(frozen=True)
class WeightStats:
    n_weights: int
    n_bytes: int
    quantized_weights: int
    quantized_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.n_bytes / self.n_weights if self.n_weights else 0.0

    @property
    def quantized_bits_per_weight(self) -> float | None:
        return 8 * self.quantized_bytes / self.quantized_weights if self.quantized_weights else None

    def summary(self) -> str:
        """e.g. '1.10B weights in all tensors (embeddings included) at 4.95 bits/weight; the q4/q8 matrices
        at 4.25 bits/weight with their scales'."""
        text = (f"{format_count(self.n_weights)} weights in all tensors (embeddings included) at "
                f"{self.bits_per_weight:.2f} bits/weight")
        if self.quantized_weights:
            text += f"; the q4/q8 matrices at {self.quantized_bits_per_weight:.2f} bits/weight with their scales"
        return text


def weight_stats(infos) -> WeightStats:
    """WeightStats over TensorInfo entries (TinfFile.info(name) for every name)."""
    infos = list(infos)
    quantized = [i for i in infos if i.encoding in QUANTIZED]
    return WeightStats(n_weights=sum(math.prod(i.shape) for i in infos), n_bytes=sum(i.nbytes for i in infos),
                       quantized_weights=sum(math.prod(i.shape) for i in quantized),
                       quantized_bytes=sum(i.nbytes for i in quantized))


def file_weight_stats(tinf) -> WeightStats:
    """WeightStats of an open TinfFile."""
    return weight_stats(tinf.info(name) for name in tinf.names)


def format_count(n: int) -> str:
    """1_100_048_384 -> '1.10B', 289_536 -> '0.29M'."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
