"""Batched decoding without a GPU: the GEMV's fragment order (q4, q8, f16) emulated in NumPy, how its
work is split, the step's buckets and launches, the scheduling, and Model.generate_batch's serial
fallback on the CPU."""

from __future__ import annotations

import numpy as np
import pytest

from tinyinfer.formats.quant import scale_offset
from tinyinfer.kernels import batch as batch_k
from tinyinfer.kernels import gemv as gemv_k
from tinyinfer.kernels import layout
from tinyinfer.runtime import load
from tinyinfer.runtime.bench import random_encoded, write_random_model
from tinyinfer.runtime.cuda_backend import CudaBackend
from tinyinfer.runtime.cuda_batch import BUCKETS, MAX_ROWS, BatchEngine, bucket_for
from tinyinfer.runtime.sampling import SamplingParams

from tinf_samples import stored_bytes  # noqa: E402


def q4_pair(word: int, shift: int, scale: np.float16) -> np.ndarray:
    """batch.cu q4_pair then the scale: the two fp16 values of one half2 register (low, high)."""
    nibbles = np.array([(word >> shift) & 0xF, (word >> (shift + 16)) & 0xF], dtype=np.float16)
    return (nibbles - np.float16(8)) * scale


def q8_pair(word: int, first_byte: int, scale: np.float16) -> np.ndarray:
    """batch.cu q8_scaled_pair: bytes first_byte and first_byte + 1 of the word as int8, times the scale."""
    values = np.array([word >> (8 * first_byte), word >> (8 * first_byte + 8)], dtype=np.uint32).astype(np.uint8)
    return values.view(np.int8).astype(np.float16) * scale


def a_values(encoding: str, words: np.ndarray, step: int, scale) -> tuple[np.ndarray, np.ndarray]:
    """batch.cu a_fragment for one row: (k slots 2t, 2t+1), (2t+8, 2t+9) of k-step `step`."""
    if encoding == "q4":
        word, shift = int(words[step >> 1]), 8 * (step & 1)
        return q4_pair(word, shift, scale), q4_pair(word, shift + 4, scale)
    if encoding == "q8":
        return q8_pair(int(words[step]), 0, scale), q8_pair(int(words[step]), 2, scale)
    halves = words.view(np.float16)
    return halves[4 * step: 4 * step + 2], halves[4 * step + 2: 4 * step + 4]


def staged_quad(encoding: str, h_row: np.ndarray, column: int) -> list[np.ndarray]:
    """batch.cu staged_quad: four half2 (b0, b1 of two k-steps) from 8 columns of h."""
    x = h_row[column: column + 8]
    if encoding == "q4":
        return [x[[0, 4]], x[[1, 5]], x[[2, 6]], x[[3, 7]]]
    return [x[0:2], x[2:4], x[4:6], x[6:8]]


