"""The NumPy reference forward pass: a Llama decoder (with Qwen2's Q/K/V biases and Mistral's
sliding window where the config has them) over a float32 KV cache.

This is the readable version of what the CUDA kernels do. Every step is a function from
tinyinfer.runtime.reference; weights are dequantized with Tensor.to_float32(), the same function
the format tests check.
"""

from __future__ import annotations

import numpy as np

from tinyinfer.runtime import reference as ref
from tinyinfer.runtime.backend import Backend
from tinyinfer.runtime.errors import ContextOverflowError

# Dequantized float32 weights are kept in memory only while they fit in this budget;
# beyond it each matrix is dequantized again at every use (slow, but works for big models).
CACHE_BUDGET_BYTES = 4 << 30
KV_CACHE_MIN_POSITIONS = 256   # first allocation; the cache then doubles as positions are used


class NumpyBackend(Backend):
    def __init__(self, tinf_file, verbose: bool = False, max_context: int | None = None):
        self.tinf = tinf_file
        self.config = c = tinf_file.config
        self.max_context = min(max_context or c["max_context"], c["max_context"])
        self.n_heads, self.n_kv_heads, self.head_dim = c["n_heads"], c["n_kv_heads"], c["head_dim"]
        self.cos, self.sin = ref.rope_tables(self.head_dim, self.max_context, c["rope_theta"], c.get("rope_scaling"))
        float32_bytes = sum(4 * np.prod(tinf_file.info(name).shape) for name in tinf_file.names)
        self.cache_weights = float32_bytes <= CACHE_BUDGET_BYTES
        self.dequantized: dict[str, np.ndarray] = {}
        # The KV cache [n_layers, positions, n_kv_heads, head_dim] grows on demand up to max_context,
        # so a model with a 128K context does not reserve gigabytes for a short chat.
        self.k_cache = self.v_cache = np.zeros((c["n_layers"], 0, self.n_kv_heads, self.head_dim), np.float32)
        if verbose:
            print(f"numpy backend: {len(tinf_file.names)} tensors, {float32_bytes / 2**20:.0f} MiB as float32, "
                  f"{'cached' if self.cache_weights else 'dequantized per use'}")

    def weight(self, name: str) -> np.ndarray:
        """The float32 weight, dequantized from the file (cached while under the memory budget)."""
        if name in self.dequantized:
            return self.dequantized[name]
        w = self.tinf.tensor(name).to_float32()
        if self.cache_weights:
            self.dequantized[name] = w
        return w

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        table = self.tinf.tensor("tok_embeddings")
        if table.encoding in ("f16", "f32") and not self.cache_weights:
            return table.data[token_ids, : table.cols].astype(np.float32)   # just the rows we need
        return self.weight("tok_embeddings")[token_ids]

    def grow_cache(self, n_positions: int) -> None:
        have = self.k_cache.shape[1]
        if n_positions <= have:
            return
        size = min(max(n_positions, 2 * have, KV_CACHE_MIN_POSITIONS), self.max_context)
        pad = ((0, 0), (0, size - have), (0, 0), (0, 0))
        self.k_cache, self.v_cache = np.pad(self.k_cache, pad), np.pad(self.v_cache, pad)

    def reset(self) -> None:
        pass  # positions >= start_pos are overwritten before they are read, so nothing to clear

    def forward(self, token_ids, start_pos: int) -> np.ndarray:
        token_ids = np.asarray(token_ids, dtype=np.int64).ravel()
        positions = np.arange(start_pos, start_pos + token_ids.size)
        if positions[-1] >= self.max_context:
            raise ContextOverflowError(f"Position {positions[-1]} is beyond the model's context of "
                                       f"{self.max_context} tokens; use a shorter prompt or fewer new tokens.")
        self.grow_cache(positions[-1] + 1)
        c = self.config
        x = self.embed(token_ids)
        for layer in range(c["n_layers"]):
            x = x + self.attention_block(layer, x, positions)
            x = x + self.mlp_block(layer, x)
        x = ref.rms_norm(x, self.weight("norm"), c["norm_eps"])
        return ref.linear(x, self.weight("output"))

    def attention_block(self, layer: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        p = f"layers.{layer}."
        h = ref.rms_norm(x, self.weight(p + "attn_norm"), self.config["norm_eps"])
        bias = self.weight(p + "bqkv") if self.config.get("qkv_bias") else None
        qkv = ref.linear(h, self.weight(p + "wqkv"), bias)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q = qkv[:, :q_size].reshape(-1, self.n_heads, self.head_dim)
        k = qkv[:, q_size: q_size + kv_size].reshape(-1, self.n_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(-1, self.n_kv_heads, self.head_dim)
        q = ref.apply_rope(q, positions, self.cos, self.sin)
        self.k_cache[layer, positions] = ref.apply_rope(k, positions, self.cos, self.sin)
        self.v_cache[layer, positions] = v
        window = self.config.get("sliding_window")
        out = ref.attention(q, self.k_cache[layer], self.v_cache[layer], positions, window)
        return ref.linear(out, self.weight(p + "wo"))

    def mlp_block(self, layer: int, x: np.ndarray) -> np.ndarray:
        p = f"layers.{layer}."
        h = ref.rms_norm(x, self.weight(p + "ffn_norm"), self.config["norm_eps"])
        return ref.linear(ref.swiglu(ref.linear(h, self.weight(p + "w_gate_up"))), self.weight(p + "w_down"))
