"""`tinyrun serve` end to end on the CPU: uvicorn on 127.0.0.1 in a thread, the official openai client
as the real client, a tiny random model; every server is stopped by its fixture."""

from __future__ import annotations

import contextlib
import gc
import json
import random
import re
import socket
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

from serve_helpers import (DEADLINE_S, finished_requests, get, metrics, post, running_server,  # noqa: E402
                           streamed, wait_for_health, wait_until_idle)
from tinf_samples import RUNNABLE_CONFIG  # noqa: E402

from tinyinfer.runtime import load  # noqa: E402
from tinyinfer.runtime.bench import write_random_model  # noqa: E402
from tinyinfer.runtime.chat import render_chat  # noqa: E402
from tinyinfer.runtime.engine import Generation, SerialEngine  # noqa: E402
from tinyinfer.runtime.server import create_app  # noqa: E402

CONTEXT = 96
# The generation prompt opens the assistant's turn as the next request's history writes it, so a
# conversation's next request starts with everything the previous one had in the cache.
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant{% endif %}")
FINISH = {"eos": "stop", "stop_string": "stop", "max_tokens": "length"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve") / "tiny.tinf"
    return write_random_model(path, dict(RUNNABLE_CONFIG, max_context=CONTEXT), quant="q4", group=32, seed=3,
                              chat_template=TEMPLATE)


@pytest.fixture(scope="module")
def reference(model_path):
    """The library's own answers, from a second copy of the model in this process."""
    with load(model_path, device="cpu") as model:
        yield model


@contextlib.contextmanager
def serving(model_path, loader=None):
    engine = SerialEngine(loader or (lambda: load(model_path, device="cpu")))
    with running_server(create_app(engine, ("tiny", str(model_path)))) as url:
        assert engine.ready.wait(30) and engine.load_error is None
        yield url, engine


@pytest.fixture(scope="module")
def server(model_path):
    with serving(model_path) as (url, engine):
        yield url, engine


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)


def expected(reference, prompt, **options) -> tuple[str, str, dict]:
    """(text, finish_reason, stats) as Model.generate gives them."""
    text = "".join(reference.generate(prompt, **options))
    stats = dict(reference.last_stats)
    return text, FINISH[stats["stop_reason"]], stats


PROMPTS = ["w3 w4 w5", "w10", "w7 w8 w9 w10 w11 w12", "w40 w41", "w20 w21 w22 w23", "w5 w50", "w60 w61 w62", "w33"]


# ------------------------------------------------------------------------------------ completions

def test_completion_is_what_the_library_generates(client, reference):
    for prompt, n in [("w3 w4 w5", 12), ("w60", 30)]:
        text, finish, stats = expected(reference, prompt, max_tokens=n, temperature=0)
        out = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0)
        assert out.choices[0].text == text and out.choices[0].finish_reason == finish
        assert out.usage.prompt_tokens == len(reference.prompt_ids(prompt)) == stats["prompt_tokens"]
        assert out.usage.completion_tokens == stats["new_tokens"]
        assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
        stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True,
                                           stream_options={"include_usage": True})
        s_text, s_finish, s_usage = streamed(stream)
        assert (s_text, s_finish) == (text, finish)
        assert s_usage.completion_tokens == stats["new_tokens"]


def test_chat_is_what_the_library_generates(client, reference):
    messages = [{"role": "system", "content": "w9 w10"}, {"role": "user", "content": "w3 w4"}]
    text, finish, stats = expected(reference, messages, chat=True, max_tokens=16, temperature=0)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == text and out.choices[0].finish_reason == finish
    assert out.usage.prompt_tokens == len(reference.prompt_ids(messages, chat=True))
    s_text, s_finish, _ = streamed(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                                                  temperature=0, stream=True))
    assert (s_text, s_finish) == (text, finish)
    # max_completion_tokens is the newer name of max_tokens.
    out = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=16, temperature=0)
    assert out.choices[0].message.content == text
    # Content given as text parts is the same conversation.
    parts = [{**m, "content": [{"type": "text", "text": w + " "} for w in m["content"].split()]} for m in messages]
    parts = [{**m, "content": m["content"][:-1] + [{"type": "text", "text": m["content"][-1]["text"].strip()}]}
             for m in parts]
    out = client.chat.completions.create(model="tiny", messages=parts, max_tokens=16, temperature=0)
    assert out.choices[0].message.content == text


