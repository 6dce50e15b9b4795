"""Continuous batching on the GPU: up to 32 sequences decode together, each weight read once per step.

The engine sits beside the batch-1 backend (cuda_backend.py) and shares its weights on the device,
its RoPE tables, its stream and its prefill kernels. What it adds:

  - one KV cache of `slots` + 1 slots [layers][slot][max_context][n_kv][hd] fp16, sized up front by
    a memory plan (the extra slot takes the padding rows of a step);
  - a step over rows (token, position, slot), as one CUDA graph per batch-size bucket (BUCKETS; a
    step of n rows replays the smallest bucket >= n):

        embed -> per layer [ rmsnorm (+= previous down) -> GEMV qkv -> rope + KV store
                             -> attention (each row over its own slot) -> GEMV o
                             -> rmsnorm (+= o) -> GEMV gate/up -> swiglu -> GEMV down ]
              -> rmsnorm (+= down) -> GEMV output -> logits + greedy argmax per row -> sample per row

    (q4, q8 or f16 linears: kernels/batch.cu; the kernels launched early, as in the batch-1 step);
  - scheduling: submit() puts a prompt in a free slot. Each step has one row per decoding sequence,
    and fills the rows left (up to MAX_ROWS) with the positions of waiting prompts, first come first:
    a prompt row stores its K/V, and the row of a prompt's last token samples its first token. The
    step's RoPE + KV store runs for every row before any row's attention, so rows of one prompt see
    each other's keys. A prompt with more than `step_prefill` positions left first goes through
    cuda_prefill's GEMMs over its slot's cache, up to one chunk per step (runtime/README.md,
    "Prefill in the step"). A sequence leaves at its stop token, its token budget, or cancel(), and
    its slot is free for the next submit() at once.

Sampling on the device (kernels/sampling.cu batch_sample, the step's last kernel): plain greedy rows
(temperature 0, no repetition penalty) take batch_logits' argmax; the others run sampling.sample()'s
steps with their own parameters and u, uploaded with the row table, and their slot's history, which
the host writes at submit (the prompt) and the kernel extends by each token it picks. Each generated
token draws one rng.random() before its step, as Backend.generate_ids does, so a seed gives the same
tokens in a batch as alone (up to the logits' rounding). The logits stay on the device (keep_logits
copies them, for tests).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from tinyinfer.formats.quant import scale_offset
from tinyinfer.kernels import batch as batch_k
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels import sampling as sample_k
from tinyinfer.kernels.build import Launch
from tinyinfer.kernels.misc import EMBEDDING_ID
from tinyinfer.runtime import cuda_prefill
from tinyinfer.runtime.errors import ContextOverflowError, DeviceError, SlotsFullError
from tinyinfer.runtime.sampling import SamplingParams
from tinyinfer.runtime.weights_upload import pinned_empty

BUCKETS = (1, 2, 4, 8, 16, 32)     # rows per step with their own graph
MAX_ROWS = MAX_SLOTS = BUCKETS[-1]
PREFILL_CHUNK = 512                # prompt tokens prefilled by GEMM between two steps
STEP_PREFILL = 256                 # prompts with at most this many positions left fill the steps' rows
MARGIN_BYTES = 256 << 20
H2D, D2H = 1, 2
PROFILE_HOLD_NS = 30_000_000       # profile_step: long enough to queue a 7B step's ~300 launches
GREEDY = SamplingParams()


def bucket_for(n_rows: int) -> int:
    return min(b for b in BUCKETS if b >= n_rows)


@dataclass
class Sequence:
    slot: int
    prompt: np.ndarray                 # int64 ids
    params: SamplingParams
    rng: np.random.Generator
    max_new_tokens: int
    stop_ids: frozenset
    prefilled: int = 0                 # prompt positions whose K/V are in the slot
    generated: list = field(default_factory=list)

    @property
    def prompt_left(self) -> int:
        """Prompt positions still to cache before the sequence decodes."""
        return self.prompt.size - 1 - self.prefilled

    @property
    def position(self) -> int:
        return self.prompt.size - 1 + len(self.generated)

    @property
    def token(self) -> int:
        return int(self.generated[-1]) if self.generated else int(self.prompt[-1])


@dataclass(frozen=True)
class Row:
    """One row of a step: a token at a position of a sequence's slot; `samples`: the row's output is
    the sequence's next token (a decoding sequence, or a prompt's last token), else it only stores
    the prompt position's K/V."""

    seq: Sequence
    token: int
    position: int
    samples: bool = True

    @property
    def slot(self) -> int:
        return self.seq.slot


