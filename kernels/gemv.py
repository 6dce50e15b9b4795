"""Launching the GEMV kernels of gemv.cu, and their NumPy reference.

A GemvShape says what is multiplied (encoding, group, rows, columns, and so whether the matrix is
held in 8-row blocks: kernels/layout.py) and which fusions run at the input (plain, rmsnorm) and
output (store, add, swiglu: silu(gate) * up of the fused [gate; up] matrix, store_argmax: store and
fold the greedy argmax into one uint64 word for the sampler, store_bias: add a bias vector as it
stores, for Qwen2's Q/K/V projection); a GemvConfig is the
tunable part (row tiles of 16 per block, warps per block (16: a wide block, one per SM), whether a
cluster of two blocks splits K, the ring depth: items each warp keeps in flight, whether the grid is
balanced: grid_units, whether the ring is refilled during the products: gemv.cu's REFILL, and
whether the ring's first item is staggered around the input's round trip: gemv.cu's STAGGER).
make_gemv turns both plus device pointers into a Launch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from tinyinfer.kernels.build import Launch, module
from tinyinfer.kernels.layout import can_block, row_bytes

ENCODING_ID = {"f16": 0, "q8": 1, "q4": 2}
INPUT_ID = {"plain": 0, "rmsnorm": 1, "rmsnorm_pending": 2}
OUTPUT_ID = {"store": 0, "add": 1, "swiglu": 2, "add_pending": 3, "store_argmax": 4, "store_bias": 5}
CHUNK_K = {"f16": 64, "q8": 128, "q4": 256}   # columns per chunk: NL(2) * 4 lanes * 16 bytes
SUPPORTED = tuple(ENCODING_ID)
CANDIDATES = tuple((rt, warps) for rt in (1, 2) for warps in (4, 8, 16))
WIDE_WARPS = 16               # warps of a wide block (gemv.cu WIDE: 512 threads, one block per SM)
SPLITS = (1, 2)               # blocks per cluster sharing one tile's K (2: plain inputs on Hopper)
SPLIT_MIN_COMPUTE_CAPABILITY = 90   # thread-block clusters
# Ring depth (items in flight per warp, gemv.cu's DEPTH) by row tiles: the depth every configuration
# is timed alone with (alone, the depths barely differ), and the depths tried in the decode step,
# where it matters (kernels/README.md, "Ring depth").
DEFAULT_DEPTH = {1: 4, 2: 2}
STEP_DEPTHS = {1: (1, 2, 3, 4), 2: (1, 2)}


@dataclass(frozen=True)
class GemvShape:
    encoding: str     # f16, q8, q4
    group: int        # quantization group (0 for f16)
    rows: int
    cols: int         # logical input length K
    cols_pad: int     # stored row length
    input: str = "plain"
    output: str = "store"

    @property
    def key(self) -> str:
        return (f"{self.encoding}g{self.group}:{self.rows}x{self.cols}:{self.input}>{self.output}")

    @property
    def blocked(self) -> bool:
        """Whether the CUDA backend holds this matrix in 8-row blocks (kernels/layout.py)."""
        return can_block(self.encoding, self.rows, self.cols_pad)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weight tensor the kernel reads (values + scales)."""
        scales = 0 if self.encoding == "f16" else 2 * self.cols_pad // self.group
        return self.rows * (row_bytes(self.encoding, self.cols_pad) + scales)