def test_stream_ends_with_done(server):
    url, _ = server
    request = urllib.request.Request(url + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"prompt": "w3", "max_tokens": 4, "stream": True}).encode())
    with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_strings_end_the_text(client, reference):
    full, _, _ = expected(reference, "w3 w4 w5", max_tokens=20, temperature=0)
    words = full.split()
    assert len(words) >= 6, "the greedy continuation ended too early to test stop strings"
    stop = f" {words[4]}"
    cut = full[: full.index(stop)]
    for stops in (stop, ["w0-never", stop]):
        out = client.completions.create(model="tiny", prompt="w3 w4 w5", max_tokens=20, temperature=0, stop=stops)
        assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
        s_text, s_finish, _ = streamed(client.completions.create(model="tiny", prompt="w3 w4 w5", max_tokens=20, temperature=0,
                                                                 stop=stops, stream=True))
        assert (s_text, s_finish) == (cut, "stop")


def test_seed_gives_the_library_sample(client, reference):
    for seed in (1, 2):
        text, _, _ = expected(reference, "w3 w4", max_tokens=16, temperature=1.0, top_p=0.9, seed=seed)
        for _ in range(2):
            out = client.completions.create(model="tiny", prompt="w3 w4", max_tokens=16, temperature=1.0, top_p=0.9, seed=seed)
            assert out.choices[0].text == text


def test_models_health_and_llama_cpp_extras(server, client, reference):
    url, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert get(url + "/health") == (200, '{"status":"ok"}')
    text = "w3 w4 w63"
    status, body = post(url + "/tokenize", json.dumps({"content": text, "add_special": True}).encode())
    assert (status, body["tokens"]) == (200, reference.tokenizer.encode(text, add_bos=True))
    status, body = post(url + "/tokenize", json.dumps({"content": text, "with_pieces": True}).encode())
    ids = reference.tokenizer.encode(text, add_bos=False)
    assert [t["id"] for t in body["tokens"]] == ids
    assert [t["piece"] for t in body["tokens"]] == [reference.tokenizer.decode([i]) for i in ids]
    status, body = post(url + "/detokenize", json.dumps({"tokens": ids}).encode())
    assert (status, body["content"]) == (200, reference.tokenizer.decode(ids))
    status, body = post(url + "/detokenize", json.dumps({"tokens": [RUNNABLE_CONFIG["vocab_size"]]}).encode())
    assert status == 400 and body["error"]["param"] == "tokens"
    messages = [{"role": "user", "content": "w3"}]
    status, body = post(url + "/apply-template", json.dumps({"messages": messages}).encode())
    assert (status, body["prompt"]) == (200, render_chat(TEMPLATE, messages, reference.tokenizer.special_tokens))


# ----------------------------------------------------------------------------------------- errors

def one_sentence(message: str) -> bool:
    return message[:1].isupper() and message.endswith(".") and "Traceback" not in message and "\n" not in message


def test_bad_parameters_are_400_with_openai_errors(client):
    cases = [
        (dict(prompt="w3", temperature=-0.5), "temperature", None),
        (dict(prompt="w3", max_tokens=10**12), "max_tokens", "context_length_exceeded"),
        (dict(prompt="w3", max_tokens=-1), "max_tokens", None),
        (dict(prompt="w3", n=2), "n", None),
        (dict(prompt="w3", top_p=0), "top_p", None),
        (dict(prompt="w3", seed=-1), "seed", None),
        (dict(prompt="w3", stop=[""]), "stop", None),
        (dict(prompt="w3", stop=5), "stop", None),
        (dict(prompt="w3", stop=["w4"] * 17), "stop", None),
        (dict(prompt=" ".join(["w3"] * CONTEXT)), "prompt", "context_length_exceeded"),
        (dict(prompt=[RUNNABLE_CONFIG["vocab_size"]]), "prompt", None),
        (dict(prompt="w3", logprobs=2), None, None),
    ]
    for kwargs, param, code in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(**{"model": "tiny", "max_tokens": 4, **kwargs})
        error = info.value.body
        assert info.value.status_code == 400 and error["type"] == "invalid_request_error", kwargs
        assert one_sentence(error["message"]) and error["param"] == param, (kwargs, error)
        if code:
            assert error["code"] == code
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": " ".join(["w3"] * CONTEXT)}])
    assert info.value.body["code"] == "context_length_exceeded" and info.value.body["param"] == "messages"
    for content, param in [([{"type": "image_url", "image_url": {"url": "x"}}], "messages[0].content"),
                           (7, "messages[0].content")]:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}])
        assert info.value.body["param"] == param and one_sentence(info.value.body["message"])
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=[])
    assert info.value.body["param"] == "messages"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="other", prompt="w3", max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and one_sentence(info.value.body["message"])
    assert client.completions.create(model="tiny", prompt="w3", max_tokens=2).choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body", [b'{"prompt": "w3", ', b'{"prompt": "\xff\xfe w3"}', b"\xff" * 10,
                                  b'{"prompt": "w3", "max_tokens": 1000000000000}',
                                  b'{"prompt": "w3", "temperature": -1}', b'{"prompt": "w3", "temperature": NaN}',
                                  b'{"prompt": "w3", "max_tokens": 2.0}', b'{"prompt": "w3", "max_tokens": "2"}',
                                  b"[1, 2]", b"null"])