def emulate_gemv(encoding: str, blocked: np.ndarray, rows: int, kpad: int, group: int, h: np.ndarray) -> np.ndarray:
    """What batch_gemv computes, lane by lane: A and B fragments built as the kernel builds them,
    each mma as D[m][n] += sum_k A[m][k] B[k][n] over the PTX fragment layout."""
    piece_cols = batch_k.PIECE_COLS[encoding]
    row_bytes = layout.row_bytes(encoding, kpad)
    groups = kpad // group if encoding != "f16" else 0
    scales = blocked[scale_offset(encoding, (rows, kpad), group):].view(np.float16) if groups else None
    padded, quads = h.shape[0], piece_cols // 32
    out = np.zeros((padded, rows), np.float64)
    for tile in range(-(-rows // 16)):
        for piece in range(kpad // piece_cols):
            for nb in range(padded // 8):
                d = np.zeros((16, 8))
                for j in range(quads):
                    for half in range(2):
                        a, b = np.zeros((16, 16)), np.zeros((16, 8))
                        for lane in range(32):
                            g, t = lane >> 2, lane & 3
                            for hi in (0, 1):
                                r = tile * 16 + 8 * hi + g
                                if r >= rows:
                                    continue
                                at = (r - r % 8) * row_bytes + piece * 512 + (r % 8) * 64 + 16 * t
                                words = blocked[at: at + 16].view(np.uint32)
                                scale = None
                                if groups:
                                    column = piece * piece_cols + piece_cols // 4 * t
                                    scale = scales[(r - r % 8) * groups + 8 * (column // group) + r % 8]
                                low, high = a_values(encoding, words, 2 * j + half, scale)
                                a[8 * hi + g, 2 * t: 2 * t + 2] = low
                                a[8 * hi + g, 2 * t + 8: 2 * t + 10] = high
                            column = piece * piece_cols + piece_cols // 4 * t + 8 * j
                            quad = staged_quad(encoding, h[nb * 8 + g], column)
                            b[2 * t: 2 * t + 2, g] = quad[2 * half]
                            b[2 * t + 8: 2 * t + 10, g] = quad[2 * half + 1]
                        d += a @ b
                for hi in (0, 1):
                    r0 = tile * 16 + 8 * hi
                    n_rows = min(8, rows - r0)
                    if n_rows > 0:
                        out[nb * 8: nb * 8 + 8, r0: r0 + n_rows] += d[8 * hi: 8 * hi + n_rows].T
    return out


@pytest.mark.parametrize("encoding, rows, cols, group, padded", [
    ("q4", 24, 256, 32, 8), ("q4", 16, 128, 64, 16), ("q4", 8, 256, 128, 8),
    ("q8", 24, 128, 32, 8), ("q8", 16, 192, 64, 16), ("f16", 24, 64, 0, 8), ("f16", 8, 96, 0, 16)])
def test_gemv_fragment_order_multiplies_every_column_once(encoding, rows, cols, group, padded):
    """The kernel's column-to-k-slot mapping (weights by nibble masks, byte selectors or as stored; h by
    the staging order) pairs each weight with its own column of h: the emulation equals h @ W^T."""
    rng = np.random.default_rng(rows + cols + group)
    tensor = random_encoded(encoding, (rows, cols), group or None, rng)
    shape = gemv_k.shape_of(tensor)
    assert batch_k.can_run(encoding, rows, shape.cols_pad, group)
    blocked = stored_bytes(tensor).copy()
    layout.block_in_place(blocked, shape)
    h = rng.standard_normal((padded, shape.cols_pad)).astype(np.float16)
    got = emulate_gemv(encoding, blocked, rows, shape.cols_pad, group, h)
    expected = batch_k.gemv_reference(h, batch_k.weight_reference(tensor))
    assert np.allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


@pytest.mark.parametrize("rows, kpad", [(2560, 2048), (11264, 2048), (2048, 5632), (32000, 2048), (12288, 4096),
                                        (22016, 4096), (4096, 11008), (8, 128), (200, 384)])
@pytest.mark.parametrize("padded", [8, 16, 32])
@pytest.mark.parametrize("encoding", ["q4", "q8", "f16"])
def test_gemv_plan_covers_every_tile_and_piece(rows, kpad, padded, encoding):
    plan = batch_k.plan_gemv(rows, kpad, padded, n_sms=132, encoding=encoding)
    pieces = kpad // batch_k.PIECE_COLS[encoding]
    assert plan.slices * plan.pieces_per_slice >= pieces > (plan.slices - 1) * plan.pieces_per_slice
    assert plan.grid[0] * plan.tiles_per_block >= -(-rows // 16) > (plan.grid[0] - 1) * plan.tiles_per_block
    assert plan.tiles_per_block % batch_k.GEMV_WARPS == 0
    assert plan.shared_bytes <= batch_k.STAGE_BYTES


def test_buckets_and_padded_rows():
    assert [bucket_for(n) for n in (1, 2, 3, 5, 8, 9, 17, 32)] == [1, 2, 4, 8, 8, 16, 32, 32]
    assert [batch_k.padded_rows(b) for b in BUCKETS] == [8, 8, 8, 8, 16, 32]
    with pytest.raises(ValueError):
        batch_k.padded_rows(33)


def test_attention_reference_is_the_reference_per_row():
    """kernels/batch.attention_reference (the oracle of batch_attention) is reference.attention of each row."""
    from tinyinfer.runtime import reference as ref

    rng = np.random.default_rng(3)
    k = rng.standard_normal((3, 20, 2, 16)).astype(np.float16)
    v = rng.standard_normal((3, 20, 2, 16)).astype(np.float16)
    q = rng.standard_normal((2, 4, 16)).astype(np.float32)
    got = batch_k.attention_reference(q / np.float32(4.0), k, v, [5, 19], [2, 0])
    for b, (pos, slot) in enumerate([(5, 2), (19, 0)]):
        expected = ref.attention(q[b: b + 1], k[slot, : pos + 1].astype(np.float32),
                                 v[slot, : pos + 1].astype(np.float32), np.array([pos]))
        assert np.allclose(got[b].astype(np.float32), expected[0], rtol=2e-3, atol=2e-3)


def emulate_attention(q, k_cache, v_cache, positions, slots, n_kv: int, window: int | None,
                      warps: int) -> np.ndarray:
    """What batch_attention (of `warps` warps) computes, lane by lane: which lane reads which 16-byte piece of which key
    row in which pass (the kernel's index arithmetic), the lane groups' and warps' sums in its order."""
    n_rows, n_heads, hd = q.shape
    group, pieces = n_heads // n_kv, hd // 8
    lanes_per_key = 1 << (pieces - 1).bit_length()
    keys_per_warp = 32 // lanes_per_key
    keys_per_round = warps * keys_per_warp
    out = np.zeros((n_rows, n_heads * hd), np.float32)
    for b in range(n_rows):
        pos = int(positions[b])
        first = max(0, pos - window + 1) if window else 0
        n_keys = pos - first + 1
        for kvh in range(n_kv):
            heads = q[b, kvh * group: (kvh + 1) * group]                      # [group, hd]
            scores = np.full((group, n_keys), np.nan, np.float32)
            read = np.zeros((n_keys, hd), int)
            pv = np.zeros((warps, group, hd), np.float32)
            lanes = []                                                    # (warp, piece, key) of each load
            for start in range(0, n_keys, batch_k.ATTENTION_UNROLL * keys_per_round):
                for u in range(batch_k.ATTENTION_UNROLL):
                    for warp in range(warps):
                        for lane in range(32):
                            piece, sub = lane % lanes_per_key, lane // lanes_per_key
                            key = start + u * keys_per_round + warp * keys_per_warp + sub
                            if piece < pieces and key < n_keys:
                                lanes.append((warp, piece, key))
            partial = {}
            for warp, piece, key in lanes:                                # scores: each lane's 8 columns
                cols = slice(8 * piece, 8 * piece + 8)
                row = k_cache[slots[b], first + key, kvh, cols].astype(np.float32)
                read[key, cols] += 1
                partial[key] = partial.get(key, 0) + (heads[:, cols] * row).sum(-1)
            for key, s in partial.items():
                scores[:, key] = s
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            for warp, piece, key in lanes:                                # p . V
                cols = slice(8 * piece, 8 * piece + 8)
                row = v_cache[slots[b], first + key, kvh, cols].astype(np.float32)
                pv[warp, :, cols] += probs[:, key: key + 1] * row
            assert (read == 1).all(), "a key column read twice or never"
            heads_out = pv.sum(0) / probs.sum(-1, keepdims=True)
            out[b, kvh * group * hd: (kvh + 1) * group * hd] = heads_out.reshape(-1)
    return out


@pytest.mark.parametrize("hd, n_heads, n_kv", [(64, 32, 4), (128, 8, 8), (96, 12, 6), (8, 4, 2), (32, 16, 2)])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("warps", [batch_k.ATTENTION_WARPS, 2 * batch_k.ATTENTION_WARPS])
def test_attention_lanes_read_every_key_once(hd, n_heads, n_kv, window, warps):
    """batch_attention's split of a slot's keys over lanes (16-byte pieces, lane groups of a power of two,
    unrolled passes) covers each column of each key exactly once: the emulation equals the reference."""
    rng = np.random.default_rng(hd + n_heads + (window or 0))
    positions, slots = np.array([0, 40, 300, 129]), np.array([1, 0, 2, 0])
    k = rng.standard_normal((3, 301, n_kv, hd)).astype(np.float16)
    v = rng.standard_normal((3, 301, n_kv, hd)).astype(np.float16)
    q = (rng.standard_normal((4, n_heads, hd)) / np.sqrt(hd)).astype(np.float32)
    got = emulate_attention(q, k, v, positions, slots, n_kv, window, warps)
    expected = batch_k.attention_reference(q, k, v, positions, slots, window).astype(np.float32)
    assert np.allclose(got, expected, rtol=2e-3, atol=2e-3)


def test_attention_kernel_follows_the_grid():
    """Fewer (KV head, row) blocks than SMs: the wide kernels (8 warps of the tensor-core one, one pass
    over twice the keys in the scalar one); a grid that fills the SMs: narrow blocks, several an SM.
    Head dims other than 64 and 128 take the scalar kernels."""
    assert batch_k.attention_warps(4 * 16, 132) == 2 * batch_k.ATTENTION_WARPS
    assert batch_k.attention_warps(131, 132) == 2 * batch_k.ATTENTION_WARPS
    assert batch_k.attention_warps(132, 132) == batch_k.ATTENTION_WARPS
    assert batch_k.attention_kernel(64, 8, 4 * 16, 132) == "batch_attention_mma64_8"
    assert batch_k.attention_kernel(128, 1, 32 * 16, 132) == "batch_attention_mma128_4"
    assert batch_k.attention_kernel(96, 2, 6 * 16, 132) == "batch_attention_wide"
    assert batch_k.attention_kernel(96, 2, 6 * 32, 132) == "batch_attention"
    assert batch_k.attention_kernel(64, 16, 8, 132) == "batch_attention_wide"        # groups over 8: scalar


def test_attention_kernel_follows_the_padded_step():
    """The kernel is chosen by the padded row count, as the GEMV plans are: a row's sums in a step of
    1 row and of 8 (both padded to 8) come from the same kernel, so a batch changes no row's logits
    (7B's 32 KV heads: 32 blocks at 1 row, 256 padded)."""
    class Kernel:
        shared_size_bytes, max_dynamic_shared_size_bytes = 0, 0

    class Module:
        def get_function(self, name):
            return Kernel()

    def kernel(n_rows, n_kv, hd):
        return batch_k.make_attention(Module(), n_rows, 0, 0, 0, 0, 0, 0, n_kv, n_kv, hd, None, 256, 0, 0,
                                      132).name

    assert kernel(1, 32, 128) == kernel(8, 32, 128) == "batch_attention_mma128_4"
    assert kernel(1, 32, 96) == kernel(8, 32, 96) == "batch_attention"
    assert kernel(1, 4, 64) == kernel(32, 4, 64) == "batch_attention_mma64_8"    # 32 to 128 blocks


def test_generate_batch_on_the_cpu_is_each_prompt_alone(tmp_path):
    """Without a GPU, generate_batch runs the prompts one after the other: the same texts as generate()."""
    from tinyinfer.runtime.bench import tinf_config

    config = tinf_config({"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "intermediate_size": 128, "vocab_size": 300, "num_hidden_layers": 2,
                          "max_position_embeddings": 128})
    path = write_random_model(tmp_path / "tiny.tinf", config, "q4")
    with load(path, device="cpu") as model:
        prompts = ["hello there", "a longer prompt than the first one"]
        texts = model.generate_batch(prompts, max_tokens=6, temperature=0.8, seed=5)
        alone = ["".join(model.generate(p, max_tokens=6, temperature=0.8, seed=5 + i)) for i, p in enumerate(prompts)]
    assert texts == alone
    assert len(texts) == 2


class ScheduleOnly(BatchEngine):
    """The engine's scheduling with the device work replaced: prefill spans, history writes, the step's
    rows and the staged sampling buffer (per row parameters then u) recorded, each row's token a
    function of its slot and position."""

    def __init__(self, slots: int, prefill_chunk: int, vocab: int = 97, max_context: int = 200, step_prefill=5):
        from tinyinfer.kernels import sampling as sample_k

        self.n_slots, self.prefill_chunk, self.vocab, self.max_context = slots, prefill_chunk, vocab, max_context
        self.step_prefill = step_prefill
        self.keep_logits, self.last_logits = False, {}
        self.sequences, self.waiting, self.step_times = {}, [], []
        self.spans, self.steps, self.histories, self.staged = [], [], [], []
        self.sampling_host = np.full(32 * (sample_k.P_COUNT + 1), np.nan)

    def prefill_span(self, slot, ids, start):
        self.spans[-1].append((slot, start, start + ids.size))

    def write_history(self, slot, prompt):
        self.histories.append((slot, np.array(prompt)))

    def decode(self, rows, want_logits):
        self.steps[-1] = [(r.slot, r.position, r.token, r.samples) for r in rows]
        self.staged.append(self.sampling_host.copy())
        tokens = np.array([(7 * r.slot + r.position) % self.vocab for r in rows])
        if not want_logits:
            return tokens, None
        return tokens, np.random.default_rng(len(self.steps)).standard_normal((len(rows), self.vocab))

    def step(self):
        self.spans.append([])
        self.steps.append([])
        return super().step()


def test_schedule_prefills_in_chunks_and_feeds_each_sequence_its_own_tokens():
    """6 prompts through 3 slots: each prompt but its last token is cached once, in order: by GEMM
    chunks (at most one chunk per step while others decode) while more than step_prefill positions are
    left, then as rows of the steps (at most MAX_ROWS rows); the row of a prompt's last token samples
    its first token, then each row's input is its own previous output at its own next position; slots
    are reused as sequences leave; one cancel."""
    engine = ScheduleOnly(slots=3, prefill_chunk=10, step_prefill=5)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 97, n) for n in (1, 25, 4, 12, 30, 6)]
    budgets = [5, 3, 6, 4, 2, 9]
    params = [SamplingParams(temperature=0.7) if i == 2 else SamplingParams() for i in range(len(prompts))]
    owner, queue, slot_of = {}, list(range(len(prompts))), {}
    outputs, inputs, cached = ([[] for _ in prompts] for _ in range(3))
    for step in range(100):
        while queue and engine.free_slots():
            i = queue.pop(0)
            slot_of[i] = engine.submit(prompts[i], params[i], budgets[i], seed=i)
            owner[slot_of[i]] = i
        if len(outputs[5]) == 2 and slot_of[5] in owner:
            engine.cancel(slot_of[5])
            del owner[slot_of[5]]
            assert slot_of[5] in engine.free_slots()
        if not engine.has_work():
            break
        was_decoding = any(samples for r in engine.steps for *_, samples in r)
        left = {slot: seq.prompt_left for slot, seq in engine.sequences.items()}
        events = engine.step()
        prefilled = sum(e - b for _, b, e in engine.spans[-1])
        assert prefilled <= 10 or not was_decoding, "the running sequences waited for more than one chunk"
        assert len(engine.steps[-1]) <= MAX_ROWS
        for slot, begin, end in engine.spans[-1]:
            assert left[slot] > 5, "a prompt with step_prefill positions left or fewer went through GEMM"
            cached[owner[slot]] += [("gemm", p) for p in range(begin, end)]
        for slot, pos, token, samples in engine.steps[-1]:
            i = owner[slot]
            if pos < prompts[i].size - 1:
                assert not samples and token == prompts[i][pos]
                cached[i].append(("row", pos))
            else:
                assert samples
                inputs[i].append((pos, token))
        assert sorted(events) == sorted(s for s, *_, samples in engine.steps[-1] if samples)
        for slot, event in events.items():
            outputs[owner[slot]].append(event.token)
            if event.finish_reason:
                assert event.finish_reason == "length" and slot not in engine.active_slots()
                del owner[slot]
    assert not queue and not engine.has_work() and not owner
    assert [len(o) for o in outputs] == budgets[:5] + [2]
    assert len(set(slot_of.values())) == 3                  # slots were reused
    for i, prompt in enumerate(prompts):
        assert [p for _, p in cached[i]] == list(range(prompt.size - 1))
        by_rows = [p for how, p in cached[i] if how == "row"]
        assert len(by_rows) <= 5 and (prompt.size - 1 > 5 or len(by_rows) == prompt.size - 1)
        first = prompt.size - 1
        assert inputs[i] == [(first + k, int(t)) for k, t in enumerate([prompt[-1]] + outputs[i][:-1])]
        assert outputs[i] == [(7 * slot_of[i] + first + k) % 97 for k in range(len(outputs[i]))]   # the device's
    assert any(how == "gemm" for how, _ in cached[1]) and any(how == "row" for how, _ in cached[1])


def test_schedule_stages_each_rows_parameters_draw_and_prompt_history():
    """Before each step every sampling row's SamplingParams (sample_k.params_array) and one rng.random()
    of its own seed, in order, are staged for the upload; prompt rows (their K/V only) and rows past the
    step's are greedy with u = 0 and draw nothing; each prompt is written to its slot's history at submit."""
    from tinyinfer.kernels import sampling as sample_k

    engine = ScheduleOnly(slots=3, prefill_chunk=50)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 97, n) for n in (3, 1, 8, 5)]
    params = [SamplingParams(temperature=0.7, top_k=5), SamplingParams(),
              SamplingParams(temperature=1.2, top_p=0.8, min_p=0.1, repetition_penalty=1.3),
              SamplingParams(repetition_penalty=2.0)]
    budgets = [4, 6, 3, 5]
    draws = {i: iter(np.random.default_rng(100 + i).random(10)) for i in range(len(prompts))}
    owner, queue, staged_rows = {}, list(range(len(prompts))), 0
    for _ in range(50):
        while queue and engine.free_slots():
            i = queue.pop(0)
            slot = engine.submit(prompts[i], params[i], budgets[i], seed=100 + i)
            owner[slot] = i
            assert engine.histories[-1][0] == slot and engine.histories[-1][1].tolist() == prompts[i].tolist()
        if not engine.has_work():
            break
        events = engine.step()
        if not events:
            continue
        staged = engine.staged[-1]
        p = sample_k.P_COUNT
        table, uniforms = staged[: 32 * p].reshape(32, p), staged[32 * p:]
        rows = engine.steps[-1]
        assert sorted(slot for slot, *_, samples in rows if samples) == sorted(events)
        greedy = sample_k.params_array(SamplingParams())
        for r, (slot, _, _, samples) in enumerate(rows):
            i = owner[slot]
            if not samples:
                np.testing.assert_array_equal(table[r], greedy)
                assert uniforms[r] == 0
                continue
            np.testing.assert_array_equal(table[r], sample_k.params_array(params[i]))
            assert uniforms[r] == next(draws[i]), f"prompt {i}: not its seed's next draw"
            staged_rows += 1
        np.testing.assert_array_equal(table[len(rows):], np.tile(greedy, (32 - len(rows), 1)))
        assert not uniforms[len(rows):].any()
        for slot, event in events.items():
            if event.finish_reason:
                del owner[slot]
    assert not engine.has_work() and staged_rows == sum(budgets)


# ------------------------------------------------------------------- the step's launches, no GPU

class HostArray(np.ndarray):
    """A NumPy array with CuPy's .data.ptr, so the engine's buffers can be host arrays."""

    @property
    def data(self):
        return type("Pointer", (), {"ptr": self.ctypes.data})()


class FakeKernel:
    shared_size_bytes, max_dynamic_shared_size_bytes = 0, 1 << 20

    def __init__(self, name):
        self.name = name


class FakeModule:
    def get_function(self, name):
        return FakeKernel(name)


class FakeCupy:
    float16, float32, int32 = np.float16, np.float32, np.int32

    class cuda:
        class Device:
            id = 0
            mem_info = (80 << 30, 80 << 30)

        class runtime:
            @staticmethod
            def getDeviceProperties(device):
                return {"sharedMemPerBlockOptin": 227 << 10}

    @staticmethod
    def get_default_memory_pool():
        return type("Pool", (), {"free_bytes": lambda self: 0})()

    @staticmethod
    def zeros(shape, dtype):
        return np.zeros(shape, dtype).view(HostArray)


class FakeStream:
    ptr = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def kernel_parameters(source: str, name: str) -> list[str]:
    """The parameter declarations of kernel `name` in a .cu source."""
    import re

    from tinyinfer.kernels.build import source_text

    text = source_text(source)
    name = re.sub(r"^batch_attention_mma\d+_\d+$", "batch_attention_mma##HD##_##WARPS", name)   # a macro's instances
    start = re.search(rf"\b{re.escape(name)}\(", text).end()
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(text[end], 0)
        end += 1
    return [p.strip() for p in re.sub(r"//[^\n]*", "", text[start: end - 1]).replace("\\", "").split(",")]


def expected_kind(parameter: str) -> str:
    if "*" in parameter:
        return "pointer"
    return parameter.replace("const ", "").rsplit(" ", 1)[0].strip()


def test_every_launch_of_the_step_passes_its_kernel_parameters(tmp_path, monkeypatch):
    """The launches of a step (each bucket) against batch.cu's, prefill.cu's and sampling.cu's
    signatures: the count of arguments, a pointer for each pointer, and each scalar in its C type (CuPy
    would pass a Python int as 64 bits)."""
    from tinyinfer.formats import open_tinf
    from tinyinfer.runtime import cuda_batch
    from tinyinfer.runtime import reference as ref
    from tinyinfer.runtime.bench import tinf_config

    config = tinf_config({"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "intermediate_size": 384, "vocab_size": 512, "num_hidden_layers": 2,
                          "max_position_embeddings": 64})
    tinf = open_tinf(write_random_model(tmp_path / "m.tinf", config, "q4"))
    data = np.frombuffer(tinf.path.read_bytes(), np.uint8)   # any bytes: the launches only take pointers
    cos, sin = ref.rope_tables(config["head_dim"], 64, 10000.0, None)
    backend = type("Backend", (), {
        "cp": FakeCupy, "tinf": tinf, "config": tinf.config, "max_context": 64, "n_sms": 132,
        "compute_capability": 90, "stream": FakeStream(), "rope_cos": cos, "rope_sin": sin,
        "view": lambda self, name: data[: tinf.info(name).nbytes].copy().view(HostArray),
        "f32_view": lambda self, name: data[: tinf.info(name).nbytes].copy().view(np.float32).view(HostArray),
    })()
    monkeypatch.setattr(cuda_batch.batch_k, "compile_batch", lambda cc: FakeModule())
    monkeypatch.setattr(cuda_batch.sample_k, "compile_sampler", lambda cc: FakeModule())
    monkeypatch.setattr(cuda_batch.cuda_prefill, "CudaOps", lambda b, chunk: type("Ops", (), {"mod": FakeModule()})())
    monkeypatch.setattr(cuda_batch, "pinned_empty", lambda n, dtype: np.zeros(n, dtype))
    engine = cuda_batch.BatchEngine(backend, slots=3, max_context=64)
    types = {"int": np.int32, "float": np.float32, "long long": np.int64}
    sources = {"embed_rows": "prefill.cu", "batch_sample": "sampling.cu"}
    for n in BUCKETS:
        launches = engine.build_step(n)
        assert len(launches) == 2 + 9 * config["n_layers"] + 1 + 1 + 1
        assert launches[-1].kernel.name == "batch_sample" and launches[-1].grid == (n,)
        # A step with prompt rows launches attention only once every row's K/V is stored (the kernels
        # load the keys below a row's position before their PDL wait); all else launches early as ever.
        with_prompt = engine.build_step(n, prompt_rows=True)
        for launch, mixed in zip(launches, with_prompt):
            attention = launch.kernel.name.startswith("batch_attention")
            assert launch.waits == (launch.kernel.name != "embed_rows") and mixed.waits == (launch.waits and not attention)
        for launch in launches:
            name = launch.kernel.name
            source = sources.get(name, "batch.cu")
            params = kernel_parameters(source, name.split("<")[0])
            assert len(launch.args) == len(params), f"{name}: {len(launch.args)} arguments for {len(params)}"
            for arg, param in zip(launch.args, params):
                kind = expected_kind(param)
                if kind == "pointer":
                    assert isinstance(arg, (np.ndarray, np.uint64)), f"{name}: {param} gets {type(arg)}"
                else:
                    assert type(arg) is types[kind], f"{name}: {param} gets {type(arg).__name__}"


# ------------------------------------------------------- the whole step on the CPU, kernels emulated

def as_array(pointer_or_array, dtype, count: int, registry: dict) -> np.ndarray:
    """A kernel argument as a NumPy view: an engine buffer, or a raw pointer into a registered one."""
    if isinstance(pointer_or_array, np.ndarray):
        return pointer_or_array.reshape(-1).view(np.uint8).view(dtype)[:count] if count else pointer_or_array
    address = int(pointer_or_array)
    for base, buffer in registry.items():
        if base <= address < base + buffer.nbytes:
            return buffer.reshape(-1).view(np.uint8)[address - base:].view(dtype)[:count]
    raise AssertionError(f"pointer {address:#x} into no known buffer")


def check_threads(name: str, grid, block, args) -> None:
    """The grid and block a kernel's thread mapping needs (batch.cu): RMSNorm's BR_ELEMS elements per
    thread cover the row, RoPE has a block per (row, head) and a thread per pair of columns within its
    launch bound, attention a block of BA_WARPS warps (or twice as many) per (KV head, row)."""
    if name in ("batch_rmsnorm", "batch_rmsnorm_wide"):
        vecs = 1 if name == "batch_rmsnorm" else 2
        assert block[0] % 32 == 0 and block[0] <= batch_k.RMSNORM_THREADS
        assert int(args[5]) % batch_k.RMSNORM_VEC == 0
        assert vecs * batch_k.RMSNORM_VEC * block[0] >= int(args[5]), f"{name}'s threads do not cover the row"
    elif name == "batch_rope_store":
        n_heads, n_kv, hd = (int(a) for a in args[6:9])
        assert grid[1] == n_heads + n_kv and hd // 2 <= block[0] <= batch_k.ROPE_THREADS
    elif name in ("batch_attention", "batch_attention_wide"):
        warps = batch_k.ATTENTION_WARPS * (2 if name == "batch_attention_wide" else 1)
        assert block[0] == 32 * warps and grid[0] == int(args[7])
    elif name.startswith("batch_attention_mma"):
        assert block[0] == 32 * int(name.rsplit("_", 1)[1]) and grid[0] == int(args[7])
        assert int(args[8]) == int(name[len("batch_attention_mma"):].split("_")[0])       # its head_dim


class EmulatedKernel(FakeKernel):
    """A batch.cu or prefill.cu kernel run by its NumPy reference, reading and writing the engine's
    host buffers through the very arguments the launch passes (pointers, strides, counts)."""

    def __init__(self, name, world):
        super().__init__(name)
        self.world = world

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        check_threads(self.name.split("<")[0], grid, block, args)
        if self.world["capturing"] is not None:
            self.world["capturing"].append((self, grid, args))
            return
        getattr(self, "run_" + self.name.split("<")[0])(grid, args)

    def run_embed_rows(self, grid, args):
        table, _, cols_pad, dim, ids, x = args
        rows = np.asarray(table).view(np.float16).reshape(-1, int(cols_pad))
        x[: grid[0]] = rows[np.asarray(ids)[: grid[0]], : int(dim)]

    def parts(self, parts, n_slices, stride, n_rows, width):
        total = np.zeros((n_rows, width), np.float32)
        for s in range(int(n_slices)):
            total += parts[s * int(stride):].reshape(-1)[: n_rows * width].reshape(n_rows, width)
        return total

    def run_batch_rmsnorm(self, grid, args):
        x, parts, n_slices, stride, w, dim, eps, out, ldo = args
        n = grid[0]
        x[:n] += self.parts(parts, n_slices, stride, n, int(dim))
        out.reshape(-1, int(ldo))[:n, : int(dim)] = batch_k.rmsnorm_reference(x[:n], np.asarray(w), float(eps))

    run_batch_rmsnorm_wide = run_batch_rmsnorm

    def run_batch_gemv(self, grid, args):
        w_ptr, _, rows, kpad, _, h, ldh, per_slice, _, parts = args
        name = self.world["weights"][int(w_ptr)]
        weight = batch_k.weight_reference(self.world["tinf"].tensor(name)).astype(np.float64)
        padded = batch_k.ROW_CHUNK * int(self.name.split(",")[1].rstrip(">"))
        cols = int(per_slice) * batch_k.PIECE_COLS[self.world["tinf"].info(name).encoding]
        hh = np.asarray(h).reshape(-1, int(ldh))[:padded, : int(kpad)].astype(np.float64)
        for s in range(grid[1]):                     # each slice its own partial sums, as the kernel
            part = hh[:, s * cols: (s + 1) * cols] @ weight[:, s * cols: (s + 1) * cols].T
            parts.reshape(-1)[s * padded * int(rows): (s + 1) * padded * int(rows)] = part.reshape(-1)

    def run_batch_rope_store(self, grid, args):
        (parts, n_slices, stride, bias, positions, slots, n_heads, n_kv, hd, cos, sin, _, q_out, k_cache,
         v_cache, slot_stride) = args
        n, n_heads, n_kv, hd = grid[0], int(n_heads), int(n_kv), int(hd)
        qkv = self.parts(parts, n_slices, stride, n, (n_heads + 2 * n_kv) * hd)
        pos, slot = np.asarray(positions)[:n], np.asarray(slots)[:n]
        q, k, v = batch_k.rope_store_reference(qkv, pos, n_heads, n_kv, hd, cos, sin,
                                               None if isinstance(bias, np.uint64) else np.asarray(bias))
        q_out[:n] = q.reshape(n, -1)
        for r in range(n):
            at = int(slot[r]) * int(slot_stride) + int(pos[r]) * n_kv * hd
            k_cache.reshape(-1)[at: at + n_kv * hd] = k[r].reshape(-1)
            v_cache.reshape(-1)[at: at + n_kv * hd] = v[r].reshape(-1)

    def run_batch_attention(self, grid, args):
        q, k_cache, v_cache, slot_stride, positions, slots, n_heads, _, hd, window, _, out, ldo = args
        n, n_heads, hd = grid[1], int(n_heads), int(hd)
        shape = (-1, int(slot_stride) // (grid[0] * hd), grid[0], hd)
        got = batch_k.attention_reference(np.asarray(q)[:n].reshape(n, n_heads, hd), k_cache.reshape(shape),
                                          v_cache.reshape(shape), np.asarray(positions)[:n],
                                          np.asarray(slots)[:n], int(window) or None)
        out.reshape(-1, int(ldo))[:n, : n_heads * hd] = got

    run_batch_attention_wide = run_batch_attention
    run_batch_attention_mma64_4 = run_batch_attention_mma64_8 = run_batch_attention
    run_batch_attention_mma128_4 = run_batch_attention_mma128_8 = run_batch_attention

    def run_batch_swiglu(self, grid, args):
        parts, n_slices, stride, n_rows, ffn, out, ldo = args
        gate_up = self.parts(parts, n_slices, stride, int(n_rows), 2 * int(ffn))
        out.reshape(-1, int(ldo))[: int(n_rows), : int(ffn)] = batch_k.swiglu_reference(gate_up)

    def run_batch_logits(self, grid, args):
        parts, n_slices, stride, vocab, logits, best = args
        n = grid[0]
        logits[:n] = self.parts(parts, n_slices, stride, n, int(vocab))
        best[:n] = np.argmax(logits[:n], axis=-1)

    def run_batch_sample(self, grid, args):
        """sample() per row on the arguments as sampling.cu's header lays them out; plain greedy rows
        take best (checked to be the argmax)."""
        from tinyinfer.kernels import sampling as sample_k
        from tinyinfer.runtime.sampling import sample

        logits, vocab, best, params, uniforms, positions, slots, history, max_context, _, tokens = args
        vocab, max_context = int(vocab), int(max_context)
        table = np.asarray(params).reshape(-1, sample_k.P_COUNT)
        history = np.asarray(history).reshape(-1, max_context)
        for b in range(grid[0]):
            row = table[b]
            chosen = SamplingParams(temperature=row[sample_k.P_TEMPERATURE], top_k=int(row[sample_k.P_TOP_K]),
                                    top_p=row[sample_k.P_TOP_P], min_p=row[sample_k.P_MIN_P],
                                    repetition_penalty=row[sample_k.P_PENALTY])
            pos, slot = int(positions[b]), int(slots[b])
            x = np.asarray(logits).reshape(-1, vocab)[b]
            if chosen.greedy and chosen.repetition_penalty == 1.0:
                assert best[b] == np.argmax(x)
                tokens[b] = best[b]
            else:
                tokens[b] = sample(x, chosen, history[slot, : pos + 1], float(uniforms[b]))
            if pos + 1 < max_context:
                history[slot, pos + 1] = tokens[b]


def emulated_engine(tmp_path, monkeypatch, **kwargs):
    """(engine, tinf): the engine over a random 2-layer q4 model with every kernel replaced by its
    NumPy reference (EmulatedKernel), prefill by its NumPy steps over the slot's cache."""
    import ctypes

    from tinyinfer.formats import open_tinf
    from tinyinfer.runtime import cuda_batch, cuda_prefill
    from tinyinfer.runtime import reference as ref
    from tinyinfer.runtime.bench import tinf_config

    config = tinf_config({"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
                          "intermediate_size": 384, "vocab_size": 512, "num_hidden_layers": 2,
                          "max_position_embeddings": 64})
    tinf = open_tinf(write_random_model(tmp_path / "m.tinf", config, "q4", seed=3))
    world = {"capturing": None, "tinf": tinf, "weights": {}}
    views, registry = {}, {}

    def view(self, name):
        if name not in views:
            tensor = tinf.tensor(name)
            if len(tensor.shape) == 1 or tensor.encoding != "q4":
                raw = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(-1)
            else:
                raw = np.zeros(tinf.info(name).nbytes, np.uint8)      # the emulated GEMV reads the tensor itself
            views[name] = raw.copy().view(HostArray)
            registry[views[name].ctypes.data] = views[name]
            world["weights"][views[name].ctypes.data] = name
        return views[name]

    class Stream(FakeStream):
        def synchronize(self):
            pass

        def begin_capture(self):
            world["capturing"] = []

        def end_capture(self):
            calls, world["capturing"] = world["capturing"], None

            class Graph:
                def upload(self, stream):
                    pass

                def launch(self, stream):
                    for kernel, grid, args in calls:
                        getattr(kernel, "run_" + kernel.name.split("<")[0])(grid, args)
            return Graph()

    class Runtime(FakeCupy.cuda.runtime):
        @staticmethod
        def memcpyAsync(dst, src, nbytes, kind, stream):
            ctypes.memmove(dst, src, nbytes)

    class Cupy(FakeCupy):
        class cuda(FakeCupy.cuda):
            runtime = Runtime

    monkeypatch.setattr(HostArray, "get", lambda self, stream=None: np.array(self), raising=False)
    cos, sin = ref.rope_tables(config["head_dim"], 64, 10000.0, None)
    backend = type("Backend", (), {
        "cp": Cupy, "tinf": tinf, "config": tinf.config, "max_context": 64, "n_sms": 4, "pdl": False,
        "compute_capability": 90, "stream": Stream(), "rope_cos": cos, "rope_sin": sin, "view": view,
        "f32_view": lambda self, name: view(self, name).view(np.float32).view(HostArray),
        "capture": CudaBackend.capture,
    })()
    module = type("Module", (), {"get_function": lambda self, name: EmulatedKernel(name, world)})()
    monkeypatch.setattr(cuda_batch.batch_k, "compile_batch", lambda cc: module)
    monkeypatch.setattr(cuda_batch.sample_k, "compile_sampler", lambda cc: module)
    ops = type("Ops", (), {"mod": module})()
    monkeypatch.setattr(cuda_batch.cuda_prefill, "CudaOps", lambda b, chunk: ops)
    monkeypatch.setattr(cuda_batch, "pinned_empty", lambda n, dtype: np.zeros(n, dtype))
    engine = cuda_batch.BatchEngine(backend, slots=3, max_context=64, prefill_chunk=8, **kwargs)

    def prefill_span(slot, ids, start):              # prefill's NumPy steps over the slot's cache
        engine.spans.append((slot, start, start + ids.size))
        ops = cuda_prefill.NumpyOps(tinf, 64)
        ops.k_cache, ops.v_cache = engine.k_cache[:, slot], engine.v_cache[:, slot]
        cuda_prefill.run_prefill(ops, tinf.config, ids, start, 8, None)

    engine.prefill_span, engine.spans = prefill_span, []
    return engine, tinf


def run_prompts(engine, prompts, budgets, params=None, seeds=None, max_steps: int = 60):
    """Submit as slots free up, step until done: (generated tokens, logits rows) per prompt."""
    owner, queue = {}, list(range(len(prompts)))
    generated, rows = {i: [] for i in queue}, {i: [] for i in queue}
    for _ in range(max_steps):
        while queue and engine.free_slots():
            i = queue.pop(0)
            kwargs = {} if params is None else {"params": params[i], "seed": seeds[i]}
            owner[engine.submit(prompts[i], max_new_tokens=budgets[i], **kwargs)] = i
        if not engine.has_work():
            break
        for slot, event in engine.step().items():
            i = owner[slot]
            generated[i].append(event.token)
            rows[i].append(engine.last_logits[slot])
            if event.finish_reason:
                del owner[slot]
    return generated, rows


@pytest.mark.parametrize("step_prefill", [256, 4])
def test_the_engine_step_computes_each_sequences_logits(tmp_path, monkeypatch, step_prefill):
    """The engine with every kernel replaced by its NumPy reference, fed the launches' own arguments:
    the step's wiring (buffers, leading dimensions, slices, slots and positions of rows, prompt rows
    beside decoding ones, the padding rows, graphs replayed for later steps, GEMM prefill into a slot
    where more than step_prefill positions are left) gives each sequence the logits of the NumPy
    reference run on that sequence alone, for sequences joining and leaving at different steps."""
    from tinyinfer.runtime.numpy_backend import NumpyBackend

    engine, tinf = emulated_engine(tmp_path, monkeypatch, keep_logits=True, step_prefill=step_prefill)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 512, n) for n in (5, 1, 12, 3)]
    budgets = [6, 4, 3, 5]
    generated, rows = run_prompts(engine, prompts, budgets)
    assert [len(generated[i]) for i in range(4)] == budgets
    assert {n for n, _ in engine.graphs} >= {1, 2, 4}, "later steps replay captured graphs"
    assert (8, True) in engine.graphs or (4, True) in engine.graphs, "no step had prompt rows"
    assert bool(engine.spans) == (step_prefill < 11), "the 12-token prompt went through GEMM prefill"
    reference = NumpyBackend(tinf, max_context=64)
    for i, prompt in enumerate(prompts):
        ids = np.concatenate([prompt, np.asarray(generated[i][:-1], dtype=np.int64)])
        expected = reference.forward(ids, 0)[prompt.size - 1:]
        ours = np.stack(rows[i])
        errors = np.linalg.norm(ours - expected, axis=-1) / np.linalg.norm(expected, axis=-1)
        assert errors.max() <= 2e-3, f"prompt {i}: relative error {errors.max():.2e}"
        assert generated[i] == list(ours.argmax(-1))


def test_the_engine_samples_each_row_with_its_parameters_draw_and_history(tmp_path, monkeypatch):
    """batch_sample emulated by sample() on the launch's own arguments (row r's parameters and u, its
    slot's history up to its position, appending its token): every token of every sequence is
    sample(its logits row, its params, prompt + tokens so far, the seed's next draw), with slots reused,
    so the wiring of parameters, draws, the prompt's history written at submit and the appended tokens
    holds. A penalty below 1 (which raises the history's positive logits) moves greedy tokens off the
    argmax, so the history is read."""
    from tinyinfer.runtime.sampling import sample

    engine, _ = emulated_engine(tmp_path, monkeypatch, keep_logits=True)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, 512, n) for n in (6, 1, 9, 4, 3)]
    budgets = [7, 5, 4, 8, 6]
    params = [SamplingParams(repetition_penalty=0.02), SamplingParams(temperature=0.9, top_k=20),
              SamplingParams(temperature=1.1, top_p=0.7, min_p=0.05, repetition_penalty=1.4), SamplingParams(),
              SamplingParams(temperature=0.6, repetition_penalty=0.8)]
    seeds = [40 + i for i in range(len(prompts))]
    generated, rows = run_prompts(engine, prompts, budgets, params, seeds)
    assert [len(generated[i]) for i in range(len(prompts))] == budgets
    moved = 0
    for i, prompt in enumerate(prompts):
        draws = np.random.default_rng(seeds[i]).random(budgets[i])
        for k, (token, logits) in enumerate(zip(generated[i], rows[i])):
            history = np.concatenate([prompt, np.asarray(generated[i][:k], dtype=np.int64)])
            assert token == sample(logits, params[i], history, draws[k]), f"prompt {i} token {k}"
            moved += i == 0 and token != int(np.argmax(logits))
    assert moved, "the penalty never changed a greedy token: the test does not see the history"
