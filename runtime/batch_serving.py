"""The serving engine of `tinyrun serve --parallel N`: requests decoded together on the GPU.

BatchedEngine offers SerialEngine's interface (engine.py; runtime/README.md, "The serving engine")
over a cuda_batch.BatchEngine owned by one thread, which loops:

    take the waiting requests into free slots (first come first; the rest wait)
    -> free the slots of cancelled requests -> step() -> each token to its request's stream

A request's text comes from its tokens as in Model._stream (model.TokenText), so a batched stream
reads as a serial one: the same Chunk / Finished events, stop strings held back and never emitted,
the same finish_reason and usage counts. Where the loaded model cannot decode in batches (the CPU
backend, a model the batched kernels refuse, a default slot count that does not fit), the engine
serves one request at a time, as SerialEngine, whose code it is.
"""

from __future__ import annotations

import logging
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tinyinfer.runtime.engine import FINISH_REASONS, Chunk, Finished, Generation, SerialEngine, delivered_together
from tinyinfer.runtime.errors import DeviceError
from tinyinfer.runtime.model import StopStrings, TokenText

# cuda_batch.MAX_SLOTS, named here so that the CLI checks --parallel without importing the kernels
# (tests/test_batch_serving.py holds the two equal).
MAX_PARALLEL = 32

log = logging.getLogger(__name__)


def stderr_note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr, flush=True)


def as_sentence(error: BaseException) -> str:
    text = str(error).strip()
    return text if text.endswith((".", "?", "!")) else text + "."


class Unbatchable(Exception):
    """The loaded model cannot decode in batches here; the message says why."""


def cuda_batch_engine(model, slots: int | None):
    """A BatchEngine over the model's GPU backend (slots None: as many as fit, up to MAX_PARALLEL).
    Unbatchable for the CPU backend or a model the batched kernels do not read; DeviceError from the
    engine when the slots do not fit the GPU's memory."""
    from tinyinfer.runtime import cuda_batch

    if not hasattr(model.backend, "stream"):
        raise Unbatchable("batched decoding needs the CUDA backend.")
    try:
        cuda_batch.check_model(model.tinf)
    except DeviceError as e:
        raise Unbatchable(str(e)) from None
    return cuda_batch.BatchEngine(model.backend, slots=slots)


def serving_engine(load_model: Callable[[], object], device: str, parallel: int | None,
                   notice: Callable[[str], None] = stderr_note) -> SerialEngine:
    """The engine for `tinyrun serve`: batched unless one sequence at a time is asked for or the
    device is the CPU (parallel None: batched where the model allows, slots sized by free memory)."""
    if parallel == 1:
        return SerialEngine(load_model)
    if device == "cpu":
        if parallel is not None:
            notice(f"--parallel {parallel} needs the CUDA backend, so this server answers one request at a time "
                   "on the CPU.")
        return SerialEngine(load_model)
    return BatchedEngine(load_model, parallel, notice=notice)


@dataclass
class Active:
    """A request in a slot (tokens and reused: counted before it came into the slot, if it decoded alone)."""

    generation: Generation
    text: TokenText
    tokens: int = 0
    reused: int = 0


@dataclass
class Alone:
    """A sequence to decode on the batch-1 graph: its ids so far, its budget left, its rng (one draw per
    token handed out), its text and what it counted before."""

    generation: Generation
    ids: list
    n_new: int
    rng: np.random.Generator
    text: TokenText
    tokens: int = 0
    reused: int = 0


