"""`tinyrun serve --parallel N` without a GPU: BatchedEngine (runtime/batch_serving.py) over
cuda_batch.BatchEngine's own scheduling with its device work done on the CPU (CpuBatch: each slot
its own NumPy backend and KV cache), through the real HTTP server and the official openai client.
Every answer is compared with the library's own (Model.generate on a second copy of the model)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from serve_helpers import DEADLINE_S, running_server, streamed, wait_for_health, wait_until_idle  # noqa: E402
from tinf_samples import RUNNABLE_CONFIG  # noqa: E402

from tinyinfer.runtime import load  # noqa: E402
from tinyinfer.runtime.batch_serving import (MAX_PARALLEL, BatchedEngine, Unbatchable,  # noqa: E402
                                             serving_engine)
from tinyinfer.runtime.bench import write_random_model  # noqa: E402
from tinyinfer.runtime.cuda_batch import MAX_SLOTS, BatchEngine  # noqa: E402
from tinyinfer.runtime.engine import Chunk, Finished, Generation, GenerationRequest, SerialEngine  # noqa: E402
from tinyinfer.runtime.errors import DeviceError  # noqa: E402
from tinyinfer.runtime.numpy_backend import NumpyBackend  # noqa: E402
from tinyinfer.runtime.sampling import SamplingParams, sample  # noqa: E402
from tinyinfer.runtime.server import create_app  # noqa: E402

CONTEXT = 96
FINISH = {"eos": "stop", "stop_string": "stop", "max_tokens": "length"}
PROMPTS = ["w3 w4 w5", "w10", "w7 w8 w9 w10 w11 w12 w13 w14 w15 w16 w17", "w40 w41", "w20 w21 w22 w23", "w5 w50"]


class CpuBatch(BatchEngine):
    """BatchEngine's scheduling (submit, chunked prefill, step, cancel) with the device work on the
    CPU: each slot's GEMM prefill spans and step rows (prompt positions, tokens) go through that slot's
    own NumpyBackend, and each sampling row's token is runtime.sampling.sample of its logits with one
    rng.random() of its own per token (what the device's sampler computes). Records what the engine was
    asked to do (rows: the sampling rows of each step); step_s slows each
    step, fail_at makes one step raise, wrap(backend) alters each slot's backend."""

    def __init__(self, model, slots, step_s=0.0, fail_at=None, max_context=None, wrap=None):
        self.n_slots, self.prefill_chunk, self.step_prefill = slots or 3, 8, 4
        self.vocab, self.max_context = model.config["vocab_size"], max_context or model.max_context
        self.keep_logits, self.last_logits = False, {}
        self.sequences, self.waiting, self.step_times = {}, [], []
        self.caches = [NumpyBackend(model.tinf, max_context=model.max_context) for _ in range(self.n_slots)]
        for cache in self.caches:
            (wrap or (lambda backend: None))(cache)
        self.step_s, self.fail_at = step_s, fail_at
        self.submitted, self.cancelled, self.rows, self.closed = [], [], [], False

    def submit(self, prompt_ids, params=SamplingParams(), max_new_tokens=256, seed=None, stop_ids=()):
        slot = super().submit(prompt_ids, params, max_new_tokens, seed, stop_ids)
        self.submitted.append((tuple(prompt_ids), slot))
        return slot

    def cancel(self, slot):
        if slot in self.sequences:
            self.cancelled.append(slot)
        super().cancel(slot)

    def write_history(self, slot, prompt):
        pass                       # decode reads each sequence's history from the host

    def prefill_span(self, slot, ids, start):
        self.caches[slot].forward(ids, start)

    def stage_sampling(self, rows):
        self.draws = [row.seq.rng.random() if row.samples else None for row in rows]

    def decode(self, rows, want_logits):
        time.sleep(self.step_s)
        self.rows.append(sum(row.samples for row in rows))
        if len(self.rows) == self.fail_at:
            raise RuntimeError("the device fell over")
        logits = np.stack([self.caches[r.slot].forward([r.token], r.position)[-1] for r in rows])
        tokens = [sample(x, r.seq.params, [*r.seq.prompt, *r.seq.generated], u) if r.samples else 0
                  for x, r, u in zip(logits, rows, self.draws)]
        return np.array(tokens), logits

    def close(self):
        self.closed = True


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("batch-serve") / "tiny.tinf"
    return write_random_model(path, dict(RUNNABLE_CONFIG, max_context=CONTEXT), quant="q4", group=32, seed=3)


@pytest.fixture(scope="module")
def reference(model_path):
    with load(model_path, device="cpu") as model:
        yield model


def expected(reference, prompt, **options) -> tuple[str, str, dict]:
    """(text, finish_reason, stats) as Model.generate gives them, from an empty cache."""
    reference.cached_ids = []
    text = "".join(reference.generate(prompt, **options))
    stats = dict(reference.last_stats)
    return text, FINISH[stats["stop_reason"]], stats


def batched_engine(model_path, slots=3, notes=None, alone=False, load_model=None, **fake):
    """A BatchedEngine over a CpuBatch (engine.batch once it is ready); alone False: every request
    decodes in a slot, as these tests of the batch's scheduling expect."""
    return BatchedEngine(load_model or (lambda: load(model_path, device="cpu")), slots,
                         make_batch=lambda model, n: CpuBatch(model, n, **fake),
                         notice=(notes if notes is not None else []).append, alone=alone)


@contextlib.contextmanager
def serving(model_path, slots=3, alone=False, load_model=None, **fake):
    engine = batched_engine(model_path, slots, alone=alone, load_model=load_model, **fake)
    with running_server(create_app(engine, ("tiny",))) as url:
        assert engine.ready.wait(DEADLINE_S) and engine.load_error is None, engine.load_error
        assert isinstance(engine.batch, CpuBatch) and engine.parallel == engine.batch.n_slots
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        yield url, engine, client


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def ask(client, prompt, stream=False, **options):
    """(text, finish_reason, usage) of one completion."""
    options = {"model": "tiny", "prompt": prompt, **options}
    if stream:
        return streamed(client.completions.create(stream=True, stream_options={"include_usage": True}, **options))
    out = client.completions.create(**options)
    return out.choices[0].text, out.choices[0].finish_reason, out.usage


# --------------------------------------------------------------------------------------- through HTTP

def test_concurrent_requests_get_the_library_answer(model_path, reference):
    """Six requests at once over three slots, streamed and not, greedy and seeded sampling: each text,
    finish_reason and usage is what Model.generate gives alone; several decoded in one step; the
    stats count every token."""
    jobs = [(p, dict(max_tokens=5 + 4 * i, temperature=0) if i % 3 else
             dict(max_tokens=12, temperature=1.0, top_p=0.9, seed=i), i % 2 == 0) for i, p in enumerate(PROMPTS)]
    answers = [expected(reference, p, **options) for p, options, _ in jobs]
    with serving(model_path, slots=3, step_s=0.005) as (url, engine, client):
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = list(pool.map(lambda job: ask(client, job[0], job[2], **job[1]), jobs, timeout=DEADLINE_S))
        m = wait_until_idle(url)
        assert max(engine.batch.rows) > 1, "the requests were never decoded together"
    for (text, finish, stats), (got, got_finish, usage) in zip(answers, results):
        assert (got, got_finish) == (text, finish)
        assert (usage.prompt_tokens, usage.completion_tokens) == (stats["prompt_tokens"], stats["new_tokens"])
        assert usage.prompt_tokens_details.cached_tokens == 0
    assert m["tinyinfer_completion_tokens_total"] == sum(s["new_tokens"] for _, _, s in answers)
    assert m["tinyinfer_prompt_tokens_total"] == sum(s["prompt_tokens"] for _, _, s in answers)
    assert sum(v for k, v in m.items() if k.startswith("tinyinfer_requests_total")) == len(jobs)
    assert m["tinyinfer_generation_seconds_total"] > 0 and m["tinyinfer_tokens_per_second"] > 0
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Generation]


