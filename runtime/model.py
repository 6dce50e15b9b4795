"""load() and Model: a .tinf file, a backend that runs it, and the tokenizer/chat/sampling around it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from tinyinfer.formats import FormatError, open_tinf
from tinyinfer.runtime.chat import encode_chat
from tinyinfer.runtime.errors import ContextOverflowError, DeviceError, LoadError
from tinyinfer.runtime.sampling import SamplingParams
from tinyinfer.runtime.tokenizer import Tokenizer
from tinyinfer.runtime.validate import (check_config, check_generation, check_token_ids, check_tokenizer_meta,
                                        check_tokenizer_vocab)

DEFAULT_MAX_TOKENS = 256
NO_GPU = ("No CUDA GPU is available; install tinyinfer[cuda12] or [cuda13] on a machine with an "
          "NVIDIA GPU, or run with --device cpu.")


def load(path, device: str = "auto", verbose: bool = False, max_context: int | None = None,
         weight_cache_bytes: int | None = None) -> "Model":
    """Memory-map and validate a .tinf file and pick a backend: "cuda", "cpu", or "auto" (CUDA if usable).

    weight_cache_bytes: the CPU backend's memory for float32 weights (default: from the memory available)."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise LoadError(f"{path} is a folder; pass a .tinf file (convert a checkpoint folder with tinyconvert).")
    tinf = open_tinf(path)
    check_model(tinf)
    tokenizer = Tokenizer.from_metadata(tinf.metadata["tokenizer"])
    check_tokenizer_vocab(tokenizer, tinf.path, tinf.config["vocab_size"])
    backend = make_backend(tinf, device, verbose, max_context, weight_cache_bytes)
    return Model(tinf, backend, tokenizer)


def expected_shapes(c: dict) -> dict[str, tuple]:
    q_rows = (c["n_heads"] + 2 * c["n_kv_heads"]) * c["head_dim"]
    shapes = {"tok_embeddings": (c["vocab_size"], c["dim"]), "norm": (c["dim"],),
              "output": (c["vocab_size"], c["dim"])}
    for i in range(c["n_layers"]):
        shapes.update({
            f"layers.{i}.attn_norm": (c["dim"],), f"layers.{i}.wqkv": (q_rows, c["dim"]),
            f"layers.{i}.wo": (c["dim"], c["n_heads"] * c["head_dim"]), f"layers.{i}.ffn_norm": (c["dim"],),
            f"layers.{i}.w_gate_up": (2 * c["ffn_dim"], c["dim"]), f"layers.{i}.w_down": (c["dim"], c["ffn_dim"]),
        })
        if c.get("qkv_bias"):
            shapes[f"layers.{i}.bqkv"] = (q_rows,)
    return shapes


def check_model(tinf) -> None:
    """The config describes a Llama model this runtime can run, every tensor has the shape it implies, and
    the tokenizer map and generation defaults have the types and ranges the runtime expects."""
    c = tinf.config
    check_config(c, tinf.path, len(tinf.names))
    check_tokenizer_meta(tinf.metadata["tokenizer"], tinf.path, c["vocab_size"])
    check_generation(tinf.metadata.get("generation"), tinf.path)
    for name, shape in expected_shapes(c).items():
        if tinf.info(name).shape != shape:
            raise FormatError(f"{tinf.path}: tensor {name!r} has shape {list(tinf.info(name).shape)}, "
                              f"the config implies {list(shape)}; convert the model again.")


def cuda_backend_class():
    """(CudaBackend, None) when a GPU and the CUDA backend are usable, else (None, why not)."""
    try:
        import cupy
    except Exception:   # not installed, or a broken CUDA installation
        return None, NO_GPU
    try:
        if not cupy.is_available():
            return None, NO_GPU
    except Exception:
        return None, NO_GPU
    try:
        from tinyinfer.runtime.cuda_backend import CudaBackend
    except ImportError as e:
        return None, f"The CUDA backend cannot be imported ({e}); reinstall tinyinfer or run with --device cpu."
    return CudaBackend, None


def make_backend(tinf, device: str, verbose: bool, max_context: int | None, weight_cache_bytes: int | None = None):
    if device not in ("auto", "cpu", "cuda"):
        raise DeviceError(f"Unknown device {device!r}; use auto, cpu or cuda.")
    if device in ("auto", "cuda"):
        cuda_class, why_not = cuda_backend_class()
        if cuda_class is not None:
            return cuda_class(tinf, verbose=verbose, max_context=max_context)
        if device == "cuda":
            raise DeviceError(why_not)
    from tinyinfer.runtime.numpy_backend import NumpyBackend

    return NumpyBackend(tinf, verbose=verbose, max_context=max_context, weight_cache_bytes=weight_cache_bytes)


