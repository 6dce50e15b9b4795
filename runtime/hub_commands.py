"""`tinyrun push FILE ORG/REPO` and `tinyrun tune MODEL`: the subcommands for sharing files (HUB.md)."""

from __future__ import annotations

from pathlib import Path

import click


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("file", type=click.Path(dir_okay=False))
@click.argument("repo_id", metavar="ORG/REPO")
@click.option("--private", is_flag=True, help="Create the repo as private (an existing repo keeps its visibility).")
@click.option("--token", help="Hugging Face token with write access [default: HF_TOKEN or `hf auth login`].")
def push_command(file, repo_id, private, token):
    """Publish FILE.tinf on the Hugging Face Hub as ORG/REPO, with a generated model card."""
    from tinyinfer.convert.push import push_to_hub

    url = push_to_hub(file, repo_id, private=private, token=token)
    click.echo(f"pushed {Path(file).name} to {repo_id} ({url})")
    click.echo(f"run it with: tinyrun {repo_id}/{Path(file).name}")


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("-o", "--out", type=click.Path(dir_okay=False), help="Write a tuned copy here instead of updating MODEL.")
@click.option("--bench", type=click.IntRange(min=0), default=0, metavar="N",
              help="Also store a benchmark of N decoded tokens (the model card shows it).")
@click.option("--token", help="Hugging Face token, for a MODEL in a private or gated repo.")
@click.option("--verbose", is_flag=True, help="Print backend details and the tuning timings on stderr.")
def tune_command(model, out, bench, token, verbose):
    """Autotune MODEL's kernels on this GPU and store the choices in the file, beside other GPUs' entries."""
    from tinyinfer.runtime.hub import resolve_model
    from tinyinfer.runtime.tune_in_file import tune_file

    key, written = tune_file(resolve_model(model, token=token), out=out, bench_tokens=bench, verbose=verbose)
    click.echo(f"stored autotune choices for {key} in {written}")
