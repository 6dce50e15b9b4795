"""`tinyrun serve`: an OpenAI-compatible HTTP API (FastAPI on uvicorn) in front of a serving engine.

Endpoints: POST /v1/chat/completions and /v1/completions (streamed as server-sent events ending in
`data: [DONE]`, or one JSON body), GET /v1/models, /health, /metrics (Prometheus), and llama.cpp's
POST /tokenize, /detokenize and /apply-template. Every request is validated (pydantic models, then
the prompt against the context) before it reaches the engine; errors are OpenAI's JSON shape,
{"error": {"message", "type", "param", "code"}}, with a one-sentence message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.sse import EventSourceResponse, format_sse_event
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from tinyinfer.formats import TinyInferError
from tinyinfer.runtime.chat import render_chat
from tinyinfer.runtime.engine import Chunk, Finished, GenerationRequest
from tinyinfer.runtime.errors import ChatTemplateError, ContextOverflowError

MAX_STOP_STRINGS = 16
MAX_STOP_LENGTH = 256
MAX_SEED = 2**63 - 1
# Fields of OpenAI's API this server does not implement: refused when set, rather than ignored.
UNSUPPORTED = ("logprobs", "top_logprobs", "echo", "suffix", "best_of", "logit_bias", "tools", "tool_choice",
               "functions", "function_call", "response_format", "presence_penalty", "frequency_penalty")


class APIError(Exception):
    """An error answered as OpenAI's JSON error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "?", "!")) else text + "."


# ------------------------------------------------------------------------------- request models

class Strict(BaseModel):
    # Strict types: "5", 5.0 or true are not silently taken for an integer; unknown fields are ignored
    # (clients send many optional ones), except those in UNSUPPORTED.
    model_config = ConfigDict(strict=True, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def refuse_unsupported(cls, data):
        if isinstance(data, dict):
            for name in UNSUPPORTED:
                if data.get(name) not in (None, False, 0, [], {}):
                    raise ValueError(f"'{name}' is not supported by this server; leave it out")
        return data


class StreamOptions(Strict):
    include_usage: bool = False


class Sampling(Strict):
    """The fields /v1/completions and /v1/chat/completions share."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: Any = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None

    @field_validator("n")
    @classmethod
    def one_choice(cls, n):
        if n != 1:
            raise ValueError("only n = 1 is supported")
        return n

    @field_validator("stop")
    @classmethod
    def stop_strings(cls, stop):
        """A string or a list of strings (None: none)."""
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else [] if stop is None else None
        if stops is None or len(stops) > MAX_STOP_STRINGS or not all(
                isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in stops):
            raise ValueError(f"give a string or a list of at most {MAX_STOP_STRINGS} strings of 1 to "
                             f"{MAX_STOP_LENGTH} characters")
        return stops


class Message(Strict):
    role: Annotated[str, Field(min_length=1, max_length=64)]
    content: Any = None

    @field_validator("content")
    @classmethod
    def text_content(cls, content):
        """A string, a list of {"type": "text", "text": ...} parts (joined), or None."""
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                             and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
        if not (content is None or isinstance(content, str)):
            raise ValueError('content must be a string or a list of {"type": "text", "text": ...} parts')
        return content or ""

    def as_template_input(self) -> dict:
        return {"role": self.role, "content": self.content}


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=0)] | None = None   # the newer name of max_tokens


class CompletionRequest(Sampling):
    prompt: Any

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, prompt):
        """A string, a list of one string, or a list of token ids."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        ids = isinstance(prompt, list) and prompt and all(type(i) is int for i in prompt)
        if not (isinstance(prompt, str) or ids):
            raise ValueError("the prompt must be a string or a non-empty list of token ids (one prompt per request)")
        return prompt


class TokenizeRequest(Strict):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(Strict):
    tokens: list[int]


class TemplateRequest(Strict):
    messages: Annotated[list[Message], Field(min_length=1)]


# ------------------------------------------------------------------------------------ preparation

def check_model_name(requested: str | None, names: tuple[str, ...]) -> None:
    if requested is not None and requested not in names:
        raise APIError(404, f"The model {requested!r} does not exist; this server serves {names[0]!r} "
                            "(GET /v1/models lists it).", "model", "model_not_found")


def chat_ids(model, body: ChatRequest) -> list[int]:
    try:
        return model.prompt_ids([m.as_template_input() for m in body.messages], chat=True)
    except ChatTemplateError as e:
        raise APIError(400, str(e), "messages") from None


def completion_ids(model, body: CompletionRequest) -> list[int]:
    if isinstance(body.prompt, str):
        ids = model.prompt_ids(body.prompt, chat=False)
        if not ids:
            raise APIError(400, "The prompt is empty and the model has no BOS token; send some text.", "prompt")
        return ids
    vocab = model.config["vocab_size"]
    if not all(0 <= i < vocab for i in body.prompt):
        raise APIError(400, f"Prompt token ids must be in [0, {vocab}).", "prompt")
    return list(body.prompt)


def generation_request(model, ids: list[int], body: Sampling, max_tokens: int | None,
                       prompt_param: str) -> GenerationRequest:
    """The engine's request, with the budget checked against the context and the sampling defaults
    of the model file filled in."""
    try:
        n_new = model.new_token_budget(len(ids), max_tokens)
        params = model.sampling_params(temperature=body.temperature, top_p=body.top_p)
    except ContextOverflowError as e:
        param = "max_tokens" if max_tokens is not None and len(ids) < model.max_context else prompt_param
        raise APIError(400, str(e), param, "context_length_exceeded") from None
    except (TinyInferError, ValueError) as e:
        raise APIError(400, sentence(str(e))) from None
    return GenerationRequest(tuple(ids), n_new, params, body.seed, tuple(body.stop or ()))


# ------------------------------------------------------------------------------------ responses

class Shape:
    """How /v1/completions writes a choice; ChatShape below writes the chat's."""

    object = chunk_object = "text_completion"
    id_prefix = "cmpl-"
    prompt_param = "prompt"

    def choice(self, text: str, finish: str | None) -> dict:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}

    def delta(self, text: str, finish: str | None = None) -> dict:
        return self.choice(text, finish)

    def opening(self) -> list[dict]:
        return []