@dataclass(frozen=True)
class TokenEvent:
    token: int
    finish_reason: str | None = None   # "stop" (a stop id), "length" (max_new_tokens), or None: goes on


class SlotCache:
    """The batch-1 backend as cuda_prefill.CudaOps sees it, with one slot's KV cache in place of its own."""

    def __init__(self, backend):
        self._backend = backend
        self.k_cache = self.v_cache = None

    def __getattr__(self, name):
        return getattr(self._backend, name)


def check_model(tinf) -> None:
    """The batched GEMV reads q4/q8/f16 linears in 8-row blocks, the attention groups of up to 8 heads
    of up to 128; prefill needs a head size it compiles."""
    for name in cuda_prefill.linear_names(tinf.config):
        info = tinf.info(name)
        shape = gemv_k.shape_of(info)
        if not batch_k.can_run(info.encoding, shape.rows, shape.cols_pad, info.group or 0):
            raise DeviceError(f"{name} is {info.encoding} of shape {tuple(info.shape)}, which batched decoding does "
                              "not read (q4, q8 or f16 in 8-row blocks: rows a multiple of 8, rows of whole 64-byte "
                              "pieces); convert the model with --quant q4 or decode one sequence at a time.")
    c = tinf.config
    if not batch_k.attention_supports(c["n_heads"], c["n_kv_heads"], c["head_dim"]):
        raise DeviceError(f"batched attention takes up to {batch_k.MAX_GROUP} query heads per KV head and head_dim "
                          f"a multiple of 8 up to 128; this model has {c['n_heads']} / {c['n_kv_heads']} heads of "
                          f"{c['head_dim']}, so decode one sequence at a time.")
    if c["dim"] > batch_k.MAX_DIM or c["dim"] % batch_k.RMSNORM_VEC:
        raise DeviceError(f"batched decoding normalizes rows of up to {batch_k.MAX_DIM} elements, a multiple of "
                          f"{batch_k.RMSNORM_VEC}; this model's are {c['dim']}, so decode one sequence at a time.")
    if not cuda_prefill.supported(tinf.config):
        raise DeviceError(f"batched decoding prefills with head_dim in {cuda_prefill.prefill_k.HEAD_DIMS}; this model "
                          f"has {tinf.config['head_dim']}, so decode one sequence at a time.")