def test_malformed_bodies_are_400_and_the_server_keeps_serving(server, client, body):
    url, _ = server
    status, error = post(url + "/v1/completions", body)
    assert status == 400 and one_sentence(error["error"]["message"]), error
    status, error = post(url + "/v1/chat/completions", body)
    assert status == 400 and one_sentence(error["error"]["message"]), error
    assert client.completions.create(model="tiny", prompt="w3", max_tokens=2).usage.prompt_tokens == 2


def test_form_body_is_told_to_send_json(server):
    status, error = post(server[0] + "/v1/completions", b"prompt=w3", "application/x-www-form-urlencoded")
    assert status == 400 and "application/json" in error["error"]["message"]


def test_503_while_loading(model_path):
    release = threading.Event()

    def slow_load():
        assert release.wait(DEADLINE_S)
        return load(model_path, device="cpu")

    engine = SerialEngine(slow_load)
    with running_server(create_app(engine, ("tiny",))) as url:
        try:
            status, body = get(url + "/health")
            assert status == 503 and json.loads(body)["error"]["type"] == "unavailable_error"
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
            with pytest.raises(openai.APIStatusError) as info:
                client.completions.create(model="tiny", prompt="w3", max_tokens=2)
            assert info.value.status_code == 503 and one_sentence(info.value.body["message"])
        finally:
            release.set()
        assert engine.ready.wait(DEADLINE_S) and engine.load_error is None
        assert get(url + "/health")[0] == 200
        assert client.completions.create(model="tiny", prompt="w3", max_tokens=2).usage.prompt_tokens == 2


# ------------------------------------------------------------------------------------ concurrency

def ask(client, prompt, n, stream):
    if stream:
        text, finish, _ = streamed(client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True))
        return text, finish
    choice = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0).choices[0]
    return choice.text, choice.finish_reason


def test_eight_concurrent_greedy_clients_get_what_they_get_alone(client):
    jobs = [(prompt, 8 + 3 * i, i % 2 == 0) for i, prompt in enumerate(PROMPTS)]
    alone = [ask(client, *job) for job in jobs]
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda job: ask(client, *job), jobs, timeout=DEADLINE_S))
    assert together == alone


def test_next_request_reuses_the_conversation_cache(server, client, reference):
    url, _ = server
    first = [{"role": "user", "content": "w3 w4 w5"}]
    reply = client.chat.completions.create(model="tiny", messages=first, max_tokens=6, temperature=0).choices[0].message.content
    second = first + [{"role": "assistant", "content": reply.strip()}, {"role": "user", "content": "w9"}]
    before = metrics(url)["tinyinfer_prompt_tokens_reused_total"]
    out = client.chat.completions.create(model="tiny", messages=second, max_tokens=6, temperature=0)
    reused = metrics(url)["tinyinfer_prompt_tokens_reused_total"] - before
    assert reused >= len(reference.prompt_ids(first, chat=True))
    assert out.usage.prompt_tokens_details.cached_tokens == reused
    reference.cached_ids = []    # the library's answer from an empty cache
    assert out.choices[0].message.content == expected(reference, second, chat=True, max_tokens=6, temperature=0)[0]


def slowed_loader(model_path, delay_s):
    def loader():
        model = load(model_path, device="cpu")
        forward = model.backend.forward

        def slow_forward(ids, start):
            if len(ids) == 1:
                time.sleep(delay_s)
            return forward(ids, start)

        model.backend.forward = slow_forward
        return model
    return loader


