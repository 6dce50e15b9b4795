"""The NumPy reference forward pass: a Llama decoder (with Qwen2's Q/K/V biases and Mistral's
sliding window where the config has them) over a float32 KV cache.

This is the readable version of what the CUDA kernels do. Every step is a function from
tinyinfer.runtime.reference; weights are dequantized with Tensor.to_float32(), the same function
the format tests check.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from tinyinfer.formats import Tensor
from tinyinfer.runtime import reference as ref
from tinyinfer.runtime.backend import Backend
from tinyinfer.runtime.errors import ContextOverflowError, LoadError

# Dequantized float32 weights are kept in memory while they fit in a budget: by default what the
# system has available (less headroom for everything else), else FALLBACK_BUDGET_BYTES where that
# cannot be read. Weights beyond it are dequantized again at every use (slow, but big models run).
FALLBACK_BUDGET_BYTES = 4 << 30
BUDGET_SHARE = 0.8                  # of MemAvailable; the rest stays for other programs and the page cache
BUDGET_HEADROOM_BYTES = 512 << 20
KV_CACHE_MIN_POSITIONS = 256   # first allocation; the cache then doubles as positions are used
# The speed note's rough rates for a desktop or server CPU: a float32 matrix-vector product reads
# weights at about this rate, and dequantizing an uncached weight produces float32 bytes at this one.
CPU_READ_BYTES_PER_S = 12e9
CPU_DEQUANT_BYTES_PER_S = 1.2e9
CPU_STEP_SECONDS, CPU_LAYER_SECONDS = 100e-6, 150e-6    # Python's share of a step, which small models feel
PROGRESS_MIN_BYTES = 256 << 20     # show a progress bar while caching more than this
ROPE_BYTES_PER_ENTRY = 32          # float64 angles, cos and sin, and their float32 tables, while built


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what Linux can hand out without swapping), or None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def address_space_room_bytes() -> int | None:
    """What RLIMIT_AS still lets this process map (its limit less the current size), or None."""
    try:
        import resource

        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        if limit == resource.RLIM_INFINITY:
            return None
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * resource.getpagesize()
        return max(limit - mapped, 0)
    except (ImportError, OSError, ValueError, IndexError):
        return None


def check_rope_tables_fit(max_context: int, head_dim: int) -> None:
    """The RoPE tables cover the whole context up front: refuse, before allocating, ones that cannot fit."""
    need = ROPE_BYTES_PER_ENTRY * max_context * (head_dim // 2)
    rooms = [r for r in (available_memory_bytes(), address_space_room_bytes()) if r is not None]
    if rooms and need > min(rooms):
        raise LoadError(f"The model's context of {max_context} positions needs {need / 2**30:.1f} GiB of RoPE "
                        f"tables, more than the {min(rooms) / 2**30:.1f} GiB available; load it with a smaller "
                        "max_context (tinyrun -c N).")


def default_cache_budget(kv_cache_bytes: int) -> int:
    """Bytes of float32 weights to keep: a share of the available memory, less the largest KV cache."""
    available = available_memory_bytes()
    if available is None:
        return FALLBACK_BUDGET_BYTES
    return max(0, int(available * BUDGET_SHARE) - BUDGET_HEADROOM_BYTES - kv_cache_bytes)


def blas_threads() -> int | str:
    """The thread count of NumPy's BLAS (threadpoolctl sees it; tinyrun -t sets it)."""
    from threadpoolctl import threadpool_info

    counts = [pool["num_threads"] for pool in threadpool_info() if pool.get("user_api") == "blas"]
    return counts[0] if counts else "?"