@dataclass(frozen=True)
class GemvConfig:
    row_tiles: int = 1   # 16-row tiles per block (R)
    warps: int = 8       # warps per block, splitting K (WIDE_WARPS: gemv.cu's WIDE kernel)
    split: int = 1       # blocks (a cluster) splitting each tile's K between them
    depth: int = 0       # items in flight per warp; 0: DEFAULT_DEPTH of row_tiles
    balanced: bool = False   # grid: the fewest blocks for as many rounds of tiles (grid_units)
    refill: bool = False     # the next item's loads issued during this one's products (gemv.cu REFILL)
    staggered: bool = False  # the first item's second half loaded once x has landed (gemv.cu STAGGER)

    def __post_init__(self):
        if self.depth == 0:
            object.__setattr__(self, "depth", DEFAULT_DEPTH.get(self.row_tiles, 0))

    def as_dict(self) -> dict:
        """As stored in autotune caches and files: split, depth, balanced, refill and staggered only
        where they differ from the defaults, so entries written before any of them existed keep their
        meaning."""
        return {"row_tiles": self.row_tiles, "warps": self.warps, **({"split": self.split} if self.split > 1 else {}),
                **({"depth": self.depth} if self.depth != DEFAULT_DEPTH.get(self.row_tiles) else {}),
                **({"balanced": True} if self.balanced else {}), **({"refill": True} if self.refill else {}),
                **({"staggered": True} if self.staggered else {})}

    @property
    def wide(self) -> bool:
        return self.warps == WIDE_WARPS

    @property
    def label(self) -> str:
        return (f"R{self.row_tiles}/w{self.warps}" + (f"/split{self.split}" if self.split > 1 else "") + f"/d{self.depth}"
                + ("/bal" if self.balanced else "") + ("/refill" if self.refill else "")
                + ("/stag" if self.staggered else ""))


def splittable(shape: GemvShape) -> bool:
    """Split-K takes an input whose groups stage independently (RMSNorm needs the whole vector's sum
    of squares in each block) and an output each block can finish alone (not SwiGLU's pairs)."""
    return shape.input == "plain" and shape.output != "swiglu"


def can_split(shape: GemvShape, compute_capability: int) -> bool:
    """Split-K also needs thread-block clusters (Hopper and newer)."""
    return compute_capability >= SPLIT_MIN_COMPUTE_CAPABILITY and splittable(shape)


def configs_for(shape: GemvShape, compute_capability: int) -> list:
    """Every configuration the tuner times alone for this shape on this GPU (at the default depth)."""
    splits = SPLITS if can_split(shape, compute_capability) else (1,)
    return [GemvConfig(rt, warps, split) for split in splits for rt, warps in CANDIDATES]


def depth_variants(shape: GemvShape, config: GemvConfig) -> list:
    """config at each ring depth the tuner tries in the decode step; a refilled ring stays refilled
    where that kernel exists at the new depth (can_refill) and is refilled after the products where
    it does not (the tuner's joint moves start from refilled choices); likewise a staggered first
    item (can_stagger)."""
    variants = [replace(config, depth=d) for d in STEP_DEPTHS[config.row_tiles]]
    variants = [replace(v, refill=v.refill and can_refill(shape, v)) for v in variants]
    return [replace(v, staggered=v.staggered and can_stagger(shape, v)) for v in variants]


def can_refill(shape: GemvShape, config: GemvConfig) -> bool:
    """Whether the REFILL kernel exists for this configuration: q8 with R = 2 at depth 2 would hold
    more than the 128 registers a thread has there (nvcc spills it)."""
    return not (shape.encoding == "q8" and config.row_tiles == 2 and config.depth == 2)


def can_stagger(shape: GemvShape, config: GemvConfig) -> bool:
    """Whether the STAGGER kernel exists: for RMSNorm inputs (the GEMVs whose blocks start late on
    Llama-2-7B; staggering the plain-input ones lost there) at ring depth 1, where it was measured to
    pay. Deeper rings hold more registers, and nvcc spilled some of them staggered (q4 R = 1 at depth
    4, q8 R = 2 at depth 2; sm_90); at depth 1 none of the kinds spills (kernels/README.md,
    "Staggered first item")."""
    return shape.input != "plain" and config.depth == 1