def test_requests_beyond_the_slots_wait_their_turn(model_path, reference):
    """Five requests sent one after another into two slots: three wait (queue_depth), all finish,
    and they enter the slots in the order they arrived."""
    prompts = PROMPTS[:5]
    answers = [expected(reference, p, max_tokens=16, temperature=0)[:2] for p in prompts]

    def arrived(engine) -> int:
        s = engine.stats()
        return s.queue_depth + s.running + sum(s.requests.values())

    with serving(model_path, slots=2, step_s=0.01) as (url, engine, client):
        with ThreadPoolExecutor(len(prompts)) as pool:
            futures = []
            for i, prompt in enumerate(prompts):
                futures.append(pool.submit(ask, client, prompt, i % 2 == 1, max_tokens=16, temperature=0))
                wait_for(lambda: arrived(engine) == i + 1, "the request to reach the engine")
            depth = engine.stats().queue_depth
            results = [f.result(timeout=DEADLINE_S)[:2] for f in futures]
        m = wait_until_idle(url)
    assert depth == 3, "the requests did not queue behind the two slots"
    assert results == answers
    assert [p for p, _ in engine.batch.submitted] == [tuple(reference.prompt_ids(p)) for p in prompts]
    assert m['tinyinfer_requests_total{outcome="length"}'] + m['tinyinfer_requests_total{outcome="stop"}'] == 5


