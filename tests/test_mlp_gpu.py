"""The fused MLP (kernels/mlp.cu) and the GEMV variants that read and write the residual in fixed point
(`pending`), against the NumPy reference; then the whole model with the MLP fused.

pending starts from random values, so a row the kernel forgets to add to keeps a wrong total; error
is ||gpu - ref|| / ||ref|| <= 1e-3 as for the GEMVs (tests/test_kernels_gpu.py).
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np
import pytest

from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels import mlp as mlp_k
from tinyinfer.kernels.build import device_compute_capability
from tinyinfer.convert.pipeline import DEFAULT_GROUP
from tinyinfer.runtime.bench import random_encoded

from tinf_samples import device_bytes  # noqa: E402

pytestmark = pytest.mark.gpu
MAX_ERROR = 1e-3
# (dim, ffn): TinyLlama, Llama-2-7B, and the smallest shape mlp.cu takes (one cluster).
MLP_SHAPES = {"tinyllama": (2048, 5632), "llama7b": (4096, 11008), "one-cluster": (1024, 256)}


def relative_error(a, b) -> float:
    return float(np.linalg.norm(np.asarray(a, np.float64) - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def cc(cupy_gpu):
    cc = device_compute_capability()
    if cc < mlp_k.MIN_COMPUTE_CAPABILITY:
        pytest.skip("the fused MLP needs thread-block clusters (compute capability 9.0)")
    return cc


def as_pending(values: np.ndarray) -> np.ndarray:
    return np.rint(np.asarray(values, np.float64) * mlp_k.PENDING_ONE).astype(np.int64)


def from_pending(values: np.ndarray) -> np.ndarray:
    return np.asarray(values, np.float64) / mlp_k.PENDING_ONE


def mlp_case(encoding: str, dim: int, ffn: int, rng):
    group = None if encoding == "f16" else 64
    gate_up = random_encoded(encoding, (2 * ffn, dim), group, rng, 1 / np.sqrt(dim))
    down = random_encoded(encoding, (dim, ffn), group, rng, 1 / np.sqrt(ffn))
    shape = mlp_k.MlpShape(gemv_k.shape_of(gate_up, "rmsnorm", "swiglu"), gemv_k.shape_of(down, "plain", "add"))
    x = rng.standard_normal(dim).astype(np.float32)
    norm = (1 + 0.1 * rng.standard_normal(dim)).astype(np.float32)
    return gate_up, down, shape, x, norm


@pytest.mark.parametrize("encoding", ["f16", "q8", "q4"])
@pytest.mark.parametrize("name", list(MLP_SHAPES))
def test_fused_mlp_every_configuration(cupy_gpu, cc, encoding, name):
    cp = cupy_gpu
    rng = np.random.default_rng(zlib.crc32(f"mlp{encoding}{name}".encode()))
    gate_up, down, shape, x, norm = mlp_case(encoding, *MLP_SHAPES[name], rng)
    assert mlp_k.can_fuse(shape, cc)
    expected = mlp_k.mlp_reference(gate_up, down, x, norm, 1e-5)
    start = as_pending(rng.standard_normal(shape.down.rows))
    w_gu, w_dn = cp.asarray(device_bytes(gate_up, shape.gate_up)), cp.asarray(device_bytes(down, shape.down))
    for config in mlp_k.CANDIDATES:
        pending = cp.asarray(start)
        mod = mlp_k.compile_mlp(shape, config, cc)
        mlp_k.make_mlp(mod, shape, config, w_gu, w_dn, cp.asarray(x), cp.asarray(norm), 1e-5, pending)()
        got = from_pending(pending.get()) - from_pending(start)
        error = relative_error(got, expected)
        assert error <= MAX_ERROR, f"{encoding} {name} {config.label}: relative error {error:.2e}"


def test_fused_mlp_is_repeatable_bit_for_bit(cupy_gpu, cc):
    """The clusters add in whatever order they finish; integer sums do not depend on it."""
    cp = cupy_gpu
    rng = np.random.default_rng(5)
    gate_up, down, shape, x, norm = mlp_case("q4", 2048, 5632, rng)
    config = mlp_k.MlpConfig()
    launch = mlp_k.make_mlp(mlp_k.compile_mlp(shape, config, cc), shape, config,
                            cp.asarray(device_bytes(gate_up, shape.gate_up)), cp.asarray(device_bytes(down, shape.down)),
                            cp.asarray(x), cp.asarray(norm), 1e-5, pending := cp.zeros(2048, dtype=cp.int64))
    results = []
    for _ in range(5):
        pending.fill(0)
        launch()
        results.append(pending.get())
    assert np.abs(results[0]).max() > 0 and all(np.array_equal(results[0], r) for r in results[1:])


# (input, output, rows, cols): TinyLlama's qkv GEMV and output head (several tiles per block: the
# staging then takes the norm weight early for blocks of 4 warps), Llama-2-7B's qkv GEMV (two groups
# of x per thread), the o projections.
PENDING_READERS = [("rmsnorm_pending", "store", 2560, 2048), ("rmsnorm_pending", "store_argmax", 32000, 2048),
                   ("rmsnorm_pending", "store", 12288, 4096), ("plain", "add_pending", 2048, 2048),
                   ("plain", "add_pending", 4096, 4096), ("rmsnorm_pending", "store_bias", 1152, 896)]


@pytest.mark.parametrize("encoding", ["f16", "q4", "q8"])
@pytest.mark.parametrize("input,output,rows,cols", PENDING_READERS)
def test_gemv_reading_the_pending_sums(cupy_gpu, cc, encoding, input, output, rows, cols):
    """rmsnorm_pending normalises the fixed-point residual (not x); add_pending stores the residual +
    W x into y and, in fixed point, into pending (y's old value is not read); the output head's
    store_argmax also folds y's argmax into its word; Qwen2's Q/K/V projection adds its bias.
    Every tuning candidate as the backend runs it (gemv.pending_variant; the staging paths differ by
    block width), and each staggered where it can be (gemv.can_stagger)."""
    cp = cupy_gpu
    rng = np.random.default_rng(zlib.crc32(f"pending{encoding}{input}{output}{rows}".encode()))
    tensor = random_encoded(encoding, (rows, cols), None if encoding == "f16" else 64, rng, 1 / np.sqrt(cols))
    shape = gemv_k.shape_of(tensor, input, output)
    alone = gemv_k.configs_for(shape, cc)
    staggered = [c for c in (replace(c, staggered=True) for c in alone) if gemv_k.can_stagger(shape, c)]
    configs = list(dict.fromkeys(gemv_k.pending_variant(shape, c) for c in alone + staggered))
    mod = gemv_k.compile_gemvs([(shape, c) for c in configs], cc)
    weights = cp.asarray(device_bytes(tensor, shape))
    for config in configs:
        x = rng.standard_normal(cols).astype(np.float32)
        start = as_pending(rng.standard_normal(rows if output == "add_pending" else cols))
        pending = cp.asarray(start)
        best = cp.zeros(1, dtype=cp.uint64) if output == "store_argmax" else None
        bias = 3 * rng.standard_normal(rows).astype(np.float32) if output == "store_bias" else None
        if output != "add_pending":
            aux = (1 + 0.1 * rng.standard_normal(cols)).astype(np.float32)
            y = cp.full(rows, np.nan, dtype=cp.float32)
            expected = gemv_k.gemv_reference(tensor, from_pending(start), "rmsnorm", aux, 1e-5, bias=bias)
            aux = cp.asarray(aux)
        else:
            aux, y = None, cp.full(rows, np.nan, dtype=cp.float32)
            expected = gemv_k.gemv_reference(tensor, x, "plain", None, 0.0, from_pending(start), "add")
        gemv_k.make_gemv(mod, shape, config, weights, cp.asarray(x), y, aux, 1e-5, pending=pending, best=best,
                         bias=cp.asarray(bias) if bias is not None else None)()
        error = relative_error(y.get(), expected)
        assert error <= MAX_ERROR, f"{encoding} {input}>{output} {config.label}: {error:.2e}"
        if best is not None:
            assert int(best.get()[0]) == gemv_k.argmax_key(y.get()), f"{config.label}: the argmax word"
        if output == "add_pending":
            assert np.array_equal(pending.get(), as_pending(y.get())), "the residual, also in fixed point"
        else:
            assert np.array_equal(pending.get(), start), "a normalising GEMV only reads them"


@pytest.mark.parametrize("shape,quant", [("tinyllama", "q4"), ("tinyllama", "f16"), ("llama-2-7b", "q8")])
def test_decode_with_the_fused_mlp_matches_the_numpy_reference(shared_assets, tmp_path, cupy_gpu, shape, quant):
    """The MLP fused in the captured graph (with PDL), whatever the tuner picked: logits at 24
    positions, the same bits when run again."""
    from tinyinfer.formats import open_tinf
    from tinyinfer.runtime import load
    from tinyinfer.runtime.bench import write_random_model
    from tinyinfer.runtime.numpy_backend import NumpyBackend
    from test_cuda_model_gpu import real_config, relative_errors

    path = tmp_path / "m.tinf"
    write_random_model(path, real_config(shared_assets, shape), quant, DEFAULT_GROUP[quant], seed=13)
    ids = np.random.default_rng(4).integers(0, 32000, 24)
    with load(path, device="cuda") as model:
        backend = model.backend
        if backend.mlp_shape() is None:
            pytest.skip("the fused MLP needs thread-block clusters (compute capability 9.0)")
        for config in (mlp_k.MlpConfig(8, 1, 2), mlp_k.MlpConfig(8, 4, 1)):
            backend.use_tuning({**{r: c for r, c in backend.tuning.items() if r != "mlp"}, "mlp": config})
            gpu = backend.decode_forward(ids, 0)
            reference = NumpyBackend(open_tinf(path), max_context=24).forward(ids, 0)
            errors = relative_errors(gpu, reference)
            assert errors.max() <= MAX_ERROR and np.array_equal(gpu.argmax(-1), reference.argmax(-1)), config.label
            assert np.array_equal(backend.decode_forward(ids, 0), gpu), "the same logits, bit for bit"
