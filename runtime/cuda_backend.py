"""The CUDA backend: weights on the GPU as stored (the linears in 8-row blocks: kernels/layout.py),
hand-written kernels, one CUDA graph per token.

A decode step is a fixed sequence of kernel launches over buffers allocated once:

    per layer [ qkv GEMV (RMSNorm fused in its input stage)
                attention (RoPE + KV append + split-K softmax + merge, one kernel)
                o GEMV (+= residual)
                gate/up GEMV (RMSNorm fused; its epilogue writes silu(gate) * up)
                down GEMV (+= residual) ]
    -> output GEMV (final RMSNorm fused; folds the greedy argmax into one word, `head_best`)
    -> sampler (picks the token, from that word when greedy, and embeds it into x)

5 kernels per layer + 2, or 4 per layer where the tuner fuses the MLP (gate/up and down in one
kernel of thread-block clusters, kernels/mlp.cu, Hopper): the residual is then also held in int64
fixed point, `pending`, which the fused MLP adds to, the qkv GEMV and the output head normalise, and
the o projection adds to (storing the sum in x as well, for the MLP's norm).
The position, the current token and the step index live in a small device
array that the kernels read and the sampler advances, so the whole step is captured once as a CUDA
graph and replayed with no host work in between: the host launches several steps ahead and only
reads tokens back. Tokens the host feeds (prompts, forward()) are embedded by a separate launch.
Generation replays STEPS_PER_GRAPH steps captured in one graph where it can: inside a graph, each
step's first kernel overlaps the previous step's last one (programmatic dependent launch), which a
graph boundary does not allow. Steps at long contexts replay a second version of the step, whose
attention spreads each KV head's rows over a cluster of blocks (attention.plan: long_from); the host
knows every step's position and picks the graph (graph_at).
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import replace

import numpy as np

from tinyinfer.formats.quant import padded_cols
from tinyinfer.kernels import attention as attn_k
from tinyinfer.kernels import build
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels import layout
from tinyinfer.kernels import misc as misc_k
from tinyinfer.kernels import mlp as mlp_k
from tinyinfer.kernels import sampling as sample_k
from tinyinfer.runtime import autotune, cuda_prefill, tune_in_file
from tinyinfer.runtime import reference as ref
from tinyinfer.runtime.backend import Backend
from tinyinfer.runtime.errors import ContextOverflowError, DeviceError
from tinyinfer.runtime.sampling import SamplingParams
from tinyinfer.runtime.weights_upload import data_extent, pinned_empty, upload_weights

H2D, D2D = 1, 3
LOOKAHEAD = 16          # decode steps queued ahead of the token the host is waiting for
# Decode steps per graph when generating: four save a little per token on TinyLlama over one, and
# more buy nothing measurable (runtime/README.md, "Graphs").
STEPS_PER_GRAPH = 4
MARGIN_BYTES = 256 << 20
GREEDY = SamplingParams()
# The tuner's step timings: STEP_REPLAYS graph replays, fewer for a long step, so that one timing
# covers about STEP_TIMING_US of GPU time (Llama-2-7B q4: 7 replays of 1.55 ms; tuning is mostly
# these timings, and a first load of that model must stay within 1.5 s).
STEP_REPLAYS, STEP_TIMING_US = 12, 11_000


def launch_sizes(n_tokens: int) -> list:
    """Decode steps per graph launch when generating n_tokens: STEPS_PER_GRAPH while that many
    remain, then one at a time. The tokens of one launch reach the host together."""
    whole = n_tokens // STEPS_PER_GRAPH
    return [STEPS_PER_GRAPH] * whole + [1] * (n_tokens - whole * STEPS_PER_GRAPH)


def memory_plan(weight_bytes: int, kv_bytes: int, scratch_bytes: int, free_bytes: int) -> dict:
    """What the model needs on the GPU, and whether it fits in the free memory."""
    need = weight_bytes + kv_bytes + scratch_bytes + MARGIN_BYTES
    return {"weights": weight_bytes, "kv_cache": kv_bytes, "scratch": scratch_bytes, "total": need,
            "free": free_bytes, "fits": need <= free_bytes}


def describe_plan(plan: dict, max_context: int) -> str:
    gib = 2.0 ** 30
    return (f"GPU memory: weights {plan['weights'] / gib:.2f} GiB + KV cache {plan['kv_cache'] / gib:.2f} GiB "
            f"({max_context} positions) + scratch {plan['scratch'] / gib:.2f} GiB = {plan['total'] / gib:.2f} GiB "
            f"of {plan['free'] / gib:.2f} GiB free")


def check_plan(plan: dict, max_context: int) -> None:
    if not plan["fits"]:
        raise DeviceError(f"The model does not fit on this GPU ({describe_plan(plan, max_context)}); "
                          "load it with a smaller max_context or convert it with a smaller quantization (q4).")


def check_encodings(tinf) -> None:
    """The kernels read linears as f16/q8/q4, the embedding as f16/f32/bf16 and norms and biases as f32."""
    c = tinf.config
    for name in cuda_prefill.linear_names(c):
        if tinf.info(name).encoding not in gemv_k.SUPPORTED:
            raise DeviceError(f"{name} is stored as {tinf.info(name).encoding}, which the CUDA kernels do not read; "
                              "convert the model with --quant q4, q8 or f16.")
    if tinf.info("tok_embeddings").encoding not in misc_k.EMBEDDING_ID:
        raise DeviceError(f"tok_embeddings is stored as {tinf.info('tok_embeddings').encoding}; "
                          "convert the model again (embeddings are written as f16).")
    norms = ["norm"] + [f"layers.{i}.{n}" for i in range(c["n_layers"]) for n in ("attn_norm", "ffn_norm")]
    norms += [f"layers.{i}.bqkv" for i in range(c["n_layers"])] if c.get("qkv_bias") else []
    for name in norms:
        if tinf.info(name).encoding != "f32":
            raise DeviceError(f"{name} is stored as {tinf.info(name).encoding}, not f32; convert the model again.")


def block_linears(tinf, view, xp) -> None:
    """Rearrange, in place, every linear that the GEMV reads in 8-row blocks (kernels/layout.py);
    view(name) is the tensor's bytes on the device."""
    for name in cuda_prefill.linear_names(tinf.config):
        shape = gemv_k.shape_of(tinf.info(name))
        if shape.blocked:
            layout.block_in_place(view(name), shape, xp)