class ChatShape(Shape):
    object, chunk_object = "chat.completion", "chat.completion.chunk"
    id_prefix = "chatcmpl-"
    prompt_param = "messages"

    def choice(self, text, finish):
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish}

    def delta(self, text, finish=None):
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None, "finish_reason": finish}

    def opening(self):
        return [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]


def usage(finished: Finished) -> dict:
    return {"prompt_tokens": finished.prompt_tokens, "completion_tokens": finished.completion_tokens,
            "total_tokens": finished.prompt_tokens + finished.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": finished.reused_tokens}}


def failure(error: BaseException) -> APIError:
    if isinstance(error, (TinyInferError, ValueError)):
        return APIError(400, sentence(str(error)))
    return APIError(500, f"The model failed while generating ({type(error).__name__}: {error}); "
                         "see the server's log.", kind="server_error")


async def cancel_on_disconnect(request: Request, generation) -> None:
    """Cancel the generation when the client goes away (the body is read, so the next ASGI message
    is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    generation.cancel()


async def complete(request: Request, generation, shape: Shape, header: dict) -> JSONResponse:
    watcher = asyncio.create_task(cancel_on_disconnect(request, generation))
    try:
        texts, finished = [], None
        async for event in generation:
            if isinstance(event, Chunk):
                texts.append(event.text)
            else:
                finished = event
    except Exception as e:
        raise failure(e) from None
    finally:
        watcher.cancel()
        generation.cancel()
    if finished.finish_reason is None:      # cancelled: the client is gone
        return Response(status_code=499)
    body = {**header, "object": shape.object, "choices": [shape.choice("".join(texts), finished.finish_reason)],
            "usage": usage(finished)}
    return JSONResponse(body)


async def stream_events(generation, shape: Shape, header: dict, include_usage: bool):
    """SSE events for a streamed generation; leaving early (a disconnect) cancels the generation."""
    def event(choices, **extra) -> bytes:
        data = {**header, "object": shape.chunk_object, "choices": choices, **extra}
        return format_sse_event(data_str=json.dumps(data, ensure_ascii=False, separators=(",", ":")))

    try:
        for choice in shape.opening():
            yield event([choice])
        finished = None
        async for item in generation:
            if isinstance(item, Chunk):
                yield event([shape.delta(item.text)])
            else:
                finished = item
        if finished.finish_reason is None:
            return
        yield event([shape.delta("", finished.finish_reason)])
        if include_usage:
            yield event([], usage=usage(finished))
        yield format_sse_event(data_str="[DONE]")
    except Exception as e:   # the status line is sent: the error goes in the stream, as OpenAI does
        yield format_sse_event(data_str=json.dumps(failure(e).body()))
    finally:
        generation.cancel()


# ------------------------------------------------------------------------------------------ metrics

class EngineCollector:
    """Prometheus metrics read from the engine's stats at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        s = self.engine.stats()
        requests = CounterMetricFamily("tinyinfer_requests", "Generation requests finished, by outcome.",
                                       labels=["outcome"])
        for outcome, count in s.requests.items():
            requests.add_metric([outcome], count)
        yield requests
        yield CounterMetricFamily("tinyinfer_prompt_tokens", "Prompt tokens of finished requests.",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily("tinyinfer_prompt_tokens_reused", "Prompt tokens whose K/V came from the cache.",
                                  value=s.reused_prompt_tokens)
        yield CounterMetricFamily("tinyinfer_completion_tokens", "Tokens generated.", value=s.completion_tokens)
        yield CounterMetricFamily("tinyinfer_generation_seconds", "Time spent generating.",
                                  value=s.generation_seconds)
        yield GaugeMetricFamily("tinyinfer_tokens_per_second",
                                "Tokens generated per second of generation time, since start.", value=s.tokens_per_s)
        yield GaugeMetricFamily("tinyinfer_queue_depth", "Requests waiting for the engine.", value=s.queue_depth)
        yield GaugeMetricFamily("tinyinfer_sequences_running", "Sequences being generated.", value=s.running)


# ---------------------------------------------------------------------------------------------- app

def validation_message(error: dict) -> tuple[str, str | None]:
    """(one sentence, the parameter) for pydantic's first error."""
    if error["type"] == "json_invalid":
        return (f"The request body is not valid JSON ({error.get('ctx', {}).get('error', 'decode error')} at "
                f"character {error['loc'][-1]}); send a JSON object."), None
    loc = error["loc"][1:]   # after "body"
    param = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".") or None
    message = error["msg"].removeprefix("Value error, ")
    if not loc and isinstance(error.get("input"), (bytes, str)):
        return "The request body is not JSON; send a JSON object with Content-Type: application/json.", None
    if not loc:
        return sentence(f"The request body is not a valid request: {message}"), None
    return sentence(f"Invalid '{param}': {message}"), param


def create_app(engine, model_names: tuple[str, ...], created: int | None = None) -> FastAPI:
    """The app for one engine serving one model, known by any of model_names (the first is its id)."""
    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))
    created = int(time.time()) if created is None else created

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await run_in_threadpool(engine.close)

    app = FastAPI(title="tinyinfer", lifespan=lifespan)

    @app.exception_handler(APIError)
    async def api_error(request, exc: APIError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request, exc: RequestValidationError):
        message, param = validation_message(exc.errors()[0])
        return APIError(400, message, param, "invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, exc: StarletteHTTPException):
        if isinstance(exc.__cause__, UnicodeDecodeError):
            message = "The request body is not valid UTF-8; send JSON encoded in UTF-8."
        elif exc.status_code == 404:
            message = f"There is no endpoint {request.url.path}; see the README's list of endpoints."
        else:
            message = sentence(str(exc.detail))
        return APIError(exc.status_code, message).response()

    def loaded_model():
        """The engine's model, or 503 while it loads (500 if loading failed)."""
        if engine.load_error is not None:
            raise APIError(500, f"The model failed to load: {engine.load_error}", kind="server_error")
        if not engine.loaded:
            raise APIError(503, "The model is still loading; retry in a moment.", kind="unavailable_error",
                           code="model_loading")
        return engine.model

    def header(shape: Shape) -> dict:
        return {"id": shape.id_prefix + uuid.uuid4().hex, "created": int(time.time()), "model": model_names[0]}

    async def respond(request: Request, model, ids, body: Sampling, max_tokens, shape: Shape):
        gen_request = generation_request(model, ids, body, max_tokens, shape.prompt_param)
        try:
            generation = engine.submit(gen_request)
        except RuntimeError:
            raise APIError(503, "The server is shutting down; retry later.", kind="unavailable_error") from None
        if not body.stream:
            return await complete(request, generation, shape, header(shape))
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventSourceResponse(stream_events(generation, shape, header(shape), include_usage),
                                   headers={"Cache-Control": "no-cache"})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, request: Request):
        check_model_name(body.model, model_names)
        model = loaded_model()
        ids = await run_in_threadpool(chat_ids, model, body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(request, model, ids, body, max_tokens, ChatShape())

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model_name(body.model, model_names)
        model = loaded_model()
        ids = await run_in_threadpool(completion_ids, model, body)
        return await respond(request, model, ids, body, body.max_tokens, Shape())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_names[0], "object": "model", "created": created,
                                            "owned_by": "tinyinfer"}]}

    @app.get("/health")
    async def health():
        loaded_model()
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        tokenizer = loaded_model().tokenizer
        ids = await run_in_threadpool(tokenizer.encode, body.content, body.add_special)
        if not body.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": i, "piece": tokenizer.decode([i])} for i in ids]}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        model = loaded_model()
        vocab = model.config["vocab_size"]
        if not all(0 <= i < vocab for i in body.tokens):
            raise APIError(400, f"Token ids must be in [0, {vocab}).", "tokens")
        return {"content": model.tokenizer.decode(body.tokens)}

    @app.post("/apply-template")
    async def apply_template(body: TemplateRequest):
        model = loaded_model()
        messages = [m.as_template_input() for m in body.messages]
        try:
            prompt = await run_in_threadpool(render_chat, model.chat_template, messages,
                                             model.tokenizer.special_tokens)
        except ChatTemplateError as e:
            raise APIError(400, str(e), "messages") from None
        return {"prompt": prompt}

    return app