class BatchedEngine(SerialEngine):
    """SerialEngine's interface over a BatchEngine: up to `slots` requests decode together.

    make_batch(model, slots) builds the batch on the engine's thread after the model loads (the
    default: cuda_batch_engine; tests pass one that decodes on the CPU). A request with nothing beside
    it decodes on the batch-1 graph (the single-stream rate, and the serial engine's prefix reuse);
    when another arrives it moves into a slot, and when it is the last one left it moves back: each
    move prefills its ids so far where it goes. In a slot there is no prefix reuse across requests."""

    def __init__(self, load_model: Callable[[], object], slots: int | None = None,
                 make_batch: Callable = cuda_batch_engine, notice: Callable[[str], None] = stderr_note,
                 alone: bool = True):
        super().__init__(load_model)
        self.requested_slots, self.alone = slots, alone   # alone False: every request decodes in a slot
        self._make_batch, self._notice = make_batch, notice
        self.batch = None                        # None: serving one request at a time
        self._active: dict[int, Active] = {}     # by slot; the engine's thread only

    @property
    def parallel(self) -> int:
        return self.batch.n_slots if self.batch is not None else 1

    # ------------------------------------------------------------------------- setup

    def _prepare(self, model) -> None:
        asked = self.requested_slots
        try:
            batch = self._make_batch(model, asked)
        except Unbatchable as e:
            if asked is not None:
                self._notice(f"--parallel {asked} does not apply, so this server answers one request at a time: "
                             f"{as_sentence(e)}")
            return
        except DeviceError as e:
            if asked is not None:     # the slots asked for do not fit: a load error naming the fix
                raise
            self._notice(f"batched decoding does not fit, so this server answers one request at a time: "
                         f"{as_sentence(e)}")
            return
        if batch.max_context < model.max_context:
            # The server checks each request against model.max_context: the batch's context, so that
            # every request it accepts fits a slot.
            self._notice(f"batched decoding holds {batch.max_context} positions per sequence, so the context "
                         f"is {batch.max_context} tokens.")
            model.max_context = batch.max_context
        self.batch = batch

    # ------------------------------------------------------------------------- the engine's thread

    def _serve_requests(self) -> None:
        if self.batch is None:
            return super()._serve_requests()
        try:
            while self._wait_for_work():
                self._drop_cancelled()
                alone = self._alone() if self.alone else None
                if alone is not None:
                    self._decode_alone(alone)
                    continue
                self._admit()
                if self._active:
                    self._step()
            for slot in list(self._active):       # closing: the running requests end as cancelled
                self._end(slot, None)
        except BaseException as e:                # a bug here must not leave a stream waiting
            for slot in list(self._active):
                self._end(slot, e)
            with self._wakeup:
                self._closing, waiting, self._waiting = True, list(self._waiting), deque()
            for generation in waiting:
                self._finish(generation, e)
            raise
        finally:
            self.batch.close()

    def _wait_for_work(self) -> bool:
        """Block while nothing runs or waits; False once the engine is closing."""
        with self._wakeup:
            while not (self._closing or self._waiting or self._active):
                self._wakeup.wait()
            return not self._closing

    def _alone(self) -> Alone | None:
        """The one sequence in the engine, if there is exactly one (waiting, or the last in a slot that
        has decoded), to decode on the batch-1 graph; else None."""
        with self._wakeup:
            if len(self._waiting) == 1 and not self._active:
                generation = self._waiting.popleft()
            elif not self._waiting and len(self._active) == 1:
                generation = None
            else:
                return None
        if generation is not None:
            request = generation.request
            if generation.cancelled.is_set() or request.max_tokens == 0:
                self._start(generation)                  # ends it at once, as in a slot
                return None
            n_new = self.model.new_token_budget(len(request.prompt_ids), request.max_tokens)
            text = TokenText(self.model.tokenizer, request.prompt_ids, StopStrings(request.stop))
            return Alone(generation, list(request.prompt_ids), n_new, np.random.default_rng(request.seed), text)
        (slot, active), = self._active.items()
        sequence = self.batch.sequences.get(slot)
        if sequence is None or not sequence.generated:   # still prefilling (or let go): stays in the batch
            return None
        del self._active[slot]
        self.batch.cancel(slot)
        ids = [int(i) for i in sequence.prompt] + [int(t) for t in sequence.generated]
        return Alone(active.generation, ids, sequence.max_new_tokens - len(sequence.generated), sequence.rng,
                     active.text, active.tokens, active.reused)

    def _decode_alone(self, alone: Alone) -> None:
        """Decode the lone sequence on the batch-1 graph until it ends or another request arrives; then
        it moves into a slot with its ids so far (the batch prefills them) and its rng and text."""
        generation, model = alone.generation, self.model
        with self._wakeup:
            self._current = generation               # close() cancels it
        with self._stats_lock:
            self._stats.running = 1
        started = time.perf_counter()

        def leave() -> bool:                         # asked after every token
            with self._wakeup:
                return generation.cancelled.is_set() or self._closing or bool(self._waiting)

        try:
            for text in model.stream_ids(alone.ids, generation.request.params, alone.n_new, alone.rng, alone.text,
                                         leave):
                generation.push(Chunk(text))
        except Exception as e:                       # a bad request the server's checks missed, or the backend
            return self._finish(generation, e, time.perf_counter() - started)
        finally:
            with self._wakeup:
                self._current = None
        seconds, stats = time.perf_counter() - started, model.last_stats
        tokens, generated = alone.tokens + len(model.last_generated), model.last_generated
        reused = alone.reused if alone.tokens else stats["reused_tokens"]   # prompt reuse: at its start only
        n_prompt = len(generation.request.prompt_ids)
        moving = stats["stop_reason"] == "cancelled" and not (generation.cancelled.is_set() or self._closing)
        if moving and len(generated) == alone.n_new:      # it had just reached its budget
            tail = alone.text.flush()
            if tail:
                generation.push(Chunk(tail))
            return self._finish(generation, Finished("length", n_prompt, tokens, reused), seconds)
        if not moving:
            reason = FINISH_REASONS[stats["stop_reason"]] if not self._closing else None
            return self._finish(generation, Finished(reason, n_prompt, tokens, reused), seconds)
        with self._stats_lock:
            self._stats.generation_seconds += seconds
        self._start(generation, Alone(generation, alone.ids + generated, alone.n_new - len(generated), alone.rng,
                                      alone.text, tokens, reused))

    def _admit(self) -> None:
        """Move waiting requests into free slots, first come first."""
        while self.batch.free_slots():
            with self._wakeup:
                if not self._waiting:
                    return
                generation = self._waiting.popleft()
            self._start(generation)

    def _start(self, generation: Generation, moved: Alone | None = None) -> None:
        """Put a request into a free slot (moved: a sequence that decoded alone, with its state)."""
        request = generation.request
        tokens, reused = (moved.tokens, moved.reused) if moved else (0, 0)
        if generation.cancelled.is_set():        # the client left while it waited
            return self._finish(generation, Finished(None, len(request.prompt_ids), tokens, reused))
        if request.max_tokens == 0:              # as Model.generate: nothing asked, nothing generated
            return self._finish(generation, Finished("length", len(request.prompt_ids), 0, 0))
        tokenizer = self.model.tokenizer
        before = set(self.batch.active_slots())
        try:
            if moved is None:
                text = TokenText(tokenizer, request.prompt_ids, StopStrings(request.stop))
                ids, n_new, rng = request.prompt_ids, request.max_tokens, request.seed
            else:
                text, ids, n_new, rng = moved.text, moved.ids, moved.n_new, moved.rng
            slot = self.batch.submit(ids, request.params, n_new, seed=rng, stop_ids=tokenizer.eos_ids)
        except Exception as e:                   # a request the server's checks let through, refused here
            for taken in set(self.batch.active_slots()) - before:   # a slot it took before failing: free again
                self.batch.cancel(taken)
            return self._finish(generation, e)
        self._active[slot] = Active(generation, text, tokens, reused)
        with self._stats_lock:
            self._stats.running = len(self._active)

    def _drop_cancelled(self) -> None:
        """Free the slots of the requests whose client left, before the step decodes them again."""
        for slot in [s for s, a in self._active.items() if a.generation.cancelled.is_set()]:
            self._end(slot, None)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            events = self.batch.step()
        except Exception as e:                   # the device failed: every sequence of the step is affected
            log.exception("batched decode step failed; ending the %d running requests", len(self._active))
            events = {}
            for slot in list(self._active):
                self._end(slot, e)
        with delivered_together():
            for slot, event in events.items():
                self._advance(slot, event)
        # Wall time with sequences running, so tokens_per_s is the engine's aggregate rate.
        with self._stats_lock:
            self._stats.generation_seconds += time.perf_counter() - started

    def _advance(self, slot: int, event) -> None:
        """One token of a slot's request: its text to the stream, and its end at an end-of-sequence id,
        a stop string (the slot freed at once) or its token budget."""
        active = self._active.get(slot)
        if active is None:                       # no request owns it (cannot happen): free it, not leak it
            return self.batch.cancel(slot)
        active.tokens += 1
        try:
            text, stopped = active.text.push(event.token)
            if event.finish_reason and not stopped:
                text += active.text.flush()
        except Exception as e:                   # detokenizing failed: only this request is affected
            return self._end(slot, e)
        if text:
            active.generation.push(Chunk(text))
        if stopped or event.finish_reason:
            self._end(slot, "stop" if stopped else event.finish_reason)

    def _end(self, slot: int, outcome) -> None:
        """End a slot's request with a finish_reason ("stop", "length", None: cancelled) or an
        exception; its slot is free for the next request at once."""
        active = self._active.pop(slot)
        self.batch.cancel(slot)                  # nothing to do where the batch let the sequence go itself
        if not isinstance(outcome, BaseException):
            outcome = Finished(outcome, len(active.generation.request.prompt_ids), active.tokens, active.reused)
        self._finish(active.generation, outcome)

    def _finish(self, generation: Generation, outcome, seconds: float = 0.0) -> None:
        # SerialEngine's, with `running` the slots in use (no slot is in use when serving serially).
        with self._stats_lock:
            self._stats.running = len(self._active)
            self._stats.record(outcome, seconds)
        generation.end(outcome)
