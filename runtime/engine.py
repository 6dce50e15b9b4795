"""The serving engine: generation requests queued and served one at a time by a worker thread that
owns the Model, with the events of each request handed to an asyncio caller.

The interface (runtime/README.md, "The serving engine") is what the HTTP server uses, so another
engine (batch_serving.BatchedEngine: several sequences on one GPU) stands behind it unchanged:
    engine.start()                      load the model on the worker thread (engine.ready says when)
    engine.submit(GenerationRequest)    -> Generation: async iterator of Chunk, then one Finished
                                           (a Chunk joins the texts queued together: a reader that
                                           lags gets fewer, longer chunks, not a growing backlog)
    generation.cancel()                 takes effect at the request's next token (or before it starts)
    engine.stats()                      -> EngineStats, for /metrics
    engine.close()                      cancel everything, stop the worker, free the model
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from tinyinfer.runtime.sampling import SamplingParams

# Model.last_stats["stop_reason"] -> OpenAI's finish_reason (None: the client went away).
FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_tokens": "length", "cancelled": None}
OUTCOMES = ("stop", "length", "cancelled", "error")


@dataclass(frozen=True)
class GenerationRequest:
    """One sequence to generate, already encoded and checked against the model's context."""

    prompt_ids: tuple[int, ...]
    max_tokens: int
    params: SamplingParams
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class Chunk:
    """New text of a generation (stop strings never appear in it)."""

    text: str


@dataclass(frozen=True)
class Finished:
    """The last event of a generation. finish_reason is "stop", "length", or None when cancelled."""

    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    reused_tokens: int


@dataclass
class EngineStats:
    """Totals since start, and the engine's state now."""

    requests: dict = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))   # finished, by outcome
    prompt_tokens: int = 0
    reused_prompt_tokens: int = 0      # prompt tokens whose K/V came from the cache (a shared prefix)
    completion_tokens: int = 0
    generation_seconds: float = 0.0    # time spent generating, for tokens/s
    queue_depth: int = 0               # requests waiting for the engine
    running: int = 0                   # sequences being generated now

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.generation_seconds if self.generation_seconds > 0 else 0.0

    def record(self, outcome, seconds: float = 0.0) -> None:
        """Count a request's outcome (its Finished event, or the exception that ended it)."""
        if isinstance(outcome, Finished):
            self.requests[outcome.finish_reason or "cancelled"] += 1
            self.prompt_tokens += outcome.prompt_tokens
            self.reused_prompt_tokens += outcome.reused_tokens
            self.completion_tokens += outcome.completion_tokens
        else:
            self.requests["error"] += 1
        self.generation_seconds += seconds

    def snapshot(self) -> "EngineStats":
        return EngineStats(**{**self.__dict__, "requests": dict(self.requests)})


_END = object()   # sentinel after the Finished event (or an exception) in a Generation's queue
_together = threading.local()   # the events held by delivered_together(), on the engine's thread