class StopStrings:
    """Holds back text that could be the start of a stop string, so a stop string is never emitted."""

    def __init__(self, stops):
        self.stops = [s for s in (stops or ()) if s]
        self.pending = ""

    def push(self, text: str) -> tuple[str, bool]:
        """Add text; return (text safe to emit, whether a stop string was found)."""
        self.pending += text
        found = [i for i in (self.pending.find(s) for s in self.stops) if i >= 0]
        if found:
            out, self.pending = self.pending[: min(found)], ""
            return out, True
        hold = max((k for s in self.stops for k in range(1, len(s)) if self.pending.endswith(s[:k])), default=0)
        cut = len(self.pending) - hold
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, False

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class TokenText:
    """A generation's text from its tokens: an end-of-sequence id ends it (flushing what the
    detokenizer held back), a stop string ends it (and is not emitted), text that could begin a stop
    string waits for the next token."""

    def __init__(self, tokenizer, prompt_ids, stops: StopStrings):
        self._detok = tokenizer.stream(prefix_ids=prompt_ids)
        self._stops = stops
        self._eos = tokenizer.eos_ids

    def push(self, token: int) -> tuple[str, bool]:
        """(text to emit, whether the generation ends here: an end-of-sequence id or a stop string)."""
        if token in self._eos:
            return self.flush(), True
        return self._stops.push(self._detok.step(token))

    def flush(self) -> str:
        """The text held back, at the end (the token budget, or an end-of-sequence id)."""
        text, stopped = self._stops.push(self._detok.flush())   # held back for an incomplete character
        return text if stopped else text + self._stops.flush()