# ------------------------------------------------------------------------------------------ serve

def listening_socket(host: str, port: int) -> socket.socket:
    """Bind before anything loads, so a taken port is one sentence, not a log after the load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise TinyInferError(f"Cannot listen on {host}:{port} ({e.strerror}); pick another --port or --host.") \
            from None
    return sock


def serve(path, names: tuple[str, ...], host: str, port: int, ctx_size: int | None, device: str,
          log_level: str = "info", parallel: int | None = None) -> None:
    """Serve the .tinf file at path until interrupted; the model loads while the server already answers
    (503 until it is ready), and a model that fails to load stops the server with its error.
    parallel: sequences decoded together (batch_serving.serving_engine; None: as many as fit)."""
    import uvicorn

    from tinyinfer.runtime import load
    from tinyinfer.runtime.batch_serving import serving_engine

    sock = listening_socket(host, port)
    engine = serving_engine(lambda: load(path, device=device, max_context=ctx_size or None), device, parallel)
    app = create_app(engine, names, created=int(path.stat().st_mtime))
    # On Ctrl-C, open streams get a few seconds to end before they are cut.
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))

    def stop_if_load_fails():
        engine.ready.wait()
        if engine.load_error is not None:
            server.should_exit = True
            return
        backend = "CUDA" if "Cuda" in type(engine.model.backend).__name__ else "CPU (NumPy backend)"
        sequences = f"{engine.parallel} sequences at once" if engine.parallel > 1 else "one request at a time"
        logging.getLogger("uvicorn.error").info(
            "%s loaded on the %s, context %d tokens, %s: serving the OpenAI API at http://%s:%d/v1", names[0],
            backend, engine.model.max_context, sequences, host, sock.getsockname()[1])

    threading.Thread(target=stop_if_load_fails, daemon=True).start()
    server.run(sockets=[sock])
    if engine.load_error is not None:
        error = engine.load_error
        raise error if isinstance(error, TinyInferError) else TinyInferError(
            f"The model failed to load ({type(error).__name__}: {error}).")
    # A server whose model loaded stops only on a signal; uvicorn re-raises it on the way out, but not
    # always as KeyboardInterrupt, so Ctrl-C ends with tinyrun's exit code for it (130) every time.
    raise KeyboardInterrupt