def test_disconnect_cancels_at_once_and_the_engine_stays_consistent(model_path, reference):
    n = CONTEXT - 8
    with serving(model_path, slowed_loader(model_path, 0.02)) as (url, engine):
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        stream = client.completions.create(model="tiny", prompt="w3 w4", max_tokens=n, temperature=0, stream=True)
        for i, _ in enumerate(stream):
            if i == 2:
                break
        stream.close()
        closed = time.monotonic()
        m = wait_until_idle(url)
        assert time.monotonic() - closed < 1.0
        assert m['tinyinfer_requests_total{outcome="cancelled"}'] == 1
        assert m["tinyinfer_completion_tokens_total"] < n / 2
        # A non-streamed request whose client gives up is cancelled too.
        impatient = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=0.3)
        with pytest.raises(openai.APITimeoutError):
            impatient.completions.create(model="tiny", prompt="w5", max_tokens=n, temperature=0)
        m = wait_until_idle(url)
        assert m['tinyinfer_requests_total{outcome="cancelled"}'] == 2
        assert m["tinyinfer_completion_tokens_total"] < n
        text, finish, _ = expected(reference, "w3 w4", max_tokens=10, temperature=0)
        out = client.completions.create(model="tiny", prompt="w3 w4", max_tokens=10, temperature=0)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (text, finish)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024


def test_soak_with_disconnects(server, client, reference):
    """200 requests from 32 clients, mixed lengths, a quarter leaving mid-stream: every other request
    gets the library's answer, none is lost or hangs, the engine returns to idle, memory stays flat."""
    url, engine = server
    rng = random.Random(5)
    jobs = [(rng.choice(PROMPTS), rng.randint(1, 24), rng.random() < 0.5, i % 4 == 0) for i in range(200)]
    answers = {(p, n): expected(reference, p, max_tokens=n, temperature=0)[:2] for p, n, _, _ in jobs}

    def run(job):
        prompt, n, stream, leave = job
        if leave:
            stream = client.completions.create(model="tiny", prompt=prompt, max_tokens=n, temperature=0, stream=True)
            next(iter(stream))
            stream.close()
            return None
        return ask(client, prompt, n, stream)

    before = wait_until_idle(url)
    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, jobs[:100], timeout=DEADLINE_S))
        rss_half = rss_bytes()
        results += list(pool.map(run, jobs[100:], timeout=DEADLINE_S))
    after = wait_until_idle(url)
    # Measured before the gc scan below, whose isinstance() calls wake up lazily imported modules.
    rss_growth = rss_bytes() - rss_half
    for (prompt, n, _, leave), result in zip(jobs, results):
        if not leave:
            assert result == answers[prompt, n], (prompt, n)
    assert finished_requests(after) - finished_requests(before) == 200
    assert after['tinyinfer_requests_total{outcome="error"}'] == before['tinyinfer_requests_total{outcome="error"}']
    assert rss_growth < 8 << 20, f"RSS grew by {rss_growth >> 20} MiB over the second 100 requests"
    gc.collect()
    assert not [o for o in gc.get_objects() if type(o) is Generation]


# -------------------------------------------------------------------------------------------- CLI

def test_tinyrun_serve_without_the_extra_names_it(model_path, monkeypatch, capsys):
    import sys

    from tinyinfer.runtime.cli import main

    monkeypatch.setitem(sys.modules, "fastapi", None)
    monkeypatch.delitem(sys.modules, "tinyinfer.runtime.server")
    with pytest.raises(SystemExit) as info:
        main(["serve", str(model_path)])
    assert info.value.code == 1
    assert 'pip install -e ".[serve]"' in capsys.readouterr().err