class BatchEngine:
    """submit(prompt_ids, params, max_new_tokens) -> slot; step() -> {slot: TokenEvent}; cancel(slot)."""

    def __init__(self, backend, slots: int | None = None, max_context: int | None = None,
                 prefill_chunk: int = PREFILL_CHUNK, keep_logits: bool = False, step_prefill: int = STEP_PREFILL):
        self.backend = backend
        self.cp = backend.cp
        self.tinf = backend.tinf
        c = self.config = backend.config
        check_model(self.tinf)
        self.max_context = self.fit_attention(max_context)
        self.dim, self.n_layers, self.vocab = c["dim"], c["n_layers"], c["vocab_size"]
        self.n_heads, self.n_kv, self.hd, self.ffn = c["n_heads"], c["n_kv_heads"], c["head_dim"], c["ffn_dim"]
        self.stream = backend.stream
        self.pdl = bool(getattr(backend, "pdl", False))   # early launches as the batch-1 step (TINYINFER_PDL=0: off)
        self.keep_logits = keep_logits       # step() keeps every row's logits in last_logits (tests)
        self.last_logits: dict[int, np.ndarray] = {}
        self.plans: dict[tuple, batch_k.GemvPlan] = {}
        self.prefill_chunk = min(prefill_chunk, cuda_prefill.MAX_CHUNK)
        self.step_prefill = step_prefill     # prompts with at most this many positions left: in the steps' rows
        self.n_slots = self.check_memory(slots)
        self.mod = batch_k.compile_batch(backend.compute_capability)
        self.sample_mod = sample_k.compile_sampler(backend.compute_capability)   # the batch-1 backend's module
        with self.stream:
            self.allocate()
            self.prefill_ops = cuda_prefill.CudaOps(SlotCache(backend), self.prefill_chunk)
        self.graphs: dict[tuple, object] = {}   # by (bucket, prompt rows in the step)
        self.sequences: dict[int, Sequence] = {}
        self.waiting: list[int] = []         # slots whose prompt is being prefilled, first come first
        self.step_times: list[float] = []

    # ------------------------------------------------------------------------- memory

    def fit_attention(self, max_context: int | None) -> int:
        """The positions per slot: max_context (at most the backend's), or by default as many as the
        scalar attention's scores hold in shared memory where that kernel serves the model; refused
        where a given max_context does not fit."""
        c, cp = self.config, self.cp
        props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
        shared = int(props.get("sharedMemPerBlockOptin", batch_k.MAX_SHARED_BYTES))
        group = c["n_heads"] // c["n_kv_heads"]
        most = batch_k.attention_max_keys(shared, c["head_dim"], group)
        wanted = min(max_context or self.backend.max_context, self.backend.max_context)
        if most is None:
            return wanted
        if max_context is None:
            return min(wanted, most)
        if wanted > most:
            raise DeviceError(f"batched attention holds a row's scores in shared memory, up to {most} positions "
                              f"for this model; load the batch with max_context of at most {most}.")
        return wanted

    def plan_for(self, name: str, padded: int) -> batch_k.GemvPlan:
        """The GEMV plan of a linear for a step of `padded` rows (one per shape and encoding)."""
        shape = gemv_k.shape_of(self.tinf.info(name))
        key = (shape.encoding, shape.rows, shape.cols_pad, padded)
        if key not in self.plans:
            self.plans[key] = batch_k.plan_gemv(shape.rows, shape.cols_pad, padded, self.backend.n_sms,
                                                shape.encoding)
        return self.plans[key]

    def parts_floats(self) -> int:
        """The partial sums of the largest linear's plan at any step size (a smaller step's plan may
        have more slices)."""
        return max(self.plan_for(name, padded).parts_floats for name in cuda_prefill.linear_names(self.config)
                   for padded in {batch_k.padded_rows(n) for n in BUCKETS})

    def kpad(self, role: str) -> int:
        return gemv_k.shape_of(self.tinf.info(f"layers.0.{role}")).cols_pad

    def slot_bytes(self) -> int:
        return 2 * self.n_layers * self.max_context * self.n_kv * self.hd * 2

    def scratch_bytes(self) -> int:
        rows = MAX_SLOTS
        parts = self.parts_floats()
        h = rows * (self.kpad("wqkv") + self.kpad("wo") + self.kpad("w_down")) * 2
        floats = rows * (self.dim + self.n_heads * self.hd + self.vocab) + parts
        prefill = (self.prefill_chunk * cuda_prefill.bytes_per_token(self.config)
                   + 2 * cuda_prefill.scratch_halves(self.tinf))
        return 4 * floats + h + prefill + self.sampler_bytes()

    def sampler_bytes(self) -> int:
        """batch_sample's float64 scratch of every row and the slots' histories (int32)."""
        return 8 * MAX_ROWS * self.vocab + 4 * (MAX_SLOTS + 1) * self.max_context

    def check_memory(self, slots: int | None) -> int:
        """The slot count (given, or the most that fit up to MAX_SLOTS); refuse what does not fit."""
        cp = self.cp
        free = cp.cuda.Device().mem_info[0] + cp.get_default_memory_pool().free_bytes()
        fixed = self.scratch_bytes() + MARGIN_BYTES
        per_slot = self.slot_bytes()
        fit = (free - fixed) // per_slot - 1      # one slot more for the padding rows
        gib = 2.0 ** 30
        if slots is not None and not 1 <= slots <= MAX_SLOTS:
            raise ValueError(f"batched decoding runs 1 to {MAX_SLOTS} sequences; ask for {MAX_SLOTS} or fewer.")
        slots = int(min(MAX_SLOTS, fit)) if slots is None else slots
        if slots < 1 or slots > fit:
            kv = (max(slots, 1) + 1) * per_slot / gib
            raise DeviceError(f"{max(slots, 1)} sequences of {self.max_context} positions do not fit on this GPU "
                              f"(KV cache {kv:.2f} GiB + scratch {fixed / gib:.2f} GiB of {free / gib:.2f} GiB free); "
                              "use fewer parallel sequences or a smaller max_context.")
        return slots

    def allocate(self) -> None:
        cp, rows = self.cp, MAX_ROWS
        shape = (self.n_layers, self.n_slots + 1, self.max_context, self.n_kv, self.hd)
        self.k_cache = cp.zeros(shape, dtype=cp.float16)
        self.v_cache = cp.zeros(shape, dtype=cp.float16)
        self.slot_stride = self.max_context * self.n_kv * self.hd
        # tokens, positions, slots; and the slot whose history the sampler extends (a prompt row's
        # output is not a token of its sequence, so it goes to the spare slot, as padding rows' do)
        self.table = cp.zeros((4, rows), dtype=cp.int32)
        self.x = cp.zeros((rows, self.dim), dtype=cp.float32)         # the residual stream
        self.h_norm = cp.zeros((rows, self.kpad("wqkv")), dtype=cp.float16)   # zero padding columns
        self.h_attn = cp.zeros((rows, self.kpad("wo")), dtype=cp.float16)
        self.h_ffn = cp.zeros((rows, self.kpad("w_down")), dtype=cp.float16)
        self.q = cp.zeros((rows, self.n_heads * self.hd), dtype=cp.float32)
        self.parts = cp.zeros(self.parts_floats(), dtype=cp.float32)               # one linear's slices at a time
        self.logits = cp.zeros((rows, self.vocab), dtype=cp.float32)
        self.best = cp.zeros(rows, dtype=cp.int32)
        self.table_host = pinned_empty(4 * rows, np.int32).reshape(4, rows)
        self.allocate_sampler()

    def allocate_sampler(self) -> None:
        """batch_sample's buffers: per row its parameters then its u (one float64 upload with the row
        table), the picked tokens, a float64 scratch row; per slot (the spare one too) its ids by position."""
        cp, rows = self.cp, MAX_ROWS
        self.sampling_host = pinned_empty(rows * (sample_k.P_COUNT + 1), np.float64)
        self.sampling_host[:] = 0
        self.sampling = cp.zeros(rows * (sample_k.P_COUNT + 1), dtype=np.float64)
        self.row_params = self.sampling[: rows * sample_k.P_COUNT].reshape(rows, sample_k.P_COUNT)
        self.row_uniforms = self.sampling[rows * sample_k.P_COUNT:]
        self.history = cp.zeros((self.n_slots + 1, self.max_context), dtype=np.int32)
        self.sample_scratch = cp.zeros((rows, self.vocab), dtype=np.float64)
        self.tokens = cp.zeros(rows, dtype=np.int32)
        self.tokens_host = pinned_empty(rows, np.int32)

    def sampler(self, n: int) -> Launch:
        """The step's last launch: every row's token from its logits (batch_sample)."""
        return sample_k.make_batch_sample(self.sample_mod, n, self.vocab, self.logits, self.best, self.row_params,
                                          self.row_uniforms, self.table[1], self.table[3], self.history,
                                          self.max_context, self.sample_scratch, self.tokens)

    # ------------------------------------------------------------------------- the step

    def gemv(self, name: str, padded: int, h):
        info = self.tinf.info(name)
        view = self.backend.view(name)
        quantized = info.encoding != "f16"
        scales = view.data.ptr + scale_offset(info.encoding, info.shape, info.group) if quantized else 0
        return batch_k.make_gemv(self.mod, info.encoding, self.plan_for(name, padded), view.data.ptr, scales,
                                 info.group if quantized else 0, h, h.shape[1], self.parts,
                                 f"gemv {name.rsplit('.', 1)[-1]}")

    def build_step(self, n: int, prompt_rows: bool = False) -> list[Launch]:
        """The launches of a step of n rows (a bucket); prompt_rows: some slot has several rows."""
        b, mod, c = self.backend, self.mod, self.config
        padded = batch_k.padded_rows(n)
        plan = lambda name: self.plan_for(name, padded)   # noqa: E731
        eps = float(c["norm_eps"])
        tokens, positions, slots = self.table[0], self.table[1], self.table[2]
        emb = self.tinf.info("tok_embeddings").encoding
        from tinyinfer.formats.quant import padded_cols

        launches = [Launch("embed_rows", self.prefill_ops.mod.get_function("embed_rows"), (n,), (256,), (
            b.view("tok_embeddings"), np.int32(EMBEDDING_ID[emb]), np.int32(padded_cols(emb, self.dim, None)),
            np.int32(self.dim), tokens, self.x))]
        before = None                        # the plan of the linear whose slices x still has to add
        for i in range(self.n_layers):
            p = f"layers.{i}."
            bias = b.f32_view(p + "bqkv") if c.get("qkv_bias") else None
            launches += [
                batch_k.make_rmsnorm(mod, n, self.x, self.parts, before, b.f32_view(p + "attn_norm"), self.dim, eps,
                                     self.h_norm, self.h_norm.shape[1]),
                self.gemv(p + "wqkv", padded, self.h_norm),
                batch_k.make_rope_store(mod, n, self.parts, plan(p + "wqkv"), bias, positions, slots, self.n_heads,
                                        self.n_kv, self.hd, b.rope_cos, b.rope_sin, self.q, self.k_cache[i],
                                        self.v_cache[i], self.slot_stride),
                batch_k.make_attention(mod, n, self.q, self.k_cache[i], self.v_cache[i], self.slot_stride, positions,
                                       slots, self.n_heads, self.n_kv, self.hd, c.get("sliding_window"),
                                       self.max_context, self.h_attn, self.h_attn.shape[1], self.backend.n_sms,
                                       early=not prompt_rows),
                self.gemv(p + "wo", padded, self.h_attn),
                batch_k.make_rmsnorm(mod, n, self.x, self.parts, plan(p + "wo"), b.f32_view(p + "ffn_norm"), self.dim,
                                     eps, self.h_norm, self.h_norm.shape[1]),
                self.gemv(p + "w_gate_up", padded, self.h_norm),
                batch_k.make_swiglu(mod, n, self.parts, plan(p + "w_gate_up"), self.ffn, self.h_ffn, self.h_ffn.shape[1]),
                self.gemv(p + "w_down", padded, self.h_ffn),
            ]
            before = plan(p + "w_down")
        launches += [
            batch_k.make_rmsnorm(mod, n, self.x, self.parts, before, b.f32_view("norm"), self.dim, eps, self.h_norm,
                                 self.h_norm.shape[1]),
            self.gemv("output", padded, self.h_norm),
            batch_k.make_logits(mod, n, self.parts, plan("output"), self.vocab, self.logits, self.best),
            self.sampler(n),
        ]
        return launches

    def run_step(self, n: int, prompt_rows: bool = False) -> None:
        """Queue the step of bucket n (with prompt rows or not): its graph, or on first use the launches
        themselves, then its capture."""
        graph = self.graphs.get((n, prompt_rows))
        if graph is not None:
            graph.launch(self.stream)
            return
        launches = self.build_step(n, prompt_rows)
        for launch in launches:
            launch(self.stream, early=self.pdl)
        self.graphs[n, prompt_rows] = self.capture(launches)

    def profile_step(self, n: int) -> dict[str, float]:
        """GPU milliseconds per kernel kind of one step of bucket n over the current rows, each launch
        between two events, queued behind a wait so that they run back to back (without early launch,
        so a little slower than the graph; the step's own writes again)."""
        cp = self.cp
        launches = self.build_step(n)
        events = [cp.cuda.Event() for _ in range(len(launches) + 1)]
        self.backend.wait_launch(PROFILE_HOLD_NS)(self.stream)   # the GPU waits while the host queues them all
        events[0].record(self.stream)
        for launch, event in zip(launches, events[1:]):
            launch(self.stream)             # (without early launch: each kernel's own time)
            event.record(self.stream)
        self.stream.synchronize()
        totals: dict[str, float] = {}
        for launch, start, end in zip(launches, events, events[1:]):
            totals[launch.name] = totals.get(launch.name, 0.0) + cp.cuda.get_elapsed_time(start, end)
        return totals

    def capture(self, launches):
        self.stream.synchronize()            # the eager step ran first: capture changes nothing it wrote
        return self.backend.capture(launches)

    # ------------------------------------------------------------------------- scheduling

    def free_slots(self) -> list[int]:
        return [s for s in range(self.n_slots) if s not in self.sequences]

    def active_slots(self) -> list[int]:
        return sorted(self.sequences)

    def has_work(self) -> bool:
        return bool(self.sequences)

    def submit(self, prompt_ids, params: SamplingParams = GREEDY, max_new_tokens: int = 256, seed=None,
               stop_ids=()) -> int:
        """Put a prompt in a free slot (its prefill starts at the next step); returns the slot."""
        prompt = np.asarray(prompt_ids, dtype=np.int64).ravel()
        if prompt.size == 0:
            raise ValueError("the prompt is empty; pass at least one token id.")
        if prompt.min() < 0 or prompt.max() >= self.vocab:
            raise ValueError(f"token ids must be in [0, {self.vocab}).")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be at least 1.")
        if prompt.size + max_new_tokens - 1 > self.max_context:
            raise ContextOverflowError(
                f"The prompt ({prompt.size} tokens) plus {max_new_tokens} new tokens exceeds the batch's context of "
                f"{self.max_context} tokens; shorten the prompt or ask for fewer tokens.",
                prompt_tokens=int(prompt.size), new_tokens=max_new_tokens, context=self.max_context)
        free = self.free_slots()
        if not free:
            raise SlotsFullError(f"all {self.n_slots} sequence slots are busy; wait for one to finish or "
                                 "cancel one.")
        rng = seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)
        slot = free[0]
        self.sequences[slot] = Sequence(slot, prompt, params, rng, int(max_new_tokens),
                                        frozenset(int(i) for i in stop_ids))
        self.write_history(slot, prompt)
        self.waiting.append(slot)
        return slot

    def write_history(self, slot: int, prompt: np.ndarray) -> None:
        """The prompt's ids at positions 0.. of the slot's history, for the repetition penalty
        (batch_sample appends every token it picks); stream-ordered after the slot's last step."""
        ids = np.ascontiguousarray(prompt, dtype=np.int32)
        self.cp.cuda.runtime.memcpyAsync(self.history[slot].data.ptr, ids.ctypes.data, ids.nbytes, H2D,
                                         self.stream.ptr)

    def cancel(self, slot: int) -> None:
        """Stop a sequence at once; its slot is free (the cache rows it wrote are simply overwritten)."""
        self.sequences.pop(slot, None)
        if slot in self.waiting:
            self.waiting.remove(slot)

    def prefill_span(self, slot: int, ids: np.ndarray, start: int) -> None:
        """K/V of ids at positions start.. into the slot (cuda_prefill's kernels over its cache)."""
        ops = self.prefill_ops
        ops.backend.k_cache, ops.backend.v_cache = self.k_cache[:, slot], self.v_cache[:, slot]
        with self.stream:
            cuda_prefill.run_prefill(ops, self.config, ids, start, ops.chunk, None)

    def prefill_long_prompts(self, must_admit: bool) -> None:
        """GEMM-prefill up to prefill_chunk positions of the waiting prompts with more than step_prefill
        left, first come first (so the running sequences wait at most one chunk); with nothing else to
        put in the step's rows (must_admit), until a prompt can go there."""
        budget = self.prefill_chunk
        for slot in list(self.waiting):
            seq = self.sequences[slot]
            while seq.prompt_left > self.step_prefill and (budget > 0 or must_admit):
                if budget <= 0:
                    budget = self.prefill_chunk
                n = min(budget, seq.prompt_left)
                self.prefill_span(slot, seq.prompt[seq.prefilled: seq.prefilled + n], seq.prefilled)
                seq.prefilled += n
                budget -= n
            if seq.prompt_left <= self.step_prefill:
                must_admit = False        # it fills the rows of this step

    def plan_rows(self) -> list[Row]:
        """The step's rows: each decoding sequence's (by slot), then the waiting prompts' positions, first
        come first, up to MAX_ROWS; a prompt whose last position fits samples its first token."""
        rows = [Row(s, s.token, s.position) for s in sorted(self.sequences.values(), key=lambda s: s.slot)
                if s.slot not in self.waiting]
        for slot in self.waiting:
            seq, room = self.sequences[slot], MAX_ROWS - len(rows)
            if room <= 0:
                break
            if seq.prompt_left > self.step_prefill:
                continue                   # still in GEMM prefill (first, each step)
            last = min(seq.prefilled + room, seq.prompt.size)
            rows += [Row(seq, int(seq.prompt[p]), p, samples=p == seq.prompt.size - 1)
                     for p in range(seq.prefilled, last)]
        return rows

    def step(self) -> dict[int, TokenEvent]:
        """One step: every decoding sequence's next token, and as many positions of the waiting prompts
        as the rows left hold (after up to one chunk of GEMM prefill): {slot: its new token}, for the
        sequences that sampled. Finished sequences leave, their slots free."""
        decoding = any(s.slot not in self.waiting for s in self.sequences.values())
        self.prefill_long_prompts(must_admit=not decoding)
        rows = self.plan_rows()
        if not rows:
            return {}
        tick = time.perf_counter()
        self.stage_sampling(rows)
        tokens, logits = self.decode(rows, self.keep_logits)
        self.step_times.append(time.perf_counter() - tick)
        for row in rows:                   # a prompt's rows, by position: cached now
            if row.position < row.seq.prompt.size - 1:
                row.seq.prefilled = row.position + 1
        sampled = [(r, row) for r, row in enumerate(rows) if row.samples]
        started = {row.slot for _, row in sampled}
        self.waiting = [slot for slot in self.waiting if slot not in started]
        if self.keep_logits:
            self.last_logits = {row.slot: logits[r] for r, row in sampled}
        return {row.slot: self.advance(row.seq, int(tokens[r])) for r, row in sampled}

    def stage_sampling(self, rows: list[Row]) -> None:
        """Row r's parameters and u into the host's sampling buffer (decode uploads it with the row
        table): one rng.random() per sampling row, greedy too, as Backend.generate_ids draws them;
        prompt rows and rows past the step's (padding) greedy with u = 0."""
        p = sample_k.P_COUNT
        params = self.sampling_host[: MAX_ROWS * p].reshape(MAX_ROWS, p)
        uniforms = self.sampling_host[MAX_ROWS * p:]
        params[:], uniforms[:] = sample_k.params_array(GREEDY), 0.0
        for r, row in enumerate(rows):
            if row.samples:
                params[r] = sample_k.params_array(row.seq.params)
                uniforms[r] = row.seq.rng.random()

    def decode(self, rows: list[Row], want_logits: bool):
        """One step of the rows on the device: (each row's token, logits [rows, vocab] or None)."""
        n = bucket_for(len(rows))
        table = self.table_host
        table[0, :n], table[1, :n], table[2, :n], table[3, :n] = 0, 0, self.n_slots, self.n_slots   # padding: the spare slot
        for r, row in enumerate(rows):
            table[:, r] = row.token, row.position, row.slot, row.slot if row.samples else self.n_slots
        cp = self.cp
        cp.cuda.runtime.memcpyAsync(self.table.data.ptr, table.ctypes.data, table.nbytes, H2D, self.stream.ptr)
        cp.cuda.runtime.memcpyAsync(self.sampling.data.ptr, self.sampling_host.ctypes.data, self.sampling_host.nbytes,
                                    H2D, self.stream.ptr)
        self.run_step(n, prompt_rows=not all(row.samples for row in rows))
        cp.cuda.runtime.memcpyAsync(self.tokens_host.ctypes.data, self.tokens.data.ptr, 4 * n, D2H, self.stream.ptr)
        logits = self.logits[: len(rows)].get(stream=self.stream) if want_logits else None
        self.stream.synchronize()
        return self.tokens_host[: len(rows)].copy(), logits

    def advance(self, seq: Sequence, token: int) -> TokenEvent:
        """The sequence's next token (picked on the device); it leaves at a stop id or at its budget."""
        seq.generated.append(token)
        reason = "stop" if token in seq.stop_ids else "length" if len(seq.generated) >= seq.max_new_tokens else None
        if reason:
            del self.sequences[seq.slot]
        return TokenEvent(token, reason)

    def close(self) -> None:
        self.stream.synchronize()
        for name in ("graphs", "k_cache", "v_cache", "parts", "logits", "prefill_ops", "history", "sample_scratch"):
            setattr(self, name, None)


def generate_batch_ids(engine: BatchEngine, prompts, params, max_new_tokens, seeds, stop_ids=()) -> list[list[int]]:
    """Every prompt's generated ids (stop id included), through the engine: prompts enter as slots free up."""
    outputs = [[] for _ in prompts]
    queue = [i for i in range(len(prompts)) if max_new_tokens[i] > 0]
    owner: dict[int, int] = {}
    while queue or engine.has_work():
        while queue and engine.free_slots():
            i = queue.pop(0)
            owner[engine.submit(prompts[i], params[i], max_new_tokens[i], seeds[i], stop_ids)] = i
        for slot, event in engine.step().items():
            outputs[owner[slot]].append(event.token)
    return outputs
