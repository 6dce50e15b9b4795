"""`tinyrun serve` on the CUDA backend: the engine's thread owns the graphs and streams, concurrent
greedy clients get the library's answer, a stream dropped while decode steps are queued ahead
(LOOKAHEAD) leaves the cache consistent for the next request, and `--parallel 4` (batched decoding)
gives each prompt the serial engine's text. (The CPU path: test_server.py, test_batch_serving.py.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from serve_helpers import DEADLINE_S, running_server, streamed, wait_until_idle  # noqa: E402

from tinyinfer.kernels import prefill as prefill_k  # noqa: E402
from tinyinfer.runtime import load  # noqa: E402
from tinyinfer.runtime.batch_serving import BatchedEngine, serving_engine  # noqa: E402
from tinyinfer.runtime.bench import tinf_config, write_random_model  # noqa: E402
from tinyinfer.runtime.engine import SerialEngine  # noqa: E402
from tinyinfer.runtime.numpy_backend import NumpyBackend  # noqa: E402
from tinyinfer.runtime.sampling import SamplingParams  # noqa: E402
from tinyinfer.runtime.server import create_app  # noqa: E402

pytestmark = pytest.mark.gpu

# TinyLlama-1.1B's shapes (examples/bench_random.py) with two layers.
TINYLLAMA = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
             "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0}
PROMPTS = ["w523 w9077 w42", "w3001 w15", "w77 w78 w79 w80 w81", "w12000"]
FINISH = {"eos": "stop", "stop_string": "stop", "max_tokens": "length"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory, cupy_gpu):
    config = tinf_config(TINYLLAMA, n_layers=2)
    config["max_context"] = 512
    return write_random_model(tmp_path_factory.mktemp("serve-gpu") / "m.tinf", config, "q4", 32, seed=7)


@pytest.fixture(scope="module")
def served(model_path):
    engine = SerialEngine(lambda: load(model_path, device="cuda"))
    with running_server(create_app(engine, ("m",))) as url:
        assert engine.ready.wait(300) and engine.load_error is None, engine.load_error
        assert type(engine.model.backend).__name__ == "CudaBackend"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        yield url, client


@pytest.fixture(scope="module")
def reference(model_path):
    with load(model_path, device="cuda") as model:
        yield model


def answer(reference, prompt, n):
    text = "".join(reference.generate(prompt, max_tokens=n, temperature=0))
    return text, FINISH[reference.last_stats["stop_reason"]]


def ask(client, prompt, n, stream):
    if stream:
        text, finish, _ = streamed(client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0,
                                                             stream=True))
        return text, finish
    choice = client.completions.create(model="m", prompt=prompt, max_tokens=n, temperature=0).choices[0]
    return choice.text, choice.finish_reason


def test_concurrent_greedy_clients_get_the_library_answer(served, reference):
    _, client = served
    jobs = [(prompt, 40 + 17 * i, i % 2 == 0) for i, prompt in enumerate(PROMPTS)]
    expected = [answer(reference, prompt, n) for prompt, n, _ in jobs]
    with ThreadPoolExecutor(len(jobs)) as pool:
        together = list(pool.map(lambda job: ask(client, *job), jobs, timeout=DEADLINE_S))
    assert together == expected


def test_dropped_stream_leaves_the_cache_consistent(served, reference):
    url, client = served
    for _ in range(3):
        stream = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=400, temperature=0, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        wait_until_idle(url)
        # The next request shares the dropped one's prefix, so it runs on the cache that stream left.
        follow = PROMPTS[0] + " w5 w6"
        assert ask(client, follow, 20, stream=False) == answer(reference, follow, 20)



def batched_alone(model, ids: list[int], n: int) -> list[int]:
    """A prompt's greedy tokens through the batched kernels in a batch of its own."""
    from tinyinfer.runtime.cuda_batch import BatchEngine, generate_batch_ids

    engine = BatchEngine(model.backend, slots=1)
    try:
        return generate_batch_ids(engine, [ids], [SamplingParams()], [n], [None], model.tokenizer.eos_ids)[0]
    finally:
        engine.close()


def serial_tokens(model, ids: list[int], n: int) -> list[int]:
    """A prompt's greedy tokens through the batch-1 backend, as Model.generate takes them (to an
    end-of-sequence id included)."""
    model.cached_ids = []                      # the backend's cache is overwritten below
    tokens = []
    for token in model.backend.generate_ids(ids, 0, SamplingParams(), n, np.random.default_rng(0)):
        tokens.append(token)
        if token in model.tokenizer.eos_ids:
            break
    model.cached_ids = []
    return tokens


