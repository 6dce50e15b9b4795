"""Helpers of the server tests (CPU and GPU): uvicorn in a thread on 127.0.0.1, raw HTTP, /metrics."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request

DEADLINE_S = 60


@contextlib.contextmanager
def running_server(app):
    """uvicorn serving app on a free 127.0.0.1 port in a thread; always stopped."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    assert not thread.is_alive(), "the server did not stop"


def post(url: str, data: bytes, content_type="application/json") -> tuple[int, dict]:
    request = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=DEADLINE_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=DEADLINE_S) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def metrics(url: str) -> dict[str, float]:
    status, text = get(url + "/metrics")
    assert status == 200
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def streamed(stream) -> tuple[str, str | None, object]:
    """(text, finish_reason, usage) from a stream of completion or chat chunks."""
    texts, finish, usage = [], None, None
    for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            texts.append((delta.content if delta else choice.text) or "")
            finish = choice.finish_reason or finish
    return "".join(texts), finish, usage


def wait_until_idle(url: str) -> dict[str, float]:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        m = metrics(url)
        if m["tinyinfer_queue_depth"] == 0 and m["tinyinfer_sequences_running"] == 0:
            return m
        assert time.monotonic() < deadline, f"the engine did not return to idle: {m}"
        time.sleep(0.02)


def wait_for_health(process, url: str) -> None:
    """Poll a `tinyrun serve` subprocess's /health until it answers 200, within DEADLINE_S."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert process.poll() is None and time.monotonic() < deadline, "tinyrun serve did not come up"
        with contextlib.suppress(OSError):
            if get(url + "/health")[0] == 200:
                return
        time.sleep(0.05)


def finished_requests(m: dict) -> float:
    return sum(v for k, v in m.items() if k.startswith("tinyinfer_requests_total"))