def test_a_disconnect_frees_its_slot_for_the_next_request(model_path, reference):
    """One slot: a long stream is dropped mid-way; the request waiting behind it gets the slot at
    once and the library's answer, long before the dropped one's budget would have run out."""
    n = CONTEXT - 8
    text, finish, stats = expected(reference, "w5", max_tokens=6, temperature=0)
    with serving(model_path, slots=1, step_s=0.02) as (url, engine, client):
        stream = client.completions.create(model="tiny", prompt="w3 w4", max_tokens=n, temperature=0, stream=True)
        chunks = iter(stream)
        next(chunks), next(chunks)
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(ask, client, "w5", max_tokens=6, temperature=0)
            wait_for(lambda: engine.stats().queue_depth == 1, "the second request to queue")
            assert engine.stats().running == 1
            stream.close()
            assert waiting.result(timeout=DEADLINE_S)[:2] == (text, finish)
        m = wait_until_idle(url)
    assert engine.batch.cancelled == [0] and [s for _, s in engine.batch.submitted] == [0, 0]
    assert m['tinyinfer_requests_total{outcome="cancelled"}'] == 1
    dropped_tokens = m["tinyinfer_completion_tokens_total"] - stats["new_tokens"]
    assert 2 <= dropped_tokens < n / 2


def test_stop_strings_end_the_text_and_free_the_slot(model_path, reference):
    full, _, _ = expected(reference, "w3 w4 w5", max_tokens=24, temperature=0)
    words = full.split()
    assert len(words) >= 8, "the greedy continuation ended too early to test stop strings"
    stop = f" {words[5]}"
    text, finish, stats = expected(reference, "w3 w4 w5", max_tokens=24, temperature=0, stop=[stop])
    assert finish == "stop" and text == full[: full.index(stop)]
    with serving(model_path, slots=2) as (url, engine, client):
        for stops, stream in ((stop, False), (["w0-never", stop], True)):
            got, got_finish, usage = ask(client, "w3 w4 w5", stream, max_tokens=24, temperature=0, stop=stops)
            assert (got, got_finish, usage.completion_tokens) == (text, "stop", stats["new_tokens"])
        wait_until_idle(url)
        assert len(engine.batch.cancelled) == 2, "a stop string did not free its slot at once"