def pending_variant(shape: GemvShape, config: GemvConfig) -> GemvConfig:
    """The configuration in which a GEMV that reads the fused MLP's fixed-point residual (shape.input
    rmsnorm_pending or shape.output add_pending) runs a role tuned as `config`. Its eight int64 per
    thread hold 8 more registers through the input's staging than x does, and nvcc (sm_90) spilled two
    kinds of q4/q8 kernels: q4 R = 1 at depth 4 with its ring refilled after the products (depth 3
    instead), and the o projection's R = 2 ring refilled during them (refilled after them instead;
    q8 still spills 32 bytes there). Since RMSNorm's factor moved to the epilogue the first no longer
    spills, and stays for speed: depth 3 stepped faster than depth 4 in TinyLlama q4's fused step
    (kernels/README.md, "Fused MLP")."""
    if shape.encoding == "f16":
        return config
    if shape.input == "rmsnorm_pending" and shape.encoding == "q4" and config.row_tiles == 1 \
            and config.depth == 4 and not config.refill:
        config = replace(config, depth=3)
    if shape.output == "add_pending" and config.row_tiles == 2:
        config = replace(config, refill=False)
    return config


def all_configs(shape: GemvShape, compute_capability: int) -> list:
    """Every configuration the tuner can choose for this shape: what it times alone, at every depth,
    with either grid, with and without refill, staggered or not."""
    with_refill = [replace(v, balanced=b, refill=r) for config in configs_for(shape, compute_capability)
                   for v in depth_variants(shape, config) for b in (False, True) for r in (False, True)
                   if not r or can_refill(shape, v)]
    return with_refill + [replace(c, staggered=True) for c in with_refill if can_stagger(shape, c)]


def shape_of(tensor_info, input: str = "plain", output: str = "store") -> GemvShape:
    """GemvShape of a 2-D .tinf tensor (TensorInfo or Tensor)."""
    from tinyinfer.formats.quant import padded_cols

    rows, cols = tensor_info.shape
    if tensor_info.encoding not in SUPPORTED:
        raise ValueError(f"no GEMV kernel for encoding {tensor_info.encoding}")
    group = tensor_info.group or 0
    return GemvShape(tensor_info.encoding, group, rows, cols, padded_cols(tensor_info.encoding, cols, group or None),
                     input, output)


def name_expression(shape: GemvShape, config: GemvConfig) -> str:
    return (f"gemv<{ENCODING_ID[shape.encoding]},{shape.group},{config.row_tiles},"
            f"{INPUT_ID[shape.input]},{OUTPUT_ID[shape.output]},{config.split},{config.depth},{int(config.refill)},"
            f"{int(shape.blocked)},{int(config.wide)},{int(config.staggered)}>")