def test_tinyrun_serve_on_a_taken_port_is_one_line(model_path, capsys):
    from tinyinfer.runtime.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit) as info:
            main(["serve", str(model_path), "--port", str(taken.getsockname()[1]), "--device", "cpu"])
    err = capsys.readouterr().err
    assert info.value.code == 1 and err.startswith("error: Cannot listen") and err.count("\n") == 1


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_tinyrun_serve_answers_then_stops_on_interrupt(model_path, reference):
    import signal
    import subprocess

    from console_scripts import script

    port = free_port()
    process = subprocess.Popen([script("tinyrun"), "serve", str(model_path), "--port", str(port), "--device", "cpu",
                                "--ctx-size", "64"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for_health(process, url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        assert [m.id for m in client.models.list().data] == [model_path.stem]
        text, finish, _ = expected(reference, "w3 w4", max_tokens=8, temperature=0)
        out = client.completions.create(model=str(model_path), prompt="w3 w4", max_tokens=8, temperature=0)
        assert (out.choices[0].text, out.choices[0].finish_reason) == (text, finish)
        with pytest.raises(openai.BadRequestError) as info:     # --ctx-size 64 is the context now
            client.completions.create(model=model_path.stem, prompt="w3", max_tokens=64)
        assert "context of 64 tokens" in info.value.body["message"]
        process.send_signal(signal.SIGINT)      # Ctrl-C: a clean shutdown, and tinyrun's exit code for it
        assert process.wait(30) == 130
        assert "Application shutdown complete" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)
        process.stdout.close()


def test_engine_close_cancels_the_running_and_the_waiting(model_path):
    """The engine's own contract (runtime/README.md): events then one Finished; close() ends a
    running and a queued generation at their next token, and later submits are refused."""
    import asyncio

    from tinyinfer.runtime.engine import Chunk, Finished, GenerationRequest
    from tinyinfer.runtime.sampling import SamplingParams

    engine = SerialEngine(slowed_loader(model_path, 0.02))
    engine.start()
    assert engine.ready.wait(DEADLINE_S) and engine.load_error is None
    request = GenerationRequest((1, 3, 4), CONTEXT - 8, SamplingParams())

    async def scenario():
        running, waiting = engine.submit(request), engine.submit(request)
        first = await asyncio.wait_for(running.__anext__(), DEADLINE_S)
        assert isinstance(first, Chunk) and engine.stats().queue_depth == 1 and engine.stats().running == 1
        started = time.monotonic()
        await asyncio.to_thread(engine.close)
        assert time.monotonic() - started < 1.0
        ends = []
        for generation in (running, waiting):
            events = [e async for e in generation]
            assert all(isinstance(e, Chunk) for e in events[:-1]) and isinstance(events[-1], Finished)
            ends.append(events[-1])
        assert [e.finish_reason for e in ends] == [None, None] and ends[1].completion_tokens == 0
        assert 0 < ends[0].completion_tokens < CONTEXT // 2
        with pytest.raises(RuntimeError):
            engine.submit(request)

    asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
    stats = engine.stats()
    assert stats.requests["cancelled"] == 2 and stats.running == 0 and stats.queue_depth == 0


def test_events_of_a_step_arrive_together_and_queued_chunks_join():
    """The handoff from the engine's thread: events pushed inside delivered_together() reach the loop
    in one wake-up when the block ends (none before); a reader that lags gets the Chunks queued
    together as one, in order, with Finished, an exception and the end kept apart."""
    import asyncio

    from tinyinfer.runtime.engine import Chunk, Finished, GenerationRequest, delivered_together
    from tinyinfer.runtime.sampling import SamplingParams

    request = GenerationRequest((1,), 4, SamplingParams())

    async def scenario():
        loop = asyncio.get_running_loop()
        wakeups = []
        original = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakeups.append(a), original(*a))[1]
        a, b = Generation(request, loop), Generation(request, loop)

        def engine_step():
            with delivered_together():
                for text in ("x", "y", "z"):
                    a.push(Chunk(text))
                    b.push(Chunk(text.upper()))
                assert not wakeups, "an event left before the step's end"
                a.end(Finished("length", 1, 3, 0))
            b.push(ValueError("the detokenizer failed"))
            b.push(Chunk("after"))

        await asyncio.to_thread(engine_step)
        handoffs = [args for args in wakeups if args[0].__name__ == "_arrive_all"]   # (to_thread's own too)
        assert [len(args[1]) for args in handoffs] == [8, 1, 1]   # the step's events, then b's two, one each
        await asyncio.sleep(0)
        assert [e async for e in a] == [Chunk("xyz"), Finished("length", 1, 3, 0)]
        assert await b.__anext__() == Chunk("XYZ")
        with pytest.raises(ValueError):
            await b.__anext__()
        assert await b.__anext__() == Chunk("after")

    asyncio.run(asyncio.wait_for(scenario(), DEADLINE_S))
