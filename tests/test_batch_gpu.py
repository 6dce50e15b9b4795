"""Batched decoding on the GPU (kernels/batch.cu, runtime/cuda_batch.py) against the NumPy reference.

Each kernel on fresh random inputs, outputs poisoned with NaN first, relative error per row. Then the
engine on random 2-layer models of the TinyLlama-1.1B and Llama-2-7B shapes (q4; TinyLlama's also in
q8 and f16): sequences of
different prompt lengths join (some prefilled over several chunks), decode at buckets of every size,
leave at different steps, one is cancelled; every row's logits at every step are compared with the
NumPy reference over that sequence alone and with the batch-1 CUDA backend's, with the prefill
tests' bounds (test_prefill_gpu.py: relative error <= 2e-3, argmax the reference's or a near tie).
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tinyinfer.formats import open_tinf
from tinyinfer.formats.quant import scale_offset
from tinyinfer.kernels import batch as batch_k
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels import layout
from tinyinfer.kernels import prefill as prefill_k
from tinyinfer.runtime import load
from tinyinfer.runtime import reference as ref
from tinyinfer.runtime.bench import random_encoded, tinf_config, write_random_model
from tinyinfer.runtime.errors import ContextOverflowError, DeviceError, SlotsFullError
from tinyinfer.runtime.numpy_backend import NumpyBackend
from tinyinfer.runtime.sampling import SamplingParams, sample

from sampling_samples import SAMPLING  # noqa: E402
from tinf_samples import stored_bytes  # noqa: E402

pytestmark = pytest.mark.gpu
MAX_ERROR = 2e-3
CONTEXT = 256
CONFIG_FILES = {"tinyllama": "tinyllama-1.1b-chat-v1.0/config.json", "llama-2-7b": "llama-2-7b-hf/config.json"}


def relative_errors(ours, theirs) -> np.ndarray:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    return np.linalg.norm(ours - theirs, axis=-1) / np.linalg.norm(theirs, axis=-1)


def assert_rows_close(ours, theirs, bound: float, what: str) -> None:
    assert np.isfinite(ours).all(), f"{what}: unwritten or non-finite outputs"
    errors = relative_errors(ours.reshape(-1, ours.shape[-1]), theirs.reshape(-1, theirs.shape[-1]))
    print(f"{what}: max relative error {errors.max():.2e}")
    assert errors.max() <= bound, f"{what}: relative error {errors.max():.2e} at row {errors.argmax()}"


@pytest.fixture(scope="module")
def mod(cupy_gpu):
    from tinyinfer.kernels.build import device_compute_capability

    return batch_k.compile_batch(device_compute_capability())


def n_sms(cp) -> int:
    return int(cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"])


# ------------------------------------------------------------------------------------- kernels

GEMV_SHAPES = [("q4", 2560, 2048, 32), ("q4", 200, 384, 64), ("q4", 11008, 640, 32), ("q4", 8, 128, 128),
               ("q8", 2560, 2048, 64), ("q8", 200, 320, 32), ("f16", 2048, 1024, 0), ("f16", 200, 96, 0)]


@pytest.mark.parametrize("encoding, rows, cols, group", GEMV_SHAPES)
@pytest.mark.parametrize("padded", [8, 16, 32])
@pytest.mark.parametrize("planned", [True, False])
def test_gemv_matches_its_reference(cupy_gpu, mod, encoding, rows, cols, group, padded, planned):
    """batch_gemv on a blocked random q4, q8 or f16 matrix: the planned split, and a hand-made one with an
    uneven last slice and two rounds of tiles per warp."""
    cp = cupy_gpu
    rng = np.random.default_rng(rows + cols + padded)
    tensor = random_encoded(encoding, (rows, cols), group or None, rng)
    shape = gemv_k.shape_of(tensor)
    blocked = stored_bytes(tensor).copy()
    layout.block_in_place(blocked, shape)
    weights = cp.asarray(blocked)
    h = rng.standard_normal((padded, shape.cols_pad)).astype(np.float16)
    if planned:
        plan = batch_k.plan_gemv(rows, shape.cols_pad, padded, n_sms(cp), encoding)
    else:
        piece_cols = batch_k.PIECE_COLS[encoding]
        pieces = shape.cols_pad // piece_cols
        per_slice = max(1, min(3, pieces - 1)) if pieces > 1 else 1
        plan = batch_k.GemvPlan(rows, shape.cols_pad, padded, per_slice, -(-pieces // per_slice), 16, piece_cols)
    parts = cp.full(plan.parts_floats, np.nan, dtype=cp.float32)
    scales = weights.data.ptr + scale_offset(encoding, tensor.shape, group) if group else 0
    launch = batch_k.make_gemv(mod, encoding, plan, weights.data.ptr, scales, group, cp.asarray(h), h.shape[1], parts)
    launch()
    got = parts.reshape(plan.slices, padded, rows).sum(axis=0).get()
    expected = batch_k.gemv_reference(h, batch_k.weight_reference(tensor))
    assert_rows_close(got, expected, 1e-4, f"gemv {encoding} {rows}x{cols} g{group} rows {padded} {plan}")


ATTENTION_KERNELS = ["batch_attention", "batch_attention_wide", "batch_attention_mma{hd}_4", "batch_attention_mma{hd}_8"]


@pytest.mark.parametrize("head_dim, n_heads, n_kv", [(64, 32, 4), (128, 32, 32), (64, 12, 12), (96, 12, 6),
                                                     (128, 32, 4)])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("kernel", ATTENTION_KERNELS, ids=lambda k: k.replace("{hd}", ""))
def test_attention_matches_its_reference(cupy_gpu, mod, head_dim, n_heads, n_kv, window, kernel):
    """Rows at different positions (0, short, long: two of the tensor-core kernel's passes at 300
    keys) in different slots, two rows in one slot; groups of 1, 2 and 8 query heads per KV head; every
    kernel at both widths (the tensor-core one for head_dim 64 and 128)."""
    if "{hd}" in kernel and not batch_k.uses_mma(head_dim, n_heads // n_kv):
        pytest.skip("the tensor-core kernel serves head_dim 64 and 128")
    cp = cupy_gpu
    rng = np.random.default_rng(head_dim + n_heads + (window or 0))
    slots, ctx = 4, 300
    positions, row_slots = np.array([0, 5, 299, 130, 17]), np.array([2, 0, 3, 1, 0])
    k = rng.standard_normal((slots, ctx, n_kv, head_dim)).astype(np.float16)
    v = rng.standard_normal((slots, ctx, n_kv, head_dim)).astype(np.float16)
    q = (rng.standard_normal((5, n_heads, head_dim)) / math.sqrt(head_dim)).astype(np.float32)
    out = cp.full((5, n_heads * head_dim + 64), np.nan, dtype=cp.float16)
    name = kernel.format(hd=head_dim)
    launch = batch_k.make_attention(mod, 5, cp.asarray(q), cp.asarray(k), cp.asarray(v), ctx * n_kv * head_dim,
                                    cp.asarray(positions.astype(np.int32)), cp.asarray(row_slots.astype(np.int32)),
                                    n_heads, n_kv, head_dim, window, ctx, out, out.shape[1], 132, kernel=name)
    assert launch.name == name
    launch()
    got = out[:, : n_heads * head_dim].get().astype(np.float32)
    expected = batch_k.attention_reference(q, k, v, positions, row_slots, window).astype(np.float32)
    assert_rows_close(got, expected, 2e-3, f"attention hd {head_dim} {n_heads}/{n_kv} window {window}")


@pytest.mark.parametrize("bias", [False, True])
def test_rope_store_matches_its_reference(cupy_gpu, mod, bias):
    cp = cupy_gpu
    rng = np.random.default_rng(7 + bias)
    n_heads, n_kv, hd, rows, padded, slices, slots, ctx = 8, 2, 64, 3, 8, 3, 4, 50
    width = (n_heads + 2 * n_kv) * hd
    parts = rng.standard_normal((slices, padded, width)).astype(np.float32)
    b = rng.standard_normal(width).astype(np.float32) if bias else None
    positions, row_slots = np.array([0, 49, 7], np.int32), np.array([3, 0, 1], np.int32)
    cos, sin = ref.rope_tables(hd, ctx, 10000.0, None)
    k_cache = cp.full((slots, ctx, n_kv, hd), np.nan, dtype=cp.float16)
    v_cache = cp.full((slots, ctx, n_kv, hd), np.nan, dtype=cp.float16)
    q = cp.full((rows, n_heads * hd), np.nan, dtype=cp.float32)
    plan = batch_k.GemvPlan(width, 128, padded, 1, slices, 8)
    launch = batch_k.make_rope_store(mod, rows, cp.asarray(parts), plan, cp.asarray(b) if bias else None,
                                     cp.asarray(positions), cp.asarray(row_slots), n_heads, n_kv, hd, cp.asarray(cos),
                                     cp.asarray(sin), q, k_cache, v_cache, ctx * n_kv * hd)
    launch()
    eq, ek, ev = batch_k.rope_store_reference(parts.sum(axis=0)[:rows], positions, n_heads, n_kv, hd, cos, sin, b)
    assert_rows_close(q.get().reshape(rows, n_heads, hd), eq, 1e-5, "rope q")
    k_got, v_got = k_cache.get(), v_cache.get()
    for r, (pos, slot) in enumerate(zip(positions, row_slots)):
        assert_rows_close(k_got[slot, pos].astype(np.float32), ek[r].astype(np.float32), 1e-3, "rope k")
        assert_rows_close(v_got[slot, pos].astype(np.float32), ev[r].astype(np.float32), 1e-3, "rope v")


# Rows of one float4 per thread and of two (batch_rmsnorm_wide), slices in whole and partial batches
# of a thread's loads, no slices (the first layer), SmolLM2's 576.
@pytest.mark.parametrize("dim, slices", [(256, 2), (576, 9), (2048, 16), (4096, 0), (6144, 5), (8192, 15)])
def test_rmsnorm_matches_its_reference(cupy_gpu, mod, dim, slices):
    cp = cupy_gpu
    rng = np.random.default_rng(dim + slices)
    rows, padded = 5, 8
    plan_dim = batch_k.GemvPlan(dim, 128, padded, 1, slices, 8) if slices else None
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    parts = rng.standard_normal((max(slices, 1), padded, dim)).astype(np.float32)
    weight = rng.standard_normal(dim).astype(np.float32)
    x_dev = cp.asarray(x)
    out = cp.full((rows, dim + 128), np.nan, dtype=cp.float16)
    batch_k.make_rmsnorm(mod, rows, x_dev, cp.asarray(parts), plan_dim, cp.asarray(weight), dim, 1e-5, out,
                         out.shape[1])()
    summed = x + parts[:slices].sum(axis=0)[:rows]
    assert_rows_close(x_dev.get(), summed, 1e-6, "residual")
    assert_rows_close(out[:, :dim].get().astype(np.float32),
                      batch_k.rmsnorm_reference(summed, weight, 1e-5).astype(np.float32), 1e-3, "rmsnorm")
    assert np.isnan(out[:, dim:].get().astype(np.float32)).all(), "rmsnorm wrote past the row"


def test_swiglu_and_logits_match_their_references(cupy_gpu, mod):
    cp = cupy_gpu
    rng = np.random.default_rng(11)
    rows, padded, slices, ffn, vocab = 5, 8, 2, 384, 1000

    plan_ffn = batch_k.GemvPlan(2 * ffn, 128, padded, 1, slices, 8)
    gate_up = rng.standard_normal((slices, padded, 2 * ffn)).astype(np.float32)
    h = cp.full((rows, ffn), np.nan, dtype=cp.float16)
    batch_k.make_swiglu(mod, rows, cp.asarray(gate_up), plan_ffn, ffn, h, ffn)()
    assert_rows_close(h.get().astype(np.float32),
                      batch_k.swiglu_reference(gate_up.sum(axis=0)[:rows]).astype(np.float32), 1e-3, "swiglu")

    plan_vocab = batch_k.GemvPlan(vocab, 128, padded, 1, slices, 8)
    head = rng.standard_normal((slices, padded, vocab)).astype(np.float32)
    head[:, 2, 17] = head[:, 2, 900] = 50.0           # a tie: the lower id wins
    logits = cp.full((padded, vocab), np.nan, dtype=cp.float32)
    best = cp.full(padded, -1, dtype=cp.int32)
    batch_k.make_logits(mod, rows, cp.asarray(head), plan_vocab, vocab, logits, best)()
    expected = head.sum(axis=0)[:rows]
    assert_rows_close(logits[:rows].get(), expected, 1e-6, "logits")
    assert best[:rows].get().tolist() == np.argmax(expected, axis=-1).tolist()
    assert best[2].get() == 17


# ------------------------------------------------------------------------------------- sampling

# Per-row parameters, cycled over the rows: plain greedy, the batch-1 sampler's cases (greedy with a
# penalty, temperature alone, top-k, top-p, min-p, mixtures), penalties below 1 and mixed.
ROW_SAMPLING = [
    SamplingParams(),
    *SAMPLING,
    SamplingParams(temperature=0.9, repetition_penalty=0.7),
    SamplingParams(temperature=0.0, repetition_penalty=0.5),
    SamplingParams(temperature=1.1, top_k=200, repetition_penalty=1.5),
]


@pytest.fixture(scope="module")
def sample_mod(cupy_gpu):
    from tinyinfer.kernels import sampling as sample_k
    from tinyinfer.kernels.build import device_compute_capability

    return sample_k.compile_sampler(device_compute_capability())


def run_batch_sample(cp, sample_mod, logits, params, uniforms, positions, slots, history, best=None):
    """batch_sample over host arrays, outputs (tokens, scratch) poisoned first: (tokens, history after)."""
    from tinyinfer.kernels import sampling as sample_k

    n_rows, vocab = logits.shape
    table = np.stack([sample_k.params_array(p) for p in params])
    tokens = cp.full(n_rows, -1, dtype=cp.int32)
    history_dev = cp.asarray(history)
    launch = sample_k.make_batch_sample(
        sample_mod, n_rows, vocab, cp.asarray(logits), None if best is None else cp.asarray(best.astype(np.int32)),
        cp.asarray(table), cp.asarray(np.asarray(uniforms, np.float64)), cp.asarray(positions.astype(np.int32)),
        cp.asarray(slots.astype(np.int32)), history_dev, history.shape[1], cp.full((n_rows, vocab), np.nan),
        tokens)
    launch()
    return tokens.get(), history_dev.get()


@pytest.mark.parametrize("n_rows", [1, 2, 5, 8, 17, 32])
@pytest.mark.parametrize("vocab", [32000, 1001, 128256])
@pytest.mark.parametrize("ties", [False, True])
def test_batch_sample_matches_the_reference_per_row(cupy_gpu, sample_mod, n_rows, vocab, ties):
    """Every row's token is sample(its logits, its params, its slot's history up to its position, its u)
    on fresh random logits (many equal values with ties), rows in shuffled slots with histories of 1 to
    max_context ids (the rest of each slot's history random ids too, so reading past the position would
    change the penalty); each token is appended at its position + 1, nothing else in the history moves.
    With best given, plain greedy rows take it (here another id than the argmax) and the others ignore it."""
    cp = cupy_gpu
    rng = np.random.default_rng(n_rows * 7 + vocab + ties)
    max_context, n_slots = 300, 33
    for trial in range(3):
        logits = (3 * rng.standard_normal((n_rows, vocab))).astype(np.float32)
        if ties:
            logits = np.round(logits * 2) / 2
        params = [ROW_SAMPLING[(r + trial) % len(ROW_SAMPLING)] for r in range(n_rows)]
        uniforms = rng.random(n_rows)
        slots = rng.permutation(n_slots)[:n_rows]
        positions = np.array([[0, max_context - 1, 1][r % 3] if r < 3 else rng.integers(0, max_context)
                              for r in range(n_rows)])
        history = rng.integers(0, vocab, (n_slots, max_context)).astype(np.int32)
        history[slots[:2], :5] = 7                                    # repeated ids: one penalty each
        expected = np.array([sample(logits[r], params[r], history[slots[r], : positions[r] + 1], uniforms[r])
                             for r in range(n_rows)])
        plain = np.array([p.greedy and p.repetition_penalty == 1.0 for p in params])
        decoy = np.argmin(logits, axis=-1)
        for best in (None, decoy):
            tokens, after = run_batch_sample(cp, sample_mod, logits, params, uniforms, positions, slots, history,
                                             best)
            want = np.where(plain, decoy, expected) if best is not None else expected
            for r in range(n_rows):
                assert tokens[r] == want[r], (f"trial {trial} row {r} {params[r]} (best given: {best is not None}): "
                                              f"device {tokens[r]}, reference {want[r]}")
            appended = history.copy()
            for r in range(n_rows):
                if positions[r] + 1 < max_context:
                    appended[slots[r], positions[r] + 1] = tokens[r]
            np.testing.assert_array_equal(after, appended)


# ------------------------------------------------------------------------------------- engine

@pytest.fixture(scope="module", params=[("tinyllama", "q4"), ("llama-2-7b", "q4"), ("tinyllama", "q8"),
                                        ("tinyllama", "f16")], ids=lambda p: f"{p[0]}-{p[1]}")
def case(request, tmp_path_factory, shared_assets, cupy_gpu):
    shape, quant = request.param
    config = tinf_config(json.loads((shared_assets / CONFIG_FILES[shape]).read_text()), n_layers=2)
    config["max_context"] = CONTEXT
    path = write_random_model(tmp_path_factory.mktemp("batch") / f"{shape}-{quant}.tinf", config, quant,
                              seed=len(shape) + len(quant))
    model = load(path, device="cuda")
    yield {"name": f"{shape}-{quant}", "quant": quant, "path": path, "model": model,
           "reference": NumpyBackend(open_tinf(path), max_context=CONTEXT)}
    model.close()


def q4_only(case) -> None:
    if case["quant"] != "q4":
        pytest.skip("the engine's API is encoding-blind: checked on q4")


def run_schedule(engine, prompts, budgets, params, cancel_at: dict, max_steps: int = 2000):
    """Submit prompts as slots free up (in order), step until all are done; cancel_at: {prompt index:
    step}. Returns per prompt (generated tokens, logits rows of its steps) and the buckets used."""
    from tinyinfer.runtime.cuda_batch import bucket_for

    generated = [[] for _ in prompts]
    logits = [[] for _ in prompts]
    owner, queue, buckets = {}, list(range(len(prompts))), set()
    for step in range(max_steps):
        if not queue and not engine.has_work():
            break
        while queue and engine.free_slots():
            i = queue.pop(0)
            owner[engine.submit(prompts[i], params[i], budgets[i], seed=i)] = i
        for slot, i in list(owner.items()):
            if cancel_at.get(i) == step and slot in engine.active_slots():
                engine.cancel(slot)
                del owner[slot]
        events = engine.step()
        if events:
            buckets.add(bucket_for(len(events)))
        for slot, event in events.items():
            i = owner[slot]
            generated[i].append(event.token)
            logits[i].append(engine.last_logits[slot])
            if event.finish_reason:
                del owner[slot]
    else:
        raise AssertionError("the schedule did not finish")
    return generated, logits, buckets


def check_against_references(case, prompts, generated, logits, what: str) -> None:
    backend, reference = case["model"].backend, case["reference"]
    worst = {"reference": 0.0, "batch-1 CUDA": 0.0}
    for i, (prompt, tokens, rows) in enumerate(zip(prompts, generated, logits)):
        if not tokens:
            continue
        ids = np.concatenate([prompt, np.asarray(tokens[:-1], dtype=np.int64)])
        first = len(prompt) - 1
        ours = np.stack(rows)
        theirs = reference.forward(ids, 0)[first:]
        single = backend.forward(ids, 0)[first:]
        for expected, against in ((theirs, "reference"), (single, "batch-1 CUDA")):
            errors = relative_errors(ours, expected)
            worst[against] = max(worst[against], float(errors.max()))
            assert np.isfinite(ours).all(), f"{what} prompt {i}: non-finite logits"
            assert errors.max() <= MAX_ERROR, \
                (f"{what} prompt {i} (length {len(prompt)}) vs {against}: relative error {errors.max():.2e} "
                 f"at step {errors.argmax()}")
        shortfall = prefill_k.argmax_shortfall(theirs, ours.argmax(-1))
        assert (shortfall <= prefill_k.NEAR_TIE).all(), f"{what} prompt {i}: argmax differs beyond a near tie"
        greedy = np.asarray(tokens) == ours.argmax(-1)
        assert greedy.all() or i % 3 == 2, f"{what} prompt {i}: a greedy token is not its logits' argmax"
    print(f"{what} batched logits: max relative error {worst['reference']:.2e} vs the reference, "
          f"{worst['batch-1 CUDA']:.2e} vs the batch-1 CUDA backend")


def test_sequences_joining_and_leaving_match_single_stream_logits(case):
    """20 slots, 26 prompts of 1..150 tokens (by GEMM, 24 positions per step, while more than 16 are
    left; then in the steps' rows), 20 to 30 new tokens each: the step runs at buckets from 32 down;
    every third prompt samples (temperature, top_p); one prompt is cancelled while it waits for its
    prefill, one while it decodes."""
    from tinyinfer.runtime.cuda_batch import BatchEngine

    cfg = case["model"].config
    rng = np.random.default_rng(5)
    lengths = [1, 150, 17, 3, 64, 2, 33, 100, 8, 1, 45, 90, 5, 24, 25, 60, 7, 12, 130, 2, 40, 9, 77, 4, 16, 50]
    prompts = [rng.integers(0, cfg["vocab_size"], n) for n in lengths]
    budgets = [20 + (7 * i) % 11 for i in range(len(prompts))]
    sampled = SamplingParams(temperature=0.8, top_p=0.9)
    params = [sampled if i % 3 == 2 else SamplingParams() for i in range(len(prompts))]
    engine = BatchEngine(case["model"].backend, slots=20, max_context=CONTEXT, prefill_chunk=24, step_prefill=16,
                         keep_logits=True)
    try:
        generated, logits, buckets = run_schedule(engine, prompts, budgets, params, cancel_at={4: 2, 3: 12})
    finally:
        engine.close()
    print(f"buckets used: {sorted(buckets)}")
    assert {batch_k.padded_rows(b) for b in buckets} == {8, 16, 32} and len(buckets) >= 4
    assert not generated[4] and 0 < len(generated[3]) < budgets[3]
    for i, (tokens, budget) in enumerate(zip(generated, budgets)):
        if i not in (3, 4):
            assert len(tokens) == budget, f"prompt {i}: {len(tokens)} tokens, asked for {budget}"
    check_against_references(case, prompts, generated, logits, case["name"])


def test_a_seed_gives_the_same_tokens_in_a_batch_and_alone(case):
    """Sampling draws one uniform per token, so the batch's sampled tokens are generate_ids' for the
    same seed wherever the logits agree (random models: compared on the first 3 tokens only). The two
    paths' logits differ (the batch-1 GEMVs' hi + lo inputs against the batched step's fp16): at
    temperature 1 over all 32,000 near-equal ids of a random model that moved one draw across the
    boundary of two adjacent ids, so the draws are among the top 40, whose probabilities differ far
    more than the paths do."""
    q4_only(case)
    from tinyinfer.runtime.cuda_batch import BatchEngine

    backend = case["model"].backend
    rng = np.random.default_rng(9)
    prompts = [rng.integers(0, case["model"].config["vocab_size"], n) for n in (20, 3, 40)]
    params = SamplingParams(temperature=0.8, top_k=40)
    engine = BatchEngine(backend, slots=3, max_context=CONTEXT)
    try:
        slots = [engine.submit(p, params, 3, seed=100 + i) for i, p in enumerate(prompts)]
        out = {s: [] for s in slots}
        while engine.has_work():
            for slot, event in engine.step().items():
                out[slot].append(event.token)
    finally:
        engine.close()
    sampled = False
    for i, (slot, prompt) in enumerate(zip(slots, prompts)):
        alone = list(backend.generate_ids(prompt, 0, params, 3, np.random.default_rng(100 + i)))
        assert out[slot] == alone
        sampled |= alone != list(backend.generate_ids(prompt, 0, SamplingParams(), 3, np.random.default_rng(0)))
    assert sampled, "every sequence decoded its greedy tokens: nothing was sampled"


def run_alone_or_together(engine, prompts, params, budgets, seeds):
    """Submit every prompt, step until all are done: (tokens, logits rows) per prompt."""
    slots = [engine.submit(p, params[i], budgets[i], seed=seeds[i]) for i, p in enumerate(prompts)]
    tokens, rows = {s: [] for s in slots}, {s: [] for s in slots}
    while engine.has_work():
        for slot, event in engine.step().items():
            tokens[slot].append(event.token)
            rows[slot].append(engine.last_logits[slot])
    return [tokens[s] for s in slots], [rows[s] for s in slots]


def test_device_sampling_is_the_reference_on_the_steps_logits(case):
    """12 sequences, each with its own parameters (ROW_SAMPLING: greedy, penalties above and below 1,
    temperature, top-k, top-p, min-p) and seed, through the engine with the logits kept: every token is
    sample() of its step's logits row with the prompt and the tokens so far as history and its seed's
    next draw. Exact: the device sampler on the very logits, one rng.random() per token."""
    q4_only(case)
    from tinyinfer.runtime.cuda_batch import BatchEngine

    rng = np.random.default_rng(13)
    lengths = [1, 20, 3, 45, 8, 2, 30, 12, 5, 60, 9, 17]
    prompts = [rng.integers(0, case["model"].config["vocab_size"], n) for n in lengths]
    params = [ROW_SAMPLING[i % len(ROW_SAMPLING)] for i in range(len(prompts))]
    budgets = [12 - i % 4 for i in range(len(prompts))]
    seeds = [300 + i for i in range(len(prompts))]
    engine = BatchEngine(case["model"].backend, slots=len(prompts), max_context=CONTEXT, keep_logits=True)
    try:
        tokens, rows = run_alone_or_together(engine, prompts, params, budgets, seeds)
    finally:
        engine.close()
    sampled = 0
    for i, prompt in enumerate(prompts):
        assert len(tokens[i]) == budgets[i]
        draws = np.random.default_rng(seeds[i]).random(budgets[i])
        for k, (token, logits) in enumerate(zip(tokens[i], rows[i])):
            history = np.concatenate([prompt, np.asarray(tokens[i][:k], dtype=np.int64)])
            expected = sample(logits, params[i], history, draws[k])
            assert token == expected, f"prompt {i} ({params[i]}) token {k}: device {token}, reference {expected}"
            sampled += token != int(np.argmax(logits))
    assert sampled, "no token differs from its logits' argmax: nothing was sampled"


def test_a_seed_gives_the_same_tokens_in_a_batch_and_alone_in_the_engine(case):
    """8 sequences with mixed parameters (penalties included) and seeds decode together, leaving at
    different steps (buckets 8 down to 1, all of 8 padded rows: the same GEMV plans), then each alone
    in a fresh engine: the same tokens, every one of them. A row's logits depend on nothing else in a
    step of the same padded size, and each prompt (all together under one prefill chunk, step_prefill
    0: none in the steps' rows, whose padded sizes differ alone and together) is prefilled in one call
    either way, so the batch changes nothing a sequence samples from."""
    q4_only(case)
    from tinyinfer.runtime.cuda_batch import BatchEngine

    backend = case["model"].backend
    rng = np.random.default_rng(17)
    lengths = [1, 7, 30, 64, 5, 100, 2, 12]
    prompts = [rng.integers(0, case["model"].config["vocab_size"], n) for n in lengths]
    params = [ROW_SAMPLING[(i + 1) % len(ROW_SAMPLING)] for i in range(len(prompts))]
    budgets = [6 + i for i in range(len(prompts))]
    seeds = [500 + i for i in range(len(prompts))]
    engine = BatchEngine(backend, slots=len(prompts), max_context=CONTEXT, keep_logits=True, step_prefill=0)
    try:
        together, together_rows = run_alone_or_together(engine, prompts, params, budgets, seeds)
    finally:
        engine.close()
    engine = BatchEngine(backend, slots=1, max_context=CONTEXT, keep_logits=True, step_prefill=0)
    try:
        for i, prompt in enumerate(prompts):
            (alone,), (alone_rows,) = run_alone_or_together(engine, [prompt], [params[i]], [budgets[i]], [seeds[i]])
            difference = max(float(np.abs(a - b).max()) for a, b in zip(alone_rows, together_rows[i]))
            print(f"prompt {i}: logits alone vs together differ by at most {difference:.2e}")
            assert alone == together[i], f"prompt {i} ({params[i]}): alone {alone}, in the batch {together[i]}"
    finally:
        engine.close()


def test_engine_refusals(case, monkeypatch):
    q4_only(case)
    from tinyinfer.runtime import cuda_batch

    backend = case["model"].backend
    engine = cuda_batch.BatchEngine(backend, slots=2, max_context=64)
    try:
        engine.submit([1, 2, 3], max_new_tokens=4)
        engine.submit([4], max_new_tokens=4)
        with pytest.raises(SlotsFullError):
            engine.submit([5], max_new_tokens=4)
        engine.cancel(0)
        assert engine.free_slots() == [0]
        with pytest.raises(ContextOverflowError):
            engine.submit(list(range(60)), max_new_tokens=10)
        with pytest.raises(ValueError):
            engine.submit([case["model"].config["vocab_size"]], max_new_tokens=1)
    finally:
        engine.close()
    monkeypatch.setattr(cuda_batch.BatchEngine, "slot_bytes", lambda self: 1 << 45)
    with pytest.raises(DeviceError, match="fewer parallel sequences"):
        cuda_batch.BatchEngine(backend, slots=4, max_context=64)


def test_generate_batch_uses_the_engine(case, monkeypatch):
    q4_only(case)
    from tinyinfer.runtime import cuda_batch

    made = []
    real = cuda_batch.BatchEngine

    def spy(*args, **kwargs):
        made.append(kwargs.get("slots"))
        return real(*args, **kwargs)

    monkeypatch.setattr(cuda_batch, "BatchEngine", spy)
    texts = case["model"].generate_batch(["one", "two words", "three more words"], max_tokens=4)
    assert made == [3] and len(texts) == 3 and all(isinstance(t, str) for t in texts)