def test_max_tokens_ends_with_length_and_eos_with_stop(model_path, reference):
    """The token budget ends a request with "length" (0 tokens asked: none generated); an
    end-of-sequence id ends it with "stop", counted as a token and not shown, as Model.generate does.
    Either way the text held back for a possible stop string (its last character) comes out."""
    text, finish, stats = expected(reference, "w7 w8", max_tokens=7, temperature=0)
    assert finish == "length"
    held = [text[-1] + "-never"]
    assert expected(reference, "w7 w8", max_tokens=7, temperature=0, stop=held)[:2] == (text, finish)
    eos = min(reference.tokenizer.eos_ids)

    def eos_at(position):
        """The backend's logits at that position all but demand the end-of-sequence id."""
        def wrap(backend):
            forward = backend.forward

            def forced(ids, start):
                logits = forward(ids, start)
                if 0 <= position - start < len(logits):
                    logits[position - start, eos] = logits.max() + 100
                return logits
            backend.forward = forced
        return wrap

    prompt_len = len(reference.prompt_ids("w7 w8"))
    with load(model_path, device="cpu") as ending:
        eos_at(prompt_len + 3)(ending.backend)
        eos_text, eos_finish, eos_stats = expected(ending, "w7 w8", max_tokens=20, temperature=0)
    assert eos_finish == "stop" and eos_stats["new_tokens"] == 5
    eos_held = [eos_text[-1] + "-never"]
    with serving(model_path, slots=2, wrap=eos_at(prompt_len + 3)) as (url, engine, client):
        got, got_finish, usage = ask(client, "w7 w8", max_tokens=20, temperature=0, stream=True, stop=eos_held)
        assert (got, got_finish, usage.completion_tokens) == (eos_text, "stop", 5)
        assert ask(client, "w7 w8", max_tokens=20, temperature=0)[:2] == (eos_text, "stop")
    with serving(model_path, slots=2) as (url, engine, client):
        got, got_finish, usage = ask(client, "w7 w8", max_tokens=7, temperature=0, stream=True, stop=held)
        assert (got, got_finish, usage.completion_tokens) == (text, "length", 7)
        got, got_finish, usage = ask(client, "w7 w8", max_tokens=0)
        assert (got, got_finish, usage.completion_tokens) == ("", "length", 0)
        assert len(engine.batch.submitted) == 1        # nothing to decode: no slot taken


def test_a_failing_step_ends_its_requests_with_an_error_and_serving_goes_on(model_path, reference):
    text, finish, _ = expected(reference, "w3 w4", max_tokens=6, temperature=0)
    with serving(model_path, slots=2, fail_at=3) as (url, engine, client):
        with pytest.raises(openai.InternalServerError) as info:
            ask(client, "w3 w4", max_tokens=20, temperature=0)
        message = info.value.body["message"]
        assert "the device fell over" in message and message.endswith(".") and "\n" not in message
        assert ask(client, "w3 w4", max_tokens=6, temperature=0, stream=True)[:2] == (text, finish)
        m = wait_until_idle(url)
    assert m['tinyinfer_requests_total{outcome="error"}'] == 1 and engine.batch.cancelled == [0]