class Model:
    def __init__(self, tinf, backend, tokenizer: Tokenizer):
        self.tinf = tinf
        self.backend = backend
        self.tokenizer = tokenizer
        self.config = tinf.config
        self.metadata = tinf.metadata
        self.chat_template = tinf.metadata.get("chat_template")
        self.max_context = backend.max_context
        self.last_stats: dict = {}
        self.cached_ids: list[int] = []   # tokens whose K/V the backend's cache holds, from position 0
        self.last_generated: list[int] = []   # the tokens of the last stream, as it hands them out

    # ------------------------------------------------------------------------------ scoring

    def logits(self, token_ids) -> np.ndarray:
        """float32 logits [len(token_ids), vocab] for the ids, computed from an empty cache."""
        ids = np.asarray(token_ids).ravel()
        check_token_ids(ids, self.config["vocab_size"])
        ids = ids.astype(np.int64)
        if ids.size > self.max_context:
            raise ContextOverflowError(f"{ids.size} tokens exceed the model's context of {self.max_context}; "
                                       "score a shorter sequence.")
        self.cached_ids = []
        self.backend.reset()
        return self.backend.forward(ids, 0)

    # ---------------------------------------------------------------------------- generation

    def prompt_ids(self, prompt, chat: bool | None = None, system: str | None = None, **template_kwargs):
        """Token ids for a plain prompt (BOS + text) or a conversation (the chat template)."""
        if chat is None:
            chat = not isinstance(prompt, str)
        if not chat:
            if not isinstance(prompt, str):
                raise TypeError("a plain prompt must be a string; pass chat=True for a list of messages.")
            return self.tokenizer.encode(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system is not None:
            messages = [{"role": "system", "content": system}] + messages
        return encode_chat(self.tokenizer, self.chat_template, messages, **template_kwargs)

    def sampling_params(self, **overrides) -> SamplingParams:
        """SamplingParams from explicit values, else the file's generation defaults (as transformers
        reads generation_config.json: sampling settings apply only with do_sample), else greedy."""
        gen = {k: v for k, v in (self.metadata.get("generation") or {}).items() if v is not None}
        defaults = {"repetition_penalty": gen.get("repetition_penalty", 1.0)}
        if gen.get("do_sample"):
            defaults.update(temperature=gen.get("temperature", 1.0), top_k=gen.get("top_k", 50),
                            top_p=gen.get("top_p", 1.0), min_p=gen.get("min_p", 0.0))
        defaults.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**defaults)

    def new_token_budget(self, n_prompt: int, max_tokens: int | None) -> int:
        """max_tokens, checked against the context before any work (a default is capped to what fits)."""
        room = self.max_context - n_prompt
        if max_tokens is None:
            default = (self.metadata.get("generation") or {}).get("max_new_tokens") or DEFAULT_MAX_TOKENS
            max_tokens = max(min(default, room), 1)
        if max_tokens < 0:
            raise ValueError("max_tokens must be >= 0.")
        if n_prompt + max_tokens > self.max_context:
            raise ContextOverflowError(
                f"The prompt ({n_prompt} tokens) plus {max_tokens} new tokens exceeds the model's context of "
                f"{self.max_context} tokens; shorten the prompt or ask for fewer tokens.",
                prompt_tokens=n_prompt, new_tokens=max_tokens, context=self.max_context)
        return max_tokens

    def generate(self, prompt, *, chat: bool | None = None, system: str | None = None,
                 max_tokens: int | None = None, temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, min_p: float | None = None,
                 repetition_penalty: float | None = None, seed: int | None = None, stop=None,
                 **template_kwargs) -> Iterator[str]:
        """Stream the continuation of a prompt (str) or a conversation (list of {"role", "content"}).

        Stops at max_tokens, at any end-of-sequence id, or at a stop string (which is not emitted).
        Errors (context overflow, bad parameters, no chat template) are raised here, before any work.
        """
        ids = self.prompt_ids(prompt, chat, system, **template_kwargs)
        if not ids:
            raise ValueError("the prompt is empty and the model has no BOS token; pass some text.")
        check_token_ids(ids, self.config["vocab_size"])
        params = self.sampling_params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                      repetition_penalty=repetition_penalty)
        n_new = self.new_token_budget(len(ids), max_tokens)
        return self._stream(ids, params, n_new, np.random.default_rng(seed), StopStrings(stop))

    def generate_batch(self, prompts, *, chat: bool | None = None, system: str | None = None,
                       max_tokens: int | None = None, temperature: float | None = None, top_k: int | None = None,
                       top_p: float | None = None, min_p: float | None = None,
                       repetition_penalty: float | None = None, seed: int | None = None,
                       parallel: int | None = None, **template_kwargs) -> list[str]:
        """The continuation of every prompt, for offline batch jobs: decoded together on the GPU
        (runtime/cuda_batch.py: up to `parallel` at once), else one after the other as
        generate() would. Prompt i samples with seed + i (seed None: unseeded); each stops at
        max_tokens or an end-of-sequence id. Every prompt is checked before any work."""
        prompts = list(prompts)
        if not prompts:
            return []
        ids = [self.prompt_ids(p, chat, system, **template_kwargs) for p in prompts]
        if not all(ids):
            raise ValueError("a prompt is empty and the model has no BOS token; pass some text.")
        for prompt_ids in ids:
            check_token_ids(prompt_ids, self.config["vocab_size"])
        params = self.sampling_params(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                      repetition_penalty=repetition_penalty)
        budgets = [self.new_token_budget(len(i), max_tokens) for i in ids]
        seeds = [None if seed is None else seed + i for i in range(len(ids))]
        context = max(len(i) + n for i, n in zip(ids, budgets))
        engine = self._batch_engine(len(ids), parallel, context)
        if engine is None:
            return ["".join(self._stream(i, params, n, np.random.default_rng(s), StopStrings(None)))
                    for i, n, s in zip(ids, budgets, seeds)]
        from tinyinfer.runtime.cuda_batch import generate_batch_ids

        try:
            outputs = generate_batch_ids(engine, ids, [params] * len(ids), budgets, seeds, self.tokenizer.eos_ids)
        finally:
            engine.close()
        texts = []
        for prompt_ids, generated in zip(ids, outputs):
            detok = self.tokenizer.stream(prefix_ids=prompt_ids)
            kept = generated[:-1] if generated and generated[-1] in self.tokenizer.eos_ids else generated
            texts.append("".join(detok.step(t) for t in kept) + detok.flush())
        return texts

    def _batch_engine(self, n_prompts: int, parallel: int | None, context: int):
        """A BatchEngine over this model's GPU backend, or None where batched decoding does not apply
        (the CPU backend, one sequence at a time, or a model its kernels do not read: DeviceError from
        cuda_batch.check_model). Without `parallel`, as many slots as prompts, or as many as fit."""
        from tinyinfer.runtime import cuda_batch

        slots = min(n_prompts if parallel is None else parallel, cuda_batch.MAX_SLOTS)
        if not hasattr(self.backend, "stream") or slots < 2:
            return None
        try:
            cuda_batch.check_model(self.tinf)
        except DeviceError:
            return None
        try:
            return cuda_batch.BatchEngine(self.backend, slots=slots, max_context=context)
        except DeviceError:
            if parallel is not None:
                raise
            return cuda_batch.BatchEngine(self.backend, slots=None, max_context=context)

    def generate_from_ids(self, ids, params: SamplingParams, max_tokens: int | None = None, seed: int | None = None,
                          stop=None, cancelled: Callable[[], bool] | None = None) -> Iterator[str]:
        """generate() for prompt ids already encoded (a server checks and counts them first).

        cancelled() is asked after every token; once it says True the stream ends there (stop_reason
        "cancelled") with the cache as consistent as after any other stop."""
        ids = [int(i) for i in ids]
        check_token_ids(ids, self.config["vocab_size"])
        n_new = self.new_token_budget(len(ids), max_tokens)
        return self._stream(ids, params, n_new, np.random.default_rng(seed), StopStrings(stop), cancelled)

    def stream_ids(self, ids, params: SamplingParams, n_new: int, rng: np.random.Generator, text: TokenText,
                   cancelled: Callable[[], bool] | None = None) -> Iterator[str]:
        """generate_from_ids' stream of n_new tokens (already checked against the context) with the
        caller's rng and TokenText, for a server that moves a sequence between engines: rng has drawn
        exactly one number per token handed out, and self.last_generated holds those tokens."""
        return self._stream([int(i) for i in ids], params, n_new, rng, None, cancelled, text)

    def reusable_prefix(self, ids: list[int], params: SamplingParams) -> int:
        """How many leading ids already have K/V in the cache (a chat's earlier turns), so only the rest
        is prefilled. At least one id is always forwarded, for its logits. The repetition penalty looks at
        every id in the context, which the backend sees only when it gets the whole prompt: no reuse then."""
        if params.repetition_penalty != 1.0:
            return 0
        common = 0
        for cached, new in zip(self.cached_ids, ids):
            if cached != new:
                break
            common += 1
        return min(common, len(ids) - 1)

    def _stream(self, ids, params, n_new, rng, stops: StopStrings | None, cancelled=None,
                text_of: TokenText | None = None) -> Iterator[str]:
        text_of = text_of or TokenText(self.tokenizer, ids, stops)
        reuse = self.reusable_prefix(ids, params)
        stats = self.last_stats = {"prompt_tokens": len(ids), "reused_tokens": reuse, "new_tokens": 0,
                                   "stop_reason": "max_tokens"}
        start = time.perf_counter()
        if reuse == 0:
            self.backend.reset()
        self.cached_ids, generated = [], []
        self.last_generated = generated
        known = None   # what the cache holds when that is not "ids and every token handed out but the last"
        try:
            for token in self.backend.generate_ids(ids[reuse:], reuse, params, n_new, rng):
                if not generated:
                    stats["first_token_s"] = time.perf_counter() - start
                if not 0 <= token < self.config["vocab_size"]:   # fed back next step: never out of range
                    check_token_ids([token], self.config["vocab_size"])
                generated.append(token)
                stats["new_tokens"] += 1
                text, ended = text_of.push(token)
                if ended:
                    stats["stop_reason"] = "eos" if token in self.tokenizer.eos_ids else "stop_string"
                if text:
                    yield text
                if ended:
                    return
                if cancelled is not None and cancelled():
                    stats["stop_reason"] = "cancelled"
                    return
            tail = text_of.flush()
            if tail:
                yield tail
        except GeneratorExit:     # the caller stopped reading: the cache is still consistent
            raise
        except KeyboardInterrupt:
            # Ctrl-C inside the backend: a token is handed out only after the one before it was fed
            # back, so the rule below holds once a token came; before that, the prompt's prefill may be
            # half done, and only the reused prefix (positions it never writes) is known.
            stats["stop_reason"] = "interrupted"
            if not generated:
                known = list(ids[:reuse])
            raise
        except BaseException:
            known = []           # the cache state is unknown: the next call starts from scratch
            raise
        finally:
            stats["total_s"] = time.perf_counter() - start
            # Every generated token but the last was fed back through the model.
            self.cached_ids = list(ids) + generated[:-1] if known is None else known

    def close(self) -> None:
        self.backend.close()
        self.tinf.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