class NumpyBackend(Backend):
    def __init__(self, tinf_file, verbose: bool = False, max_context: int | None = None,
                 weight_cache_bytes: int | None = None):
        self.tinf = tinf_file
        self.config = c = tinf_file.config
        self.max_context = min(max_context or c["max_context"], c["max_context"])
        self.n_heads, self.n_kv_heads, self.head_dim = c["n_heads"], c["n_kv_heads"], c["head_dim"]
        check_rope_tables_fit(self.max_context, self.head_dim)
        self.cos, self.sin = ref.rope_tables(self.head_dim, self.max_context, c["rope_theta"], c.get("rope_scaling"))
        # The KV cache [n_layers, positions, n_kv_heads, head_dim] grows on demand up to max_context,
        # so a model with a 128K context does not reserve gigabytes for a short chat.
        self.k_cache = self.v_cache = np.zeros((c["n_layers"], 0, self.n_kv_heads, self.head_dim), np.float32)
        kv_bytes = 2 * 4 * c["n_layers"] * self.max_context * self.n_kv_heads * self.head_dim
        self.cache_budget = default_cache_budget(kv_bytes) if weight_cache_bytes is None else weight_cache_bytes
        self.cached_names = self.names_to_cache(self.cache_budget)
        self.dequantized: dict[str, np.ndarray] = {}
        self.dequantize_cached()
        if verbose:
            rest = self.float32_bytes() - self.cached_bytes()
            print(f"numpy backend: {len(tinf_file.names)} tensors, {self.float32_bytes() / 2**20:.0f} MiB as float32, "
                  f"{self.cached_bytes() / 2**20:.0f} MiB cached (budget {self.cache_budget / 2**20:.0f} MiB)"
                  + (f", {rest / 2**20:.0f} MiB dequantized per use" if rest else "")
                  + f", {blas_threads()} BLAS threads", file=sys.stderr)

    # ------------------------------------------------------------------------------ weights

    def float32_bytes(self, names=None) -> int:
        """Bytes of the named matrices (default: all but the embeddings, read by rows) as float32."""
        names = [n for n in self.tinf.names if n != "tok_embeddings"] if names is None else names
        return sum(4 * math.prod(self.tinf.info(name).shape) for name in names)

    def cached_bytes(self) -> int:
        return self.float32_bytes(self.cached_names)

    def names_to_cache(self, budget: int) -> set[str]:
        """Weights kept as float32, in file order while they fit: each is read once per token, so every
        cached byte saves the same dequantization."""
        chosen, used = set(), 0
        for name in self.tinf.names:
            size = self.float32_bytes([name])
            if name != "tok_embeddings" and used + size <= budget:
                chosen.add(name)
                used += size
        return chosen

    def dequantize_cached(self) -> None:
        """Dequantize the cached weights now (with a progress bar on a terminal when it takes a while),
        so the first reply is not slowed by it."""
        from tqdm import tqdm

        names = [n for n in self.tinf.names if n in self.cached_names]
        with tqdm(total=self.cached_bytes(), unit="B", unit_scale=True, desc="dequantizing for the CPU",
                  leave=False, disable=None if self.cached_bytes() > PROGRESS_MIN_BYTES else True) as bar:
            for name in names:
                self.dequantized[name] = self.tinf.tensor(name).to_float32()
                bar.update(self.dequantized[name].nbytes)

    def weight(self, name: str) -> np.ndarray:
        """The float32 weight: cached, or dequantized from the file for this use."""
        if name in self.dequantized:
            return self.dequantized[name]
        return self.tinf.tensor(name).to_float32()

    def embed(self, token_ids: np.ndarray) -> np.ndarray:
        """Only the rows of the tokens, dequantized (row by row, as to_float32 does the whole table)."""
        table = self.tinf.tensor("tok_embeddings")
        scales = None if table.scales is None else table.scales[token_ids]
        rows = Tensor(table.encoding, (token_ids.size, table.cols), table.data[token_ids], scales, table.group)
        return rows.to_float32()

    def expected_tokens_per_s(self) -> float:
        """A rough decode speed: cached weights read at CPU_READ_BYTES_PER_S, the rest dequantized, and
        the interpreter's time per step."""
        cached = self.cached_bytes()
        seconds = (cached / CPU_READ_BYTES_PER_S + (self.float32_bytes() - cached) / CPU_DEQUANT_BYTES_PER_S
                   + CPU_STEP_SECONDS + CPU_LAYER_SECONDS * self.config["n_layers"])
        return 1 / seconds

    # ------------------------------------------------------------------------------ forward

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
        return self.linear("output", x)

    def linear(self, name: str, x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
        """x @ weight(name)^T (+ bias): every matrix product of the forward pass goes through here."""
        return ref.linear(x, self.weight(name), bias)

    def attention_block(self, layer: int, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
        p = f"layers.{layer}."
        h = ref.rms_norm(x, self.weight(p + "attn_norm"), self.config["norm_eps"])
        bias = self.weight(p + "bqkv") if self.config.get("qkv_bias") else None
        qkv = self.linear(p + "wqkv", h, bias)
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q = qkv[:, :q_size].reshape(-1, self.n_heads, self.head_dim)
        k = qkv[:, q_size: q_size + kv_size].reshape(-1, self.n_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].reshape(-1, self.n_kv_heads, self.head_dim)
        q = ref.apply_rope(q, positions, self.cos, self.sin)
        self.k_cache[layer, positions] = ref.apply_rope(k, positions, self.cos, self.sin)
        self.v_cache[layer, positions] = v
        window = self.config.get("sliding_window")
        out = ref.attention(q, self.k_cache[layer], self.v_cache[layer], positions, window)
        return self.linear(p + "wo", out)

    def mlp_block(self, layer: int, x: np.ndarray) -> np.ndarray:
        p = f"layers.{layer}."
        h = ref.rms_norm(x, self.weight(p + "ffn_norm"), self.config["norm_eps"])
        return self.linear(p + "w_down", ref.swiglu(self.linear(p + "w_gate_up", h)))
