"""`tinyrun serve` on the CUDA backend: the engine's thread owns the graphs and streams, concurrent
greedy clients get the library's answer, and a stream dropped while decode steps are queued ahead
(LOOKAHEAD) leaves the cache consistent for the next request. (The CPU path: test_server.py.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")

from serve_helpers import DEADLINE_S, running_server, streamed, wait_until_idle  # noqa: E402

from tinyinfer.runtime import load  # noqa: E402
from tinyinfer.runtime.bench import tinf_config, write_random_model  # noqa: E402
from tinyinfer.runtime.engine import SerialEngine  # noqa: E402
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
