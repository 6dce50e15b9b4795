"""`tinyconvert SOURCE -o OUT.tinf`: the command-line face of convert_checkpoint."""

from __future__ import annotations

import sys

import click

from tinyinfer.convert.pipeline import GROUP_SIZES, QUANTS, convert_checkpoint
from tinyinfer.formats import TinyInferError


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("source")
@click.option("-o", "--out", type=click.Path(dir_okay=False), default=None,
              help="Output .tinf path (default: <source name>-<quant>.tinf here).")
@click.option("--quant", type=click.Choice(QUANTS), default=None,
              help="Encoding of the linear layers [default: q4; for a GGUF file, each matrix keeps its "
                   "own encoding where tinyinfer holds it exactly].")
@click.option("--group-size", type=click.Choice([str(g) for g in GROUP_SIZES]), default=None,
              help="Columns per quantization scale [default: 32 for q4, 64 for q8; 32 for a GGUF file].")
@click.option("--head", type=click.Choice(["f16"]), default=None,
              help="Store the output head in f16 instead of quantizing it like the other linears.")
@click.option("--no-scale-search", is_flag=True,
              help="Use plain scales (q8: max-abs, q4: llama.cpp Q4_0's rule): faster, less accurate.")
@click.option("--no-calibrate", is_flag=True,
              help="q4: skip the calibration pass that weighs the scale search by activation statistics.")
@click.option("--revision", default=None, help="Hub branch, tag or commit to download.")
@click.option("--token", default=None, help="Hugging Face token for gated or private repos.")
@click.option("--tokenizer", type=click.Path(exists=True, dir_okay=False), default=None,
              help="SentencePiece .model for a llama2.c .bin checkpoint.")
@click.option("--file", "gguf_name", metavar="NAME.gguf", default=None,
              help="With a Hub repo id: convert this one GGUF file of the repo.")
@click.option("--force", is_flag=True, help="Replace an existing OUT that is not a .tinf file (never an input).")
@click.option("--autotune", is_flag=True, help="Tune the kernels on this GPU and store the choices in the file.")
@click.option("--push-to-hub", "push_repo", metavar="ORG/REPO", default=None,
              help="Then publish the file and a model card on the Hugging Face Hub (see HUB.md).")
@click.option("--private", is_flag=True, help="With --push-to-hub: create the repo as private.")
@click.version_option(package_name="tinyinfer", prog_name="tinyconvert", message="%(prog)s %(version)s")
def main(source, out, quant, group_size, head, no_scale_search, no_calibrate, revision, token, tokenizer, gguf_name,
         force, autotune, push_repo, private):
    """Convert SOURCE (a Hub repo id, a local Hugging Face checkpoint folder, a .gguf file, or a
    llama2.c .bin) into one .tinf file."""
    from tinyinfer.convert.push import check_push_options, push_to_hub
    from tinyinfer.runtime.tune_in_file import require_cuda, tune_file

    try:
        check_push_options(push_repo, private)   # fail before converting, not after
        if autotune:
            require_cuda()
        path = convert_checkpoint(source, out=out, quant=quant, group_size=int(group_size) if group_size else None,
                                  head=head, scale_search=not no_scale_search, revision=revision, token=token,
                                  tokenizer=tokenizer, progress=True, file=gguf_name, calibrate=not no_calibrate,
                                  force=force)
        if autotune:
            key, _ = tune_file(path)
            click.echo(f"stored autotune choices for {key} in {path}", err=True)
        if push_repo:
            url = push_to_hub(path, push_repo, private=private, token=token)
            click.echo(f"pushed {path.name} to {push_repo} ({url}); run it with: tinyrun {push_repo}/{path.name}",
                       err=True)
    except TinyInferError as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