class CudaBackend(Backend):
    launch_cache = None      # {key: Launch} while loading, see __init__
    last_step_us = None      # the tuner's latest step timing (step_us)
    joint_moves = {}         # the tuner's joint moves: {move: us per step} (autotune.moves_in_step)
    fused_trials = {}        # its last stage: role -> {config: us per fused step} (fused_reader_options)

    def __init__(self, tinf_file, verbose: bool = False, max_context: int | None = None):
        import cupy as cp

        started = time.perf_counter()
        self.cp = cp
        self.tinf = tinf_file
        self.verbose = verbose
        self.config = c = tinf_file.config
        self.max_context = min(max_context or c["max_context"], c["max_context"])
        self.dim, self.n_layers, self.vocab = c["dim"], c["n_layers"], c["vocab_size"]
        self.n_heads, self.n_kv, self.head_dim, self.ffn = c["n_heads"], c["n_kv_heads"], c["head_dim"], c["ffn_dim"]
        self.inspect_device()
        check_encodings(tinf_file)
        try:
            attn_k.check_shape(self.n_heads, self.n_kv, self.head_dim)      # at MAX_THREADS
        except ValueError as e:
            raise DeviceError(f"The CUDA attention kernel cannot run this model: {e}; run with --device cpu.") from None
        self.attn_plan = attn_k.plan(self.n_heads, self.n_kv, self.head_dim, self.max_context, self.n_sms,
                                     self.compute_capability)
        self.plan = memory_plan(data_extent(tinf_file), self.kv_bytes(), self.scratch_bytes(),
                                cp.cuda.Device().mem_info[0])
        check_plan(self.plan, self.max_context)
        self.log(describe_plan(self.plan, self.max_context))

        self.stream = cp.cuda.Stream(non_blocking=True)
        self.timings = {}
        tick = time.perf_counter()
        self.weights = upload_weights(tinf_file, self.stream, progress=None)
        with self.stream:
            block_linears(tinf_file, self.view, cp)
        self.stream.synchronize()
        self.timings["upload_s"] = time.perf_counter() - tick      # (the rearrangement included)
        with self.stream:
            tick = time.perf_counter()
            self.allocate()
            self.compile()
            self.timings["compile_s"] = time.perf_counter() - tick
            # Tuning rebuilds the step for every configuration it times; built once, each launch
            # keeps its marshalled arguments (7B q4: 3,000 launches built in 0.3 s without this).
            self.launch_cache = {}
            tick = time.perf_counter()
            tuning = self.tune()
            self.timings["tune_s"] = time.perf_counter() - tick
            tick = time.perf_counter()
            self.use_tuning(tuning)
            self.timings["capture_s"] = time.perf_counter() - tick
            self.launch_cache = None
        self.stream.synchronize()
        self.timings["load_s"] = time.perf_counter() - started
        self.log(self.describe())

    # ------------------------------------------------------------------------------- setup

    def log(self, message: str) -> None:
        if self.verbose:
            print(message, file=sys.stderr)

    def inspect_device(self) -> None:
        cp = self.cp
        device = cp.cuda.Device()
        props = cp.cuda.runtime.getDeviceProperties(device.id)
        self.gpu_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        self.compute_capability = int(device.compute_capability)
        self.n_sms = int(props["multiProcessorCount"])
        self.l2_bytes = int(props.get("l2CacheSize", 64 << 20))
        # Programmatic dependent launch inside the decode graph (Hopper+); TINYINFER_PDL=0 turns it off.
        self.pdl = self.compute_capability >= 90 and os.environ.get("TINYINFER_PDL", "1") != "0"
        if self.compute_capability < build.MIN_COMPUTE_CAPABILITY:
            raise DeviceError(f"{self.gpu_name} has compute capability {self.compute_capability / 10:.1f}; the CUDA "
                              "backend needs 7.5 (Turing) or newer, so run with --device cpu.")

    def kv_bytes(self) -> int:
        return 2 * self.n_layers * self.max_context * self.n_kv * self.head_dim * 2

    def scratch_bytes(self) -> int:
        q_rows = (self.n_heads + 2 * self.n_kv) * self.head_dim
        floats = 2 * self.dim + q_rows + self.n_heads * self.head_dim + self.ffn + self.vocab
        floats += self.n_heads * self.attn_plan.slices * (self.head_dim + 2) + 2 * self.max_context * self.head_dim
        tuning_flush = 2 * self.l2_bytes
        return 4 * floats + 8 * (2 * self.vocab + self.max_context) + tuning_flush

    def view(self, name: str):
        info = self.tinf.info(name)
        return self.weights[info.offset: info.offset + info.nbytes]

    def f32_view(self, name: str):
        return self.view(name).view(self.cp.float32)

    def allocate(self) -> None:
        """Every buffer the step touches, allocated before capture and kept for the backend's life."""
        cp, c = self.cp, self.config
        hd, ctx = self.head_dim, self.max_context
        self.x = cp.zeros(self.dim, dtype=cp.float32)
        self.qkv = cp.zeros((self.n_heads + 2 * self.n_kv) * hd, dtype=cp.float32)
        self.attn = cp.zeros(self.n_heads * hd, dtype=cp.float32)
        self.ffn_hidden = cp.zeros(self.ffn, dtype=cp.float32)     # silu(gate) * up
        self.pending = cp.zeros(self.dim, dtype=cp.int64)           # the residual in fixed point (kernels/mlp.py)
        self.logits = cp.zeros(self.vocab, dtype=cp.float32)
        self.head_best = cp.zeros(1, dtype=cp.uint64)     # the head's greedy argmax for the sampler (gemv.cu)
        self.k_cache = cp.zeros((self.n_layers, ctx, self.n_kv, hd), dtype=cp.float16)
        self.v_cache = cp.zeros((self.n_layers, ctx, self.n_kv, hd), dtype=cp.float16)
        cos, sin = ref.rope_tables(hd, ctx, c["rope_theta"], c.get("rope_scaling"))
        self.rope_cos, self.rope_sin = cp.asarray(cos), cp.asarray(sin)
        self.part_o = cp.zeros(self.n_heads * self.attn_plan.slices * hd, dtype=cp.float32)
        self.part_ml = cp.zeros(self.n_heads * self.attn_plan.slices * 2, dtype=cp.float32)
        self.counters = cp.zeros(self.n_kv, dtype=cp.uint32)
        self.state = cp.zeros(4, dtype=cp.int32)
        # Pinned host memory, which the sampler writes over the bus (mapped: CUDA's unified addressing
        # makes the pointer valid in kernels): the host reads each token once its step's event has
        # passed, with no copy in the stream between two steps.
        self.out_tokens = pinned_empty(ctx + 1, np.int32)
        self.out_tokens[:] = 0
        self.params = cp.asarray(sample_k.params_array(GREEDY))
        self.uniforms = cp.zeros(ctx + 1, dtype=cp.float64)
        self.seen = cp.zeros(self.vocab, dtype=cp.uint8)
        self.sample_scratch = cp.zeros(self.vocab, dtype=cp.float64)

    def gemv_shapes(self) -> dict:
        """(role -> GemvShape) for the five matrices of the model."""
        info = self.tinf.info
        return {
            "wqkv": gemv_k.shape_of(info("layers.0.wqkv"), "rmsnorm",
                                    "store_bias" if self.config.get("qkv_bias") else "store"),
            "wo": gemv_k.shape_of(info("layers.0.wo"), "plain", "add"),
            "w_gate_up": gemv_k.shape_of(info("layers.0.w_gate_up"), "rmsnorm", "swiglu"),
            "w_down": gemv_k.shape_of(info("layers.0.w_down"), "plain", "add"),
            "output": gemv_k.shape_of(info("output"), "rmsnorm", "store_argmax"),
        }

    def mlp_shape(self):
        """The fused MLP's shape, or None where mlp.cu cannot run this model on this GPU."""
        shape = mlp_k.MlpShape(self.shapes["w_gate_up"], self.shapes["w_down"])
        return shape if mlp_k.can_fuse(shape, self.compute_capability) else None

    def layer_shape(self, role: str, layer: int):
        """Every layer must match layer 0 (one tuned config per role)."""
        name = "output" if role == "output" else f"layers.{layer}.{role}"
        shape = self.shapes[role]
        info = self.tinf.info(name)
        if (info.encoding, info.group or 0) != (shape.encoding, shape.group):
            raise DeviceError(f"{name} is {info.encoding} (group {info.group}) unlike layer 0; the CUDA backend "
                              "needs one encoding per matrix role, so convert the model again.")
        return name

    def compile(self) -> None:
        cc = self.compute_capability
        self.shapes = self.gemv_shapes()
        # The staggered kernels (gemv.cu STAGGER) are made when the tuner reaches them, or when a
        # tuning that chose them is used (GemvModules.module_for): twice the modules here would
        # slow every load.
        self.gemv_module = gemv_k.GemvModules([(shape, config) for shape in self.shapes.values()
                                               for config in gemv_k.all_configs(shape, cc) if not config.staggered], cc)
        timed_alone = [(shape, config) for shape in self.shapes.values() for config in gemv_k.configs_for(shape, cc)]
        self.attn_module = attn_k.compile_attention(cc, self.attn_plan.cluster)
        self.misc_module = misc_k.compile_misc(cc)
        self.sample_module = sample_k.compile_sampler(cc)
        # NVRTC now, on parallel threads, so its time is not charged to tuning. Functions load lazily,
        # one after the other into device memory, in the order below; loading the split-K kernels
        # among the others made the step slower with the same kernels chosen (runtime/README.md,
        # "Load order"), so they load last and the others keep the places they had before split-K
        # existed. The other ring depths load when the tuner first tries them.
        build.compile_all([*self.gemv_module.modules, self.attn_module, self.misc_module, self.sample_module])
        for shape, config in timed_alone:
            if config.split == 1:
                self.gemv_module.get_function(gemv_k.name_expression(shape, config))
        self.attn_module.get_function(self.attn_plan.kernel)
        self.misc_module.get_function("embed")
        self.sample_module.get_function("sample_token")
        for shape, config in timed_alone:
            if config.split > 1:
                self.gemv_module.get_function(gemv_k.name_expression(shape, config))

    # ------------------------------------------------------------------------------ launches

    def cached_launch(self, key, make):
        """make(), or the launch made for `key` earlier while loading (self.launch_cache)."""
        if self.launch_cache is None:
            return make()
        if key not in self.launch_cache:
            self.launch_cache[key] = make()
        return self.launch_cache[key]

    def gemv_launch(self, role: str, layer: int, config: gemv_k.GemvConfig, pending: bool = False):
        """pending: the variant that reads the fixed-point residual of a fused step (wqkv, wo and output only)."""
        return self.cached_launch(("gemv", role, layer, config, pending),
                                  lambda: self.make_gemv_launch(role, layer, config, pending))

    def pending_config(self, role: str, config: gemv_k.GemvConfig) -> gemv_k.GemvConfig:
        """The role's configuration for its variant that reads the fixed-point residual (gemv.pending_variant)."""
        return gemv_k.pending_variant(self.pending_shape(role), config)

    def pending_shape(self, role: str) -> gemv_k.GemvShape:
        shape = self.shapes[role]
        if role == "wo":
            return replace(shape, output="add_pending")
        if role in ("wqkv", "output"):
            return replace(shape, input="rmsnorm_pending")
        raise ValueError(f"the {role} GEMV does not read the fixed-point residual")

    def make_gemv_launch(self, role: str, layer: int, config: gemv_k.GemvConfig, pending: bool = False):
        eps = float(self.config["norm_eps"])
        name = self.layer_shape(role, layer)
        shape = self.shapes[role]
        module = self.gemv_module
        if pending:     # built on first use: only a fused step reads the fixed-point residual
            shape, config = self.pending_shape(role), self.pending_config(role, config)
            module = gemv_k.GemvModules([(shape, config)], self.compute_capability)
        if role == "wqkv":
            x, y, aux = self.x, self.qkv, self.f32_view(f"layers.{layer}.attn_norm")
        elif role == "wo":
            x, y, aux = self.attn, self.x, None
        elif role == "w_gate_up":
            x, y, aux = self.x, self.ffn_hidden, self.f32_view(f"layers.{layer}.ffn_norm")
        elif role == "w_down":
            x, y, aux = self.ffn_hidden, self.x, None
        else:
            x, y, aux = self.x, self.logits, self.f32_view("norm")
        return gemv_k.make_gemv(module, shape, config, self.view(name), x, y, aux, eps, name=f"gemv {role}",
                                pending=self.pending if pending else None,
                                best=self.head_best if shape.output == "store_argmax" else None,
                                bias=self.f32_view(f"layers.{layer}.bqkv") if shape.output == "store_bias" else None)

    def mlp_launch(self, layer: int, config: mlp_k.MlpConfig):
        return self.cached_launch(("mlp", layer, config), lambda: mlp_k.make_mlp(
            mlp_k.compile_mlp(self.mlp_shape(), config, self.compute_capability), self.mlp_shape(), config,
            self.view(self.layer_shape("w_gate_up", layer)), self.view(self.layer_shape("w_down", layer)), self.x,
            self.f32_view(f"layers.{layer}.ffn_norm"), float(self.config["norm_eps"]), self.pending))

    def attention_launch(self, layer: int, slices: int):
        return self.cached_launch(("attention", layer, slices), lambda: self.make_attention_launch(layer, slices))

    def make_attention_launch(self, layer: int, slices: int):
        kv_row_bytes = self.n_kv * self.head_dim * 2
        return attn_k.make_attention(
            self.attn_module, self.n_heads, self.n_kv, self.head_dim, slices, self.attn_plan.threads,
            self.qkv,
            self.k_cache[layer], self.v_cache[layer], self.state, self.rope_cos, self.rope_sin,
            self.part_o, self.part_ml, self.counters, self.attn, kv_bytes=2 * kv_row_bytes,
            kernel=self.attn_plan.kernel, window=self.config.get("sliding_window"))

    def embed_launch(self):
        info = self.tinf.info("tok_embeddings")
        cols_pad = padded_cols(info.encoding, self.dim, None)
        return misc_k.make_embed(self.misc_module, self.view("tok_embeddings"), info.encoding, cols_pad, self.dim,
                                 self.state, self.x, self.pending, self.head_best)

    def sampler_launch(self):
        info = self.tinf.info("tok_embeddings")
        return sample_k.make_sampler(self.sample_module, self.vocab, self.logits, self.params, self.uniforms,
                                     self.seen, self.sample_scratch, self.state, self.out_tokens,
                                     self.view("tok_embeddings"), info.encoding,
                                     padded_cols(info.encoding, self.dim, None), self.x, self.pending,
                                     self.head_best)

    def build_step(self, tuning: dict, long_context: bool = False) -> list:
        """One token: the layers, the output head and the sampler (which also embeds the token it
        picks, so x is ready for the next replay). Tokens fed by the host go through self.embed.
        tuning: role -> GemvConfig, and "mlp" -> MlpConfig where the MLP is fused. long_context: the
        step for positions from attn_plan.long_from on."""
        self.embed = self.embed_launch()
        fused = tuning.get("mlp")
        slices = self.attn_plan.slices_at(long_context)
        step = []
        for layer in range(self.n_layers):
            step.append(self.gemv_launch("wqkv", layer, tuning["wqkv"], pending=fused is not None))
            step.append(self.attention_launch(layer, slices))
            step.append(self.gemv_launch("wo", layer, tuning["wo"], pending=fused is not None))
            if fused is not None:
                step.append(self.mlp_launch(layer, fused))
            else:
                step.append(self.gemv_launch("w_gate_up", layer, tuning["w_gate_up"]))
                step.append(self.gemv_launch("w_down", layer, tuning["w_down"]))
        step.append(self.gemv_launch("output", 0, tuning["output"], pending=fused is not None))
        step.append(self.sampler_launch())
        return step

    def use_tuning(self, tuning: dict) -> None:
        """Decode with these GEMV configurations (role -> GemvConfig): the step is rebuilt and captured."""
        with self.stream:
            self.tuning = tuning
            self.step = self.build_step(tuning)
            self.graph = self.capture(self.step)
            self.graphs = {}                           # the other step graphs, captured on first use (graph_at)

    def is_long_context(self, pos: int) -> bool:
        """Whether the step at position pos is the long-context one (attention.plan: long_from)."""
        return 0 < self.attn_plan.long_from <= pos

    def graph_at(self, pos: int, steps: int = 1):
        """The graph of `steps` decode steps from position pos: self.graph (the tuned step, alone),
        or captured on first use: several steps in one graph, and the long-context step once the
        last of them reaches attn_plan.long_from."""
        long_context = self.is_long_context(pos + steps - 1)
        if steps == 1 and not long_context:
            return self.graph
        key = (long_context, steps)
        if key not in self.graphs:
            step = self.build_step(self.tuning, long_context) if long_context else self.step
            self.graphs[key] = self.capture(step * steps)
        return self.graphs[key]

    def capture(self, launches):
        stream = self.stream
        stream.begin_capture()
        try:
            for launch in launches:
                launch(stream, early=self.pdl)
        except BaseException:
            try:
                stream.end_capture()        # leave the stream usable; report the launch's own error
            except Exception:
                pass
            raise
        graph = stream.end_capture()
        graph.upload(stream)
        return graph

    # ------------------------------------------------------------------------------ tuning

    def wait_launch(self, nanoseconds: int):
        return misc_k.make_wait(self.misc_module, nanoseconds)

    def flush_l2(self):
        """A launch that reads a buffer twice the L2 size, evicting the weights of earlier timings."""
        cp = self.cp
        if getattr(self, "_flush", None) is None:
            self._flush_buffer = cp.ones(2 * self.l2_bytes // 16 * 16, dtype=cp.uint8)
            self._flush_sink = cp.zeros(1, dtype=cp.uint32)
            self._flush = misc_k.make_read_bandwidth(self.misc_module, self._flush_buffer, self._flush_sink,
                                                     self.n_sms)
        return self._flush

    def tune(self) -> dict:
        self.step_contests = {}      # role -> {config: us per decode step}, where timing alone was not enough
        # Choices shipped in the file for exactly this GPU and kernel build come first (HUB.md).
        allowed = {role: gemv_k.all_configs(shape, self.compute_capability) for role, shape in self.shapes.items()}
        shipped, message = tune_in_file.shipped_gemv_configs(self.tinf, tune_in_file.backend_key(self), allowed,
                                                             self.mlp_candidates())
        self.log(message)
        if shipped is not None:
            self.tuning_source, self.tuning_times = "file", {}
            return shipped
        key = autotune.cache_key(self.tinf, self.gpu_name, self.compute_capability, build.source_hash())
        cached = tune_in_file.gemv_configs(autotune.load_cached(key), allowed, self.mlp_candidates())
        roles = list(self.shapes)
        if cached is not None:
            self.tuning_source = "cache"
            self.tuning_times = {}
            return cached
        candidates = {}
        for role in roles:
            layers = [0] if role == "output" else range(self.n_layers)
            candidates[role] = {config: [self.gemv_launch(role, layer, config) for layer in layers]
                                for config in gemv_k.configs_for(self.shapes[role], self.compute_capability)}
        self.x.fill(0.5)
        self.ffn_hidden.fill(0.5)
        self.attn.fill(0.5)
        best, self.tuning_times = autotune.tune(candidates, self.stream, self.wait_launch, self.flush_l2(), self.pdl)
        self._flush = self._flush_buffer = None
        best, self.step_contests = autotune.confirm_in_step(best, self.tuning_times, self.step_us)
        # Three stages in the step, each over the roles largest matrix first. The depth: the largest
        # matrix's moves the step most and changes which depths suit the others (runtime/README.md,
        # "Tuning"); the output head runs once per token, so its depth moves the step by less than
        # the timing noise. Then the grid: balanced or not changes which block slots the next kernels
        # find free. Then the ring refilled during the products or after them, which wins or loses
        # by role and model (kernels/README.md, "Refill").
        by_size = sorted((r for r in roles if r != "output"), key=lambda r: -self.shapes[r].weight_bytes)
        for options_of in (self.depth_options, self.grid_options, self.refill_options):
            best = self.try_in_step(best, {role: options_of(role, best[role]) for role in by_size})
        # Then the contest losers again, each together with the next GEMV's other depths, and every
        # role in wide blocks at once. Then, on the choices that won, the first ring item staggered
        # around the input's round trip (gemv.cu STAGGER; its kernels built here, in parallel).
        moves = self.neighbour_moves(best) + self.wide_moves(best)
        best, self.joint_moves = autotune.moves_in_step(best, moves, self.step_us)
        rivals = {role: self.stagger_options(role, best[role]) for role in by_size + ["output"]}
        build.compile_all(list(dict.fromkeys(self.gemv_module.module_for(gemv_k.name_expression(self.shapes[role], c))
                                             for role, configs in rivals.items() for c in configs)))
        best = self.try_in_step(best, rivals)
        best = self.fusion_contest(best)
        # Last, where the MLP is fused: the GEMVs that then read the fixed-point residual, timed in
        # the fused step (their stages above ran in the unfused one), the output head first.
        if best.get("mlp") is not None:
            options = {role: self.fused_reader_options(role, best[role]) for role in ("output", "wqkv", "wo")}
            best, self.fused_trials = autotune.variants_in_step(best, {r: o for r, o in options.items() if o},
                                                                self.step_us)
        self.tuning_source = "measured"
        autotune.save_cached(key, {role: config.as_dict() for role, config in best.items()},
                             {"gpu": self.gpu_name, "compute_capability": self.compute_capability,
                              "file": str(self.tinf.path), "shapes": {r: self.shapes[r].key for r in roles}})
        return best

    def mlp_candidates(self) -> list:
        """The fused MLP's configurations the tuner tries: none where it cannot run, nor where its
        blocks do not all fit on the GPU at once at two per SM (Llama-2-7B: 43 clusters of 8, whose
        second round of clusters made the first phase much longer; kernels/README.md, "Fused MLP")."""
        shape = self.mlp_shape()
        if shape is None or mlp_k.blocks(shape) > 2 * self.n_sms:
            return []
        return list(mlp_k.CANDIDATES)

    def fusion_contest(self, best: dict) -> dict:
        """The tuned GEMVs against each fused-MLP configuration with them, in the whole step (the
        contest goes to step_contests["mlp"]; None stands for the two GEMVs)."""
        candidates = self.mlp_candidates()
        if not candidates:
            return best
        cc, shape = self.compute_capability, self.mlp_shape()
        pending = [(self.pending_shape(role), self.pending_config(role, best[role])) for role in ("wqkv", "wo", "output")]
        build.compile_all([mlp_k.compile_mlp(shape, c, cc) for c in candidates]
                          + gemv_k.GemvModules(pending, cc).modules)
        times = {None: self.step_us(best)}
        times.update({config: self.step_us({**best, "mlp": config}) for config in candidates})
        self.step_contests["mlp"] = times
        fused = min(candidates, key=times.get)
        return {**best, "mlp": fused} if times[fused] < times[None] * (1 - autotune.STEP_MARGIN) else best

    def fused_reader_options(self, role: str, chosen: gemv_k.GemvConfig) -> list:
        """What the tuner's last stage tries for a GEMV that reads the fused step's fixed-point
        residual (wqkv, wo, output): the chosen configuration with the other grid; for the output
        head, every configuration that tied with it alone (autotune.TIE), and for an unsplit o
        projection the fastest split-K one alone, at each depth, with either grid. Only options that
        run a different kernel or grid in the fused step (pending_config, and the grid of that
        kernel's launch).
        The head is the one whose earlier stages skip (its depth moved the unfused step by less
        than the noise), and in the fused step it moved it most. The o projection launches just
        before the fused MLP, whose clusters start early in the SMs it leaves free, so a split-K
        configuration too slow alone to enter its step contest can still speed up the fused step
        (runtime/README.md, "Tuning")."""
        shape = self.shapes[role]
        tried = [chosen]
        alone = self.tuning_times.get(role) or {}
        if role == "output" and alone:
            tried += [v for c in autotune.tied(alone) for v in gemv_k.depth_variants(shape, c)]
        split = [c for c in alone if c.split > 1] if role == "wo" and chosen.split == 1 else []
        if split:
            tried += gemv_k.depth_variants(shape, min(split, key=alone.get))
        tried += [replace(c, balanced=not c.balanced) for c in tried]
        # The fused step's launches: their grids follow their own kernels' occupancy (the pending
        # variant's registers differ from the plain kernel's), so build those kernels first, in parallel.
        build.compile_all(gemv_k.GemvModules([(self.pending_shape(role), self.pending_config(role, c)) for c in tried],
                                             self.compute_capability).modules)
        options, seen = [], {}
        for config in tried:
            kernel = replace(self.pending_config(role, config), balanced=False)     # the grid tells that apart
            runs = (kernel, self.gemv_launch(role, 0, config, pending=True).grid)
            if runs not in seen:
                seen[runs] = config
                options.append(config)
        return options[1:]

    def depth_options(self, role: str, chosen: gemv_k.GemvConfig) -> list:
        """The configurations the depth stage tries for a role: the chosen one and, unless it lost by
        more than autotune.RIVAL_NEAR, the loser of the role's step contest (split-K or a wide block
        against neither, or R = 1 against R = 2), each at every depth. The contest is held at the
        default depths, where a split and an unsplit projection can tie while at the depths chosen
        later one of them is clearly faster: decided at the contest alone, fresh tunings sometimes
        kept the slower set (runtime/README.md, "Tuning")."""
        shape = self.shapes[role]
        options = gemv_k.depth_variants(shape, chosen)
        contest = self.step_contests.get(role, {})
        for rival, us in contest.items():
            if rival != chosen and autotune.near(us, contest.values()):
                options += [c for c in gemv_k.depth_variants(shape, rival) if c not in options]
        return options

    def neighbour_moves(self, best: dict) -> list:
        """Joint moves for autotune.moves_in_step: where a role's step contest had a rival (split-K
        or a wide block against neither, R = 1 against R = 2) within autotune.RIVAL_NEAR of the
        role's fastest step time, the rival at its fastest timed depth together with each other depth
        of the GEMV after it in the step (the down projection is followed by the next layer's wqkv),
        whose early blocks start beside its last ones. (The joint wins found were of that kind; the
        GEMV before it was tried too and never won: runtime/README.md, "Tuning".)"""
        order = ["wqkv", "wo", "w_gate_up", "w_down"]
        moves = []
        for role, after in zip(order, order[1:] + order[:1]):
            timed = self.step_contests.get(role, {})
            rivals = {c: us for c, us in timed.items() if autotune.near(us, timed.values())
                      and (c.split, c.row_tiles, c.warps) != (best[role].split, best[role].row_tiles, best[role].warps)}
            if rivals:
                rival = min(rivals, key=rivals.get)
                moves += [{role: rival, after: c} for c in gemv_k.depth_variants(self.shapes[after], best[after])
                          if c != best[after]]
        return moves

    def wide_moves(self, best: dict) -> list:
        """The joint moves to wide blocks (gemv.cu WIDE) for autotune.moves_in_step: every role at its
        fastest wide configuration timed alone, at that default depth and at each depth of
        gemv.STEP_DEPTHS (roles whose row tiles do not have that depth keep theirs). Every GEMV in
        wide blocks can win where no role alone gains much, likely because a wide block takes a whole
        SM, which a wide block of the kernel before frees at once, and two blocks of 8 warps only when
        both have ended; and the wide move pays on Llama-2-7B q4 only at depth 1, not at the default
        depth (kernels/README.md, "Block width")."""
        wide = {}
        for role, times in self.tuning_times.items():
            timed = {c: us for c, us in times.items() if c.wide}
            if timed:
                wide[role] = min(timed, key=timed.get)
        moves = [wide]
        for depth in sorted({d for depths in gemv_k.STEP_DEPTHS.values() for d in depths}):
            moves.append({role: replace(c, depth=depth) if depth in gemv_k.STEP_DEPTHS[c.row_tiles] else c
                          for role, c in wide.items()})
        distinct = []
        for move in moves:
            if move not in distinct and any(best[role] != config for role, config in move.items()):
                distinct.append(move)
        return distinct

    def grid_options(self, role: str, chosen: gemv_k.GemvConfig) -> list:
        """The chosen configuration with the balanced grid (gemv.grid_units), where that is a
        different grid."""
        rival = replace(chosen, balanced=not chosen.balanced)
        return [rival] if self.gemv_launch(role, 0, rival).grid != self.gemv_launch(role, 0, chosen).grid else []

    def refill_options(self, role: str, chosen: gemv_k.GemvConfig) -> list:
        """The chosen configuration with the ring refilled the other way (gemv.cu REFILL), where that
        kernel exists."""
        rival = replace(chosen, refill=not chosen.refill)
        return [rival] if gemv_k.can_refill(self.shapes[role], rival) else []

    def try_in_step(self, best: dict, options: dict) -> dict:
        """autotune.variants_in_step over options (role -> configurations to try, in role order; roles
        with none are skipped); every timing kept in step_contests."""
        best, trials = autotune.variants_in_step(best, {r: o for r, o in options.items() if o}, self.step_us)
        for role, times in trials.items():
            self.step_contests[role] = {**self.step_contests.get(role, {}), **times}
        return best

    def stagger_options(self, role: str, chosen: gemv_k.GemvConfig) -> list:
        """The chosen configuration with its first ring item staggered the other way (gemv.cu
        STAGGER), where that kernel exists (GEMVs with an RMSNorm input: gemv.can_stagger)."""
        rival = replace(chosen, staggered=not chosen.staggered)
        return [rival] if gemv_k.can_stagger(self.shapes[role], rival) else []

    def step_us(self, tuning: dict, replays: int | None = None) -> float:
        """GPU microseconds per decode step with these GEMV configurations: graph replays back to
        back from position 0 (greedy; what the cache rows hold does not change the time). replays:
        by default STEP_REPLAYS, or fewer once a step timed longer than STEP_TIMING_US / STEP_REPLAYS."""
        if replays is None:
            last = self.last_step_us
            replays = STEP_REPLAYS if not last else max(6, min(STEP_REPLAYS, int(STEP_TIMING_US / last)))
        self.use_tuning(tuning)
        with self.stream:
            self.set_sampling(GREEDY)
            self.set_state(0, 0, 0)
            self.graph.launch(self.stream)             # the first replay uploads and warms up
            self.set_state(0, 0, 0)
            self.last_step_us = self.replay_us(max(1, min(replays, self.max_context - 2)))
        return self.last_step_us

    def replay_us(self, n_steps: int, graph=None) -> float:
        """GPU microseconds per step of n_steps replays of a one-step graph (self.graph unless given)
        back to back from the current state, timed with events on the stream."""
        graph = graph or self.graph
        start = self.stream.record()
        for _ in range(n_steps):
            graph.launch(self.stream)
        end = self.stream.record()
        end.synchronize()
        return self.cp.cuda.get_elapsed_time(start, end) * 1000.0 / n_steps

    def describe(self) -> str:
        lines = [f"cuda backend: {self.gpu_name} (sm_{self.compute_capability}, {self.n_sms} SMs), "
                 f"{len(self.step)} kernels per token in one CUDA graph "
                 f"({'with' if self.pdl else 'without'} programmatic dependent launch), attention kernel "
                 f"{self.attn_plan.kernel}: {self.attn_plan.slices} blocks of {self.attn_plan.threads} threads per "
                 f"KV head{' in thread-block clusters' if self.attn_plan.cluster else ''}"
                 + (f"; from position {self.attn_plan.long_from}: {self.attn_plan.long_slices} blocks per KV head "
                    "in a thread-block cluster" if self.attn_plan.long_from else ""),
                 f"load {self.timings['load_s']:.2f} s (upload {self.timings['upload_s']:.2f} s, compile "
                 f"{self.timings['compile_s']:.2f} s, tune {self.timings['tune_s']:.2f} s [{self.tuning_source}], "
                 f"capture {self.timings['capture_s']:.2f} s)"]
        for role, config in self.tuning.items():
            if role == "mlp":
                lines.append(f"  {self.mlp_shape().key}: fused, R={config.row_tiles} warps={config.warps} "
                             f"depth={config.depth}")
                continue
            times = self.tuning_times.get(role, {})
            detail = ", ".join(f"{c.label} {t:.1f}us" for c, t in sorted(times.items(), key=lambda item: item[1]))
            lines.append(f"  {self.shapes[role].key:40s} R={config.row_tiles} warps={config.warps}"
                         + (f" split={config.split}" if config.split > 1 else "") + f" depth={config.depth}"
                         + (" balanced" if config.balanced else "") + (" refill" if config.refill else "")
                         + (" staggered" if config.staggered else "")
                         + (f"  ({detail})" if detail else ""))
            if role in self.step_contests:
                lines.append("    in the whole step: " + ", ".join(
                    f"{c.label} {us:.1f}" for c, us in self.step_contests[role].items()) + " us per token")
        if "mlp" in self.step_contests:
            lines.append("  MLP fused or not, in the whole step: " + ", ".join(
                f"{c.label if c else 'two GEMVs'} {us:.1f}" for c, us in self.step_contests["mlp"].items())
                + " us per token")
        if self.joint_moves:
            lines.append("  joint moves in the whole step: " + ", ".join(
                " + ".join(f"{role} {c.label}" for role, c in move) + f" {us:.1f}"
                for move, us in self.joint_moves.items()) + " us per token")
        for role, times in self.fused_trials.items():
            lines.append(f"  {role} in the fused step: " + ", ".join(f"{c.label} {us:.1f}" for c, us in times.items())
                         + " us per token")
        return "\n".join(lines)

    # ------------------------------------------------------------------------------ running

    def upload(self, device_array, host_array, offset_bytes: int = 0) -> None:
        """Stream-ordered copy of a small host array (pageable: staged by the driver at once)."""
        host_array = np.ascontiguousarray(host_array)
        self.cp.cuda.runtime.memcpyAsync(device_array.data.ptr + offset_bytes, host_array.ctypes.data,
                                         host_array.nbytes, H2D, self.stream.ptr)

    def set_state(self, pos: int, token: int, step: int = 0) -> None:
        """Position, current token (embedded into x here) and output index for the next replay."""
        self.upload(self.state, np.array([pos, token, step, 0], dtype=np.int32))
        self.embed(self.stream)

    def set_sampling(self, params: SamplingParams) -> None:
        self.upload(self.params, sample_k.params_array(params))

    def check_room(self, last_position: int) -> None:
        if last_position >= self.max_context:
            raise ContextOverflowError(f"Position {last_position} is beyond the model's context of "
                                       f"{self.max_context} tokens; use a shorter prompt or fewer new tokens.")

    def reset(self) -> None:
        pass  # positions >= start_pos are written before they are read

    def run_steps(self, token_ids: np.ndarray, start_pos: int, logits_out=None) -> None:
        """Queue one graph replay per token, teacher-forced, optionally copying each step's logits."""
        cp = self.cp
        ids = cp.asarray(np.asarray(token_ids, dtype=np.int32))
        graphs = [self.graph_at(start_pos + i) for i in range(len(token_ids))]   # any capture before the queueing
        self.set_state(start_pos, int(token_ids[0]))
        self.set_sampling(GREEDY)
        for i in range(len(token_ids)):
            if i:
                cp.cuda.runtime.memcpyAsync(self.state.data.ptr + 4, ids.data.ptr + 4 * i, 4, D2D, self.stream.ptr)
                self.embed(self.stream)
            graphs[i].launch(self.stream)
            if logits_out is not None:
                cp.cuda.runtime.memcpyAsync(logits_out[i].data.ptr, self.logits.data.ptr, 4 * self.vocab, D2D,
                                            self.stream.ptr)
        self._ids_alive = ids   # keep the ids buffer until the queued copies have run

    def forward(self, token_ids, start_pos: int) -> np.ndarray:
        token_ids = np.asarray(token_ids, dtype=np.int64).ravel()
        self.check_room(start_pos + token_ids.size - 1)
        self.stream.synchronize()
        with self.stream:
            prefill = cuda_prefill.for_prompt(self, token_ids.size)   # long prompts: chunked GEMMs
            if prefill is not None:
                out = prefill.run(token_ids, start_pos, "all")
            else:
                out = self.cp.empty((token_ids.size, self.vocab), dtype=self.cp.float32)
                self.run_steps(token_ids, start_pos, out)
            result = out.get(stream=self.stream)
        self.stream.synchronize()
        return result

    def decode_forward(self, token_ids, start_pos: int) -> np.ndarray:
        """Logits [T, vocab] from the decode engine alone: one graph replay per token (no prefill)."""
        token_ids = np.asarray(token_ids, dtype=np.int64).ravel()
        self.check_room(start_pos + token_ids.size - 1)
        self.stream.synchronize()
        with self.stream:
            out = self.cp.empty((token_ids.size, self.vocab), dtype=self.cp.float32)
            self.run_steps(token_ids, start_pos, out)
            result = out.get(stream=self.stream)
        self.stream.synchronize()
        return result

    def generate_ids(self, prompt_ids, start_pos: int, params: SamplingParams, max_new_tokens: int, rng):
        """Sample on the device; one rng.random() per generated token, as the reference loop draws them."""
        prompt = np.asarray(prompt_ids, dtype=np.int64).ravel()
        if max_new_tokens <= 0:
            self.forward(prompt, start_pos)
            return
        self.check_room(start_pos + prompt.size + max_new_tokens - 2)
        rng_state = rng.bit_generator.state
        uniforms = rng.random(max_new_tokens)
        produced = 0
        try:
            self.stream.synchronize()
            with self.stream:
                prefill = cuda_prefill.for_prompt(self, prompt.size - 1)
                if prefill is not None:
                    prefill.run(prompt[:-1], start_pos, None)   # K/V only: the last token goes through the graph
                elif prompt.size > 1:
                    self.run_steps(prompt[:-1], start_pos)
                seen = np.zeros(self.vocab, dtype=np.uint8)
                seen[prompt[(prompt >= 0) & (prompt < self.vocab)]] = 1
                self.upload(self.seen, seen)
                self.upload(self.uniforms, uniforms)
                self.set_sampling(params)
                first = start_pos + prompt.size - 1             # the position of the first step
                launches, done = [], 0
                for n in launch_sizes(max_new_tokens):          # any capture before the steps are queued
                    launches.append((n, self.graph_at(first + done, n)))
                    done += n
                self.set_state(first, int(prompt[-1]), 0)
                events = [None] * LOOKAHEAD         # the event after token i's step, at i % LOOKAHEAD
                sizes = iter(launches)
                n, graph = next(sizes, (0, None))
                launched = 0
                while produced < max_new_tokens:
                    while n and launched + n - produced <= LOOKAHEAD:
                        graph.launch(self.stream)
                        event = self.stream.record()
                        for i in range(launched, launched + n):
                            events[i % LOOKAHEAD] = event
                        launched += n
                        n, graph = next(sizes, (0, None))
                    events[produced % LOOKAHEAD].synchronize()
                    token = int(self.out_tokens[produced])
                    produced += 1
                    yield token
        finally:
            rng.bit_generator.state = rng_state      # consume exactly the draws of the tokens handed out
            rng.random(produced)

    def close(self) -> None:
        if getattr(self, "stream", None) is not None:
            self.stream.synchronize()
        for name in ("graph", "graphs", "weights", "k_cache", "v_cache", "step", "_prefill"):
            setattr(self, name, None)
        self.cp.get_default_memory_pool().free_all_blocks()