def test_a_shorter_batch_context_is_the_servers_context(model_path, reference):
    text, finish, stats = expected(reference, "w3", max_tokens=38, temperature=0)
    notes = []
    engine = batched_engine(model_path, 2, notes, max_context=40)
    with running_server(create_app(engine, ("tiny",))) as url:
        assert engine.ready.wait(DEADLINE_S) and engine.load_error is None
        assert engine.model.max_context == 40 and len(notes) == 1 and "40" in notes[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        with pytest.raises(openai.BadRequestError) as info:
            ask(client, "w3", max_tokens=40)
        assert info.value.body["code"] == "context_length_exceeded"
        got, got_finish, usage = ask(client, "w3", max_tokens=38, temperature=0)
        assert (got, got_finish, usage.completion_tokens) == (text, finish, stats["new_tokens"])


def slowed_model(model_path, delay_s: float):
    """A loader of the model whose every forward (the batch-1 path's steps) takes delay_s longer."""
    def load_slowed():
        model = load(model_path, device="cpu")
        forward = model.backend.forward
        model.backend.forward = lambda ids, start: (time.sleep(delay_s), forward(ids, start))[1]
        return model
    return load_slowed


def recorded(stream, chunks: list):
    for chunk in stream:
        chunks.append(chunk)
        yield chunk


def test_a_lone_request_moves_into_a_slot_when_another_comes_and_back_when_alone(model_path, reference):
    """A (seeded sampling, 40 tokens) decodes alone on the batch-1 path (nothing submitted to the batch);
    B arrives once A has streamed a few chunks: A moves into a slot with its prompt and tokens so far,
    B joins it, and when B is done A, the last one left, leaves its slot and decodes alone again. Both
    texts, finish_reasons and usages are Model.generate's alone: A's seed draws once per token across
    the moves and its text held back nothing wrongly at either."""
    a_options, b_options = dict(max_tokens=40, temperature=1.0, seed=7), dict(max_tokens=6, temperature=0)
    a_answer, b_answer = expected(reference, PROMPTS[0], **a_options), expected(reference, PROMPTS[3], **b_options)
    a_prompt = tuple(reference.prompt_ids(PROMPTS[0]))
    chunks = []
    with serving(model_path, slots=2, alone=True, step_s=0.005, load_model=slowed_model(model_path, 0.01)) as (
            url, engine, client):
        with ThreadPoolExecutor(2) as pool:
            a = pool.submit(lambda: streamed(recorded(client.completions.create(
                model="tiny", prompt=PROMPTS[0], stream=True, stream_options={"include_usage": True},
                **a_options), chunks)))
            wait_for(lambda: len(chunks) >= 4, "A's first chunks")
            assert engine.batch.submitted == [], "the lone request went through the batch"
            b = pool.submit(ask, client, PROMPTS[3], False, **b_options)
            results = [a.result(timeout=DEADLINE_S), b.result(timeout=DEADLINE_S)]
        m = wait_until_idle(url)
    (moved, a_slot), (b_ids, _) = engine.batch.submitted
    assert moved[: len(a_prompt)] == a_prompt and len(moved) > len(a_prompt) + 2, "A did not move with its tokens"
    assert b_ids == tuple(reference.prompt_ids(PROMPTS[3]))
    assert a_slot in engine.batch.cancelled, "A did not leave its slot when it was alone again"
    for (text, finish, stats), (got, got_finish, usage) in zip([a_answer, b_answer], results):
        assert (got, got_finish) == (text, finish)
        assert (usage.prompt_tokens, usage.completion_tokens) == (stats["prompt_tokens"], stats["new_tokens"])
    assert m["tinyinfer_completion_tokens_total"] == a_answer[2]["new_tokens"] + b_answer[2]["new_tokens"]


# ------------------------------------------------------------------------------------ the engine itself

def test_close_while_busy_ends_every_request_within_the_timeout(model_path):
    engine = batched_engine(model_path, 2, step_s=0.02)
    engine.start()
    assert engine.ready.wait(DEADLINE_S) and engine.load_error is None
    request = GenerationRequest((1, 3, 4), CONTEXT - 8, SamplingParams())

    async def scenario():
        generations = [engine.submit(request) for _ in range(3)]
        first = await asyncio.wait_for(generations[0].__anext__(), DEADLINE_S)
        assert isinstance(first, Chunk)
        await asyncio.to_thread(wait_for, lambda: engine.stats().running == 2, "both slots in use")
        assert engine.stats().queue_depth == 1
        started = time.monotonic()
        await asyncio.to_thread(engine.close, 5.0)
        assert time.monotonic() - started < 1.0
        ends = [[e async for e in g][-1] for g in generations]
        assert all(isinstance(e, Finished) and e.finish_reason is None for e in ends)
        assert 0 < ends[0].completion_tokens < CONTEXT // 2 and ends[2].completion_tokens == 0
        with pytest.raises(RuntimeError):
            engine.submit(request)

    asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    assert not engine._thread.is_alive() and engine.batch.closed
    stats = engine.stats()
    assert stats.requests["cancelled"] == 3 and stats.running == 0 and stats.queue_depth == 0


def test_where_batching_does_not_apply_one_request_at_a_time(model_path, reference):
    """The CPU backend (the real cuda_batch_engine) or a model the kernels refuse: SerialEngine's
    serving, a note only when --parallel was asked for; a default slot count that does not fit
    falls back with a note, an asked-for one is the load error."""
    def started(engine):
        engine.start()
        assert engine.ready.wait(DEADLINE_S)
        return engine

    loader = lambda: load(model_path, device="cpu")    # noqa: E731
    for slots, expect_note in ((None, False), (4, True)):
        notes = []
        engine = started(BatchedEngine(loader, slots, notice=notes.append))
        try:
            assert engine.load_error is None and engine.batch is None and engine.parallel == 1
            assert len(notes) == int(expect_note)
            if expect_note:
                assert "--parallel 4" in notes[0] and "CUDA" in notes[0] and "\n" not in notes[0]
        finally:
            engine.close()

    def refuse(model, slots):
        raise Unbatchable("this model's linears are f32.")

    notes = []
    engine = BatchedEngine(loader, 2, make_batch=refuse, notice=notes.append)
    text, finish, _ = expected(reference, "w3 w4", max_tokens=6, temperature=0)
    with running_server(create_app(engine, ("tiny",))) as url:
        assert engine.ready.wait(DEADLINE_S) and engine.load_error is None and engine.parallel == 1
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        assert ask(client, "w3 w4", max_tokens=6, temperature=0)[:2] == (text, finish)
    assert len(notes) == 1 and "f32" in notes[0]

    def no_room(model, slots):
        raise DeviceError(f"{slots or 32} sequences do not fit on this GPU; use fewer parallel sequences.")

    for slots in (None, 8):
        notes = []
        engine = started(BatchedEngine(loader, slots, make_batch=no_room, notice=notes.append))
        try:
            if slots is None:
                assert engine.load_error is None and engine.loaded and engine.parallel == 1 and len(notes) == 1
            else:
                assert isinstance(engine.load_error, DeviceError) and not engine.loaded and not notes
                assert "8 sequences" in str(engine.load_error)
        finally:
            engine.close()


def test_serving_engine_choice():
    notes = []
    loader = lambda: None    # noqa: E731   never started
    assert type(serving_engine(loader, "auto", 1, notes.append)) is SerialEngine
    assert type(serving_engine(loader, "cpu", None, notes.append)) is SerialEngine and not notes
    assert type(serving_engine(loader, "cpu", 4, notes.append)) is SerialEngine
    assert len(notes) == 1 and "--parallel 4" in notes[0]
    for device in ("auto", "cuda"):
        engine = serving_engine(loader, device, None, notes.append)
        assert type(engine) is BatchedEngine and engine.requested_slots is None
    assert serving_engine(loader, "cuda", 6, notes.append).requested_slots == 6
    assert MAX_PARALLEL == MAX_SLOTS


@pytest.mark.parametrize("value", ["0", "33", "-2"])
def test_parallel_out_of_range_is_one_line(model_path, capsys, value):
    from tinyinfer.runtime.cli import main

    with pytest.raises(SystemExit) as info:
        main(["serve", str(model_path), "--parallel", value, "--device", "cpu"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.count("\n") == 1
    assert err.startswith(f"error: --parallel {value} is out of range") and "1 to 32" in err


def test_parallel_on_the_cpu_serves_with_a_note(model_path, reference):
    """`tinyrun serve --device cpu -np 3` in a subprocess: the note on stderr, then the library's answer."""
    import signal
    import socket
    import subprocess

    from console_scripts import script

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([script("tinyrun"), "serve", str(model_path), "--port", str(port), "--device", "cpu",
                                "-np", "3"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(process.stdout), daemon=True)
    reader.start()
    try:
        url = f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        wait_for_health(process, url)
        wait_for(lambda: any("serving the OpenAI API" in line for line in lines), "the server's ready line")
        text, finish, _ = expected(reference, "w3 w4", max_tokens=8, temperature=0)
        assert ask(client, "w3 w4", max_tokens=8, temperature=0)[:2] == (text, finish)
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(30)
        finally:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        reader.join(10)
        process.stdout.close()
    notes = [line for line in lines if line.startswith("note:")]
    assert len(notes) == 1 and "--parallel 3" in notes[0]
    assert any("one request at a time" in line for line in lines if "serving the OpenAI API" in line)