def as_served(model, ids: list[int], tokens: list[int]) -> tuple[str, str]:
    """(text, finish_reason) the server makes of a greedy request's tokens (no stop strings)."""
    ended = bool(tokens) and tokens[-1] in model.tokenizer.eos_ids
    detok = model.tokenizer.stream(prefix_ids=ids)
    return "".join(detok.step(t) for t in tokens[: len(tokens) - ended]) + detok.flush(), "stop" if ended else "length"


def test_parallel_4_gives_each_prompt_the_serial_text(model_path, served, reference):
    """The engine of `tinyrun serve --parallel 4` with every request in a slot (alone=False; the
    default's lone requests are the next test's): six concurrent greedy requests, streamed and not,
    two of them waiting for a slot. Each gets exactly the text of its prompt decoded by the batched
    kernels alone (a row's logits do not depend on the other rows of a step of 8 or fewer), and that
    is the serial engine's text, or both follow their logits' argmax until a near tie (the batched
    and the batch-1 GEMV round differently; prefill_k.NEAR_TIE, as test_batch_gpu.py's bound)."""
    _, serial = served
    prompts = PROMPTS + ["w9 w10 w11 w12 w13 w14 w15 w16", "w31000 w2"]
    jobs = [(prompt, 24 + 9 * i, i % 2 == 1) for i, prompt in enumerate(prompts)]
    alone = [ask(serial, *job) for job in jobs]
    engine = BatchedEngine(lambda: load(model_path, device="cuda"), 4, alone=False)
    with running_server(create_app(engine, ("m",))) as url:
        assert engine.ready.wait(300) and engine.load_error is None, engine.load_error
        assert engine.parallel == 4
        busy, step = [], engine.batch.step

        def counted_step():               # the slots in use at each step (on the engine's thread)
            busy.append(len(engine.batch.active_slots()))
            return step()

        engine.batch.step = counted_step
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        with ThreadPoolExecutor(len(jobs)) as pool:
            together = list(pool.map(lambda job: ask(client, *job), jobs, timeout=DEADLINE_S))
        wait_until_idle(url)
    print(f"slots in use per step: up to {max(busy)}, {len(busy)} steps")
    assert max(busy) > 1, "the requests were never decoded together"
    numpy_reference = NumpyBackend(reference.tinf, max_context=reference.max_context)
    for (prompt, n, _), got, serial_answer in zip(jobs, together, alone):
        ids = reference.prompt_ids(prompt)
        batched, single = batched_alone(reference, ids, n), serial_tokens(reference, ids, n)
        assert got == as_served(reference, ids, batched), prompt
        assert serial_answer == as_served(reference, ids, single), prompt
        k = next((k for k, (a, b) in enumerate(zip(batched, single)) if a != b), None)
        if k is None:
            assert got == serial_answer, prompt
            continue
        logits = numpy_reference.forward(np.asarray(ids + single[:k]), 0)[-1:]
        shortfall = [float(prefill_k.argmax_shortfall(logits, np.array([t]))[0]) for t in (batched[k], single[k])]
        print(f"{prompt!r}: the batched and serial tokens part at token {k}, {shortfall} rms below the best")
        assert max(shortfall) <= prefill_k.NEAR_TIE, f"{prompt!r}: token {k} differs beyond a near tie"


def test_a_lone_request_decodes_on_the_batch1_graph(model_path, served):
    """`tinyrun serve --parallel 4` as it starts: a greedy request with nothing beside it decodes on
    the batch-1 graph, so its text is the serial engine's exactly, and nothing reaches the batch.
    (Moves into and out of a slot: tests/test_batch_serving.py, on the CPU.)"""
    _, serial = served
    engine = serving_engine(lambda: load(model_path, device="cuda"), "cuda", 4)
    with running_server(create_app(engine, ("m",))) as url:
        assert engine.ready.wait(300) and engine.load_error is None, engine.load_error
        assert type(engine) is BatchedEngine and engine.alone and engine.parallel == 4
        submitted, submit = [], engine.batch.submit
        engine.batch.submit = lambda *args, **kw: submitted.append(args) or submit(*args, **kw)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=DEADLINE_S)
        for prompt, stream in ((PROMPTS[0], False), (PROMPTS[2], True)):
            assert ask(client, prompt, 40, stream) == ask(serial, prompt, 40, stream), prompt
        wait_until_idle(url)
    assert submitted == [], "a lone request went through the batch"