def staged_halves(shape: GemvShape) -> int:
    chunk = CHUNK_K[shape.encoding]
    kc = -(-shape.cols_pad // chunk) * chunk
    return kc + (kc // 64) * 8


def shared_bytes(shape: GemvShape, config: GemvConfig) -> int:
    scratch = max(2 * config.warps * 16 * config.row_tiles, 32) * 4
    if config.split > 1:
        scratch += 2 * 16 * config.row_tiles * 4          # the peer block's sums (gemv_scratch_bytes)
    scratch += WIDE_WARPS * 4                             # RMSNorm's per-warp sums of squares (gemv.cu MAX_WARPS)
    scratch = (scratch + 15) // 16 * 16
    chunk = CHUNK_K[shape.encoding]
    sections = -(-shape.cols_pad // chunk) * chunk // (chunk // 8)      # KPL = chunk / 8 columns each
    # x as fp16 hi and lo halves (lo 32 bytes further on), 64 zero bytes per warp, one float of bias
    # correction per section (q4 lays out its integer limbs and section data in the same area:
    # gemv.cu stage_group_q4)
    return scratch + 2 * 2 * staged_halves(shape) + 32 + 64 * WIDE_WARPS + 4 * sections


def scale_offset(shape: GemvShape) -> int:
    from tinyinfer.formats.quant import scale_offset as offset

    return offset(shape.encoding, (shape.rows, shape.cols), shape.group) if shape.encoding != "f16" else 0


class GemvModules:
    """The instantiations of (shape, GemvConfig) pairs, one RawModule each, so that they compile on
    parallel threads and CuPy caches each alone (models of one encoding share binaries). Lazy:
    build.compile_all(self.modules) compiles them."""

    def __init__(self, items, compute_capability: int):
        self.compute_capability = compute_capability
        expressions = sorted({name_expression(shape, c) for shape, c in items})
        self.by_expression = {e: module("gemv.cu", (e,), compute_capability) for e in expressions}
        self.modules = list(self.by_expression.values())

    def module_for(self, expression: str):
        """The module of one instantiation, made now if `items` did not hold it (compiled when first
        used, or by build.compile_all)."""
        if expression not in self.by_expression:
            self.by_expression[expression] = module("gemv.cu", (expression,), self.compute_capability)
        return self.by_expression[expression]

    def get_function(self, expression: str):
        return self.module_for(expression).get_function(expression)


def compile_gemvs(items, compute_capability: int) -> GemvModules:
    """Every (shape, GemvConfig) instantiation in `items`, compiled."""
    from tinyinfer.kernels.build import compile_all

    mods = GemvModules(items, compute_capability)
    compile_all(mods.modules)
    return mods


@lru_cache(maxsize=None)
def device_limits(device_id: int) -> dict:
    """The SM limits of a GPU (getDeviceProperties takes ~1 ms; tuning builds hundreds of launches)."""
    import cupy

    props = cupy.cuda.runtime.getDeviceProperties(device_id)
    keys = ("regsPerMultiprocessor", "sharedMemPerMultiprocessor", "maxThreadsPerMultiProcessor", "multiProcessorCount")
    return {key: props[key] for key in keys}


def resident_blocks(kernel, threads: int, shared: int) -> int:
    """Blocks of this kernel that fit on one SM at once (registers, shared memory, threads)."""
    import cupy

    props = device_limits(cupy.cuda.Device().id)
    regs_per_warp = -(-max(kernel.num_regs, 1) * 32 // 256) * 256            # allocated in units of 256
    by_regs = props["regsPerMultiprocessor"] // (regs_per_warp * (threads // 32))
    by_smem = props["sharedMemPerMultiprocessor"] // (shared + 1024)            # 1 KiB reserved per block
    by_threads = props["maxThreadsPerMultiProcessor"] // threads
    return max(1, min(by_regs, by_smem, by_threads, 32)), props["multiProcessorCount"]


def output_rows(shape: GemvShape) -> int:
    """Length of y: rows, or half of them for the fused [gate; up] matrix."""
    return shape.rows // 2 if shape.output == "swiglu" else shape.rows


def tile_outputs(shape: GemvShape) -> int:
    """Outputs per 16-row unit of a tile (tile_outputs in gemv.cu)."""
    return 8 if shape.output == "swiglu" else 16


def grid_units(tiles: int, resident_units: int, balanced: bool) -> int:
    """Blocks (clusters with split-K) of a persistent grid: one per row tile, at most as many as stay
    resident. Balanced: the fewest that still walk the tiles in as many rounds, so every block has
    the same number of tiles and the block slots left over take the next kernels' early (PDL) blocks
    from the start. Which grid is faster depends on the shape (kernels/README.md, "Balanced grid"),
    so the tuner decides in the step."""
    units = min(tiles, resident_units)
    if balanced:
        rounds = -(-tiles // units)
        units = -(-tiles // rounds)
    return units


def make_gemv(mod, shape: GemvShape, config: GemvConfig, weight, x, y, aux=None, eps: float = 0.0,
              name: str = "gemv", pending=None, best=None, bias=None) -> Launch:
    """Launch computing y (+)= g(W f(x)). weight: CuPy uint8 array holding the tensor's bytes as
    stored, rearranged by layout.block_in_place when shape.blocked. pending: the residual in int64
    fixed point of a fused step (kernels/mlp.py), which the rmsnorm_pending input normalises instead
    of x and the add_pending output adds to, storing the sum into y and back into pending. best: a
    uint64 word (zero before the launch) into which the store_argmax output folds argmax_key(y[row],
    row) (gemv.cu), whose row argmax_row() recovers. bias: the float32 [rows] the store_bias output adds.

    The grid is persistent: as many blocks as stay resident (at most one per row tile, or one
    cluster of `split` blocks per row tile; grid_units)."""
    if shape.output == "swiglu" and shape.rows % 2:
        raise ValueError(f"a fused [gate; up] matrix has an even number of rows, not {shape.rows}")
    if shape.weight_bytes >= 1 << 32:     # gemv.cu addresses a tensor with 32-bit offsets
        raise ValueError(f"a {shape.rows}x{shape.cols} {shape.encoding} matrix is 4 GiB or more; the GEMV kernel "
                         "addresses tensors below 4 GiB")
    if config.split > 1 and not splittable(shape):
        raise ValueError(f"no split-K GEMV for {shape.input} input and {shape.output} output")
    if config.staggered and not can_stagger(shape, config):
        raise ValueError(f"no staggered GEMV for {shape.key} with {config.label}")
    if (pending is None) != (shape.input != "rmsnorm_pending" and shape.output != "add_pending"):
        raise ValueError(f"{shape.key}: pending sums are passed exactly when the GEMV reads them")
    if (best is None) != (shape.output != "store_argmax"):
        raise ValueError(f"{shape.key}: the argmax word is passed exactly when the GEMV folds into it")
    if (bias is None) != (shape.output != "store_bias"):
        raise ValueError(f"{shape.key}: a bias is passed exactly when the GEMV adds one")
    kernel = mod.get_function(name_expression(shape, config))
    w_ptr = weight.data.ptr
    scale_ptr = w_ptr + scale_offset(shape)         # f16: 0, the kernel reads no scales
    tiles = -(-output_rows(shape) // (tile_outputs(shape) * config.row_tiles))
    shared = shared_bytes(shape, config)
    per_sm, sms = resident_blocks(kernel, 32 * config.warps, shared)
    args = (np.uint64(w_ptr), np.uint64(scale_ptr), np.int32(shape.rows), np.int32(shape.cols_pad),
            np.int32(shape.cols), x, aux if aux is not None else np.uint64(0), np.float32(eps), y,
            pending if pending is not None else np.uint64(0), best if best is not None else np.uint64(0),
            bias if bias is not None else np.uint64(0))
    units = grid_units(tiles, per_sm * sms // config.split, config.balanced)
    return Launch(name, kernel, (units * config.split,), (32 * config.warps,), args, shared,
                  bytes_read=shape.weight_bytes, waits=True, cluster=config.split)


def gemv_reference(tensor, x: np.ndarray, input: str = "plain", aux=None, eps: float = 0.0,
                   residual: np.ndarray | None = None, output: str = "store", bias=None) -> np.ndarray:
    """What the kernel computes, from runtime.reference: y = W f(x) (+ residual, or + bias, or swiglu), float32.
    For the pending variants, x and residual are given with the pending sums already added."""
    from tinyinfer.runtime import reference as ref

    k = tensor.cols
    x = np.asarray(x, dtype=np.float32)
    h = ref.rms_norm(x[:k], aux[:k], eps) if input.startswith("rmsnorm") else x[:k]
    y = ref.linear(h[None, :], tensor.to_float32(), bias)[0]
    if output == "swiglu":
        return ref.swiglu(y)
    return y + residual if residual is not None else y


def argmax_key(y: np.ndarray) -> int:
    """Reference of the word the store_argmax output folds y into (common.cuh argmax_key): the
    largest value's order-preserving bits (-0 as +0) above the bitwise complement of its lowest row,
    so a larger word is the sampler's choice; 0 when every value is NaN."""
    y = np.asarray(y, dtype=np.float32)
    finite = ~np.isnan(y)
    if not finite.any():
        return 0
    row = int(np.flatnonzero(y == y[finite].max())[0])
    bits = 0 if y[row] == 0 else int(y[row:row + 1].view(np.uint32)[0])
    ordered = (~bits & 0xFFFFFFFF) if bits & 0x80000000 else bits | 0x80000000
    return (ordered << 32) | (~row & 0xFFFFFFFF)


def argmax_row(key: int) -> int:
    """The row of an argmax word (argmax_key)."""
    return ~int(key) & 0xFFFFFFFF