class Generation:
    """The caller's handle on one request: `async for event in generation`, and cancel().

    Events are produced on the engine's thread and handed to the caller's event loop, so the engine
    never waits for a slow reader."""

    def __init__(self, request: GenerationRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.cancelled = threading.Event()
        self._loop = loop
        self._events: deque = deque()          # the caller's loop only
        self._arrived = asyncio.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def push(self, event) -> None:
        """From the engine's thread: queue an event (Chunk, Finished, an exception, or _END)."""
        held = getattr(_together, "events", None)
        if held is not None:
            held.append((self, event))
        else:
            deliver([(self, event)])

    def end(self, outcome) -> None:
        """From the engine's thread: the last event (Finished, or the exception that ended it)."""
        self.push(outcome)
        self.push(_END)

    def _arrive(self, event) -> None:
        self._events.append(event)
        self._arrived.set()

    def __aiter__(self):
        return self

    async def __anext__(self):
        while not self._events:
            self._arrived.clear()
            await self._arrived.wait()
        event = self._events[0]
        if event is _END:                      # stays ended
            raise StopAsyncIteration
        self._events.popleft()
        if isinstance(event, BaseException):
            raise event
        if isinstance(event, Chunk) and self._events and isinstance(self._events[0], Chunk):
            texts = [event.text]
            while self._events and isinstance(self._events[0], Chunk):
                texts.append(self._events.popleft().text)
            event = Chunk("".join(texts))
        return event


def _arrive_all(events) -> None:
    for generation, event in events:
        generation._arrive(event)


def deliver(events) -> None:
    """From the engine's thread: (generation, event) pairs to their callers' loops, one wake-up per loop."""
    by_loop: dict = {}
    for generation, event in events:
        by_loop.setdefault(generation._loop, []).append((generation, event))
    for loop, batch in by_loop.items():
        try:
            loop.call_soon_threadsafe(_arrive_all, batch)
        except RuntimeError:   # the caller's loop is closed: nobody is left to read
            for generation, _ in batch:
                generation.cancel()


@contextlib.contextmanager
def delivered_together():
    """On the engine's thread: the events pushed inside reach their callers when the block ends, all
    at once (a batched step's tokens: one wake-up of the server's loop per step, not per token)."""
    _together.events = []
    try:
        yield
    finally:
        events, _together.events = _together.events, None
        deliver(events)


class SerialEngine:
    """Serves one request at a time, in arrival order, with the model's KV-cache prefix reuse
    across requests (Model.reusable_prefix): a request that shares a prefix with the previous
    sequence prefills only the rest."""

    parallel = 1     # sequences generated at once (for the server's log line)

    def __init__(self, load_model: Callable[[], object]):
        self._load_model = load_model
        self.model = None
        self.load_error: BaseException | None = None
        self.ready = threading.Event()        # set once the model is loaded (or failed to load)
        self._waiting: deque[Generation] = deque()
        self._wakeup = threading.Condition()
        self._closing = False
        self._current: Generation | None = None   # the request being generated
        self._stats = EngineStats()
        self._stats_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="tinyinfer-engine", daemon=True)

    @property
    def loaded(self) -> bool:
        return self.model is not None

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Generation:
        """Queue a request; call from a coroutine (its events go to the running event loop)."""
        generation = Generation(request, asyncio.get_running_loop())
        with self._wakeup:
            if self._closing or not self.loaded:
                raise RuntimeError("the engine is not serving (loading or closed)")
            self._waiting.append(generation)
            self._wakeup.notify()
        return generation

    def stats(self) -> EngineStats:
        with self._stats_lock:
            snapshot = self._stats.snapshot()
        with self._wakeup:
            snapshot.queue_depth = sum(not g.cancelled.is_set() for g in self._waiting)
        return snapshot

    def close(self, timeout: float = 30.0) -> None:
        with self._wakeup:
            self._closing = True
            for generation in [*self._waiting, self._current]:
                if generation is not None:
                    generation.cancel()
            self._wakeup.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------------- the worker thread

    def _run(self) -> None:
        try:
            self.model = self._load_model()
            self._prepare(self.model)
        except BaseException as e:   # reported by the server (health, the CLI's one line)
            self.load_error = e
            if self.model is not None:
                self.model.close()
                self.model = None
            self.ready.set()
            return
        self.ready.set()
        try:
            self._serve_requests()
        finally:
            with self._wakeup:       # whatever ended the loop, later submits are refused, not left waiting
                self._closing = True
            self._cancel_waiting()
            self.model.close()

    def _prepare(self, model) -> None:
        """Set up what serving needs beside the model, on this thread, before `ready` (subclasses)."""

    def _serve_requests(self) -> None:
        while (generation := self._next()) is not None:
            self._serve(generation)
            with self._wakeup:
                self._current = None
            del generation      # a finished request is not kept alive until the next one comes

    def _next(self) -> Generation | None:
        with self._wakeup:
            while not self._waiting and not self._closing:
                self._wakeup.wait()
            self._current = None if self._closing else self._waiting.popleft()
            return self._current

    def _cancel_waiting(self) -> None:
        with self._wakeup:
            waiting, self._waiting = list(self._waiting), deque()
        for generation in waiting:
            self._finish(generation, Finished(None, len(generation.request.prompt_ids), 0, 0), 0.0)

    def _serve(self, generation: Generation) -> None:
        request = generation.request
        if generation.cancelled.is_set():    # the client left while it waited
            return self._finish(generation, Finished(None, len(request.prompt_ids), 0, 0), 0.0)
        with self._stats_lock:
            self._stats.running = 1
        started = time.perf_counter()
        try:
            chunks = self.model.generate_from_ids(request.prompt_ids, request.params, request.max_tokens,
                                                  seed=request.seed, stop=list(request.stop),
                                                  cancelled=generation.cancelled.is_set)
            for text in chunks:
                generation.push(Chunk(text))
        except Exception as e:      # a bad request the server's checks missed, or a backend failure
            self._finish(generation, e, time.perf_counter() - started)
            return
        stats = self.model.last_stats
        finished = Finished(FINISH_REASONS[stats["stop_reason"]], stats["prompt_tokens"], stats["new_tokens"],
                            stats["reused_tokens"])
        self._finish(generation, finished, time.perf_counter() - started)

    def _finish(self, generation: Generation, outcome, seconds: float) -> None:
        with self._stats_lock:
            self._stats.running = 0
            self._stats.record(outcome, seconds)
        generation.end(outcome)
