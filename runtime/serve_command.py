"""`tinyrun serve MODEL`: the OpenAI-compatible server (runtime/server.py), from the optional extra [serve]."""

from __future__ import annotations

import click

from tinyinfer.formats import TinyInferError

SERVE_PACKAGES = {"fastapi", "starlette", "uvicorn", "pydantic", "pydantic_core", "prometheus_client"}
MISSING_EXTRA = ("tinyrun serve needs the server's packages (FastAPI, uvicorn, pydantic, prometheus_client); "
                 'install them with pip install -e ".[serve]" from the checkout.')


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True, help="Port to listen on.")
@click.option("--ctx-size", "-c", type=click.IntRange(min=0),
              help="Context size in tokens, up to the model's (0 = the model's) [default: 0].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--parallel", "-np", type=int, metavar="N",
              help="Sequences decoded together on the GPU, 1 to 32 (1 = one request at a time) "
                   "[default: as many as fit].")
@click.option("--token", help="Hugging Face token, for a MODEL in a private or gated Hub repo.")
def serve_command(model, host, port, ctx_size, device, parallel, token):
    """Serve MODEL over an OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, ...)."""
    check_parallel(parallel)
    try:
        from tinyinfer.runtime.server import serve
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in SERVE_PACKAGES:
            raise
        raise TinyInferError(MISSING_EXTRA) from None
    from tinyinfer.runtime.cli import resolve_model

    path = resolve_model(model, token)
    serve(path, (path.stem, model), host, port, ctx_size, device, parallel=parallel)


def check_parallel(parallel: int | None) -> None:
    # Checked before the server's packages are imported or a model is resolved: a typo is one line at once.
    from tinyinfer.runtime.batch_serving import MAX_PARALLEL

    if parallel is not None and not 1 <= parallel <= MAX_PARALLEL:
        raise TinyInferError(f"--parallel {parallel} is out of range; pass 1 to {MAX_PARALLEL} sequences "
                             "(1 serves one request at a time).")
