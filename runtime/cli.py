"""tinyrun: stream text from a .tinf model, chat with it, or describe it (tinyrun info MODEL)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import click

from tinyinfer.formats import TinyInferError
from tinyinfer.runtime.errors import ChatTemplateError, ContextOverflowError, LoadError
from tinyinfer.runtime.hub_commands import push_command, tune_command


def resolve_model(ref: str, token: str | None = None) -> Path:
    """The one place that turns a MODEL argument into a local .tinf path (Hub references are downloaded
    into the Hugging Face cache: ORG/REPO, ORG/REPO/FILE.tinf, hf://ORG/REPO/FILE.tinf@REV; see HUB.md)."""
    from tinyinfer.runtime.hub import resolve_model as resolve_reference

    path = resolve_reference(ref, token=token)
    if not path.exists():
        raise LoadError(f"No model file at {ref}; pass the path of a .tinf file (tinyconvert makes one).")
    return path


def missing_tool(module: str) -> TinyInferError:
    return TinyInferError(f"tinyinfer.runtime.{module} is not available in this installation; "
                          "reinstall tinyinfer from a complete source.")


# ------------------------------------------------------------------------------------- tinyrun MODEL

@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--prompt", "-p", help="Text to continue (or, with --chat, the user message).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--system", help="System message for --chat and interactive chat.")
@click.option("--max-tokens", "-n", type=click.IntRange(min=0), help="Tokens to generate [default: 256, or what fits].")
@click.option("--temperature", "-t", type=click.FloatRange(min=0), help="0 = greedy [default: the model's, else 0].")
@click.option("--top-k", type=click.IntRange(min=0), help="Keep the k most likely tokens (0 = off).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), help="Nucleus sampling (1 = off).")
@click.option("--min-p", type=click.FloatRange(min=0, max=1), help="Drop tokens below min_p * max prob (0 = off).")
@click.option("--repeat-penalty", type=click.FloatRange(min=0, min_open=True), help="Repetition penalty (1 = off).")
@click.option("--seed", type=int, help="Random seed: the same seed gives the same output.")
@click.option("--stop", multiple=True, help="Stop when this text appears (not printed); repeatable.")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--quiet", "-q", is_flag=True, help="Do not print tokens/s on stderr.")
@click.option("--verbose", is_flag=True, help="Print backend details (kernels, memory) on stderr.")
@click.option("--bench", type=click.IntRange(min=1), metavar="N", help="Benchmark decoding N tokens and exit.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="With --bench: write results to this file.")
@click.option("--verify", type=click.IntRange(min=1), metavar="N",
              help="Compare N decode steps of the GPU against the NumPy reference and exit.")
@click.option("--token", help="Hugging Face token, for a MODEL in a private or gated Hub repo.")
def run_command(model, prompt, chat, system, max_tokens, temperature, top_k, top_p, min_p, repeat_penalty,
                seed, stop, device, quiet, verbose, bench, json_path, verify, token):
    """Stream the continuation of --prompt (or of stdin), or chat interactively when no prompt is given
    on a terminal.

    \b
    Also:  tinyrun info MODEL   describe a .tinf file (--check: verify every tensor)
           tinyrun push FILE ORG/REPO   publish a .tinf file on the Hugging Face Hub
           tinyrun tune MODEL   store this GPU's autotune choices in the file
    """
    path = resolve_model(model, token)
    if verify:
        return verify_model(path, verify)
    from tinyinfer.runtime import load

    with load(path, device=device, verbose=verbose) as m:
        if bench:
            return bench_model(m, bench, json_path)
        options = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       repetition_penalty=repeat_penalty, seed=seed, stop=list(stop))
        if prompt is None and sys.stdin.isatty():
            return interactive_chat(m, system, options, quiet)
        if prompt is None:
            prompt = sys.stdin.read()
        chat = chat or system is not None
        print_stream(m, m.generate(prompt, chat=chat, system=system, **options), quiet)


def print_stream(model, chunks, quiet: bool) -> str:
    """Print chunks as they arrive; then tokens/s on stderr. Returns the whole text."""
    text = []
    for chunk in chunks:
        sys.stdout.write(chunk)
        sys.stdout.flush()
        text.append(chunk)
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not quiet:
        print(speed_line(model.last_stats), file=sys.stderr)
    return "".join(text)


def speed_line(stats: dict) -> str:
    n, total, first = stats["new_tokens"], stats.get("total_s", 0.0), stats.get("first_token_s", 0.0)
    decode_rate = (n - 1) / (total - first) if n > 1 and total > first else 0.0
    return (f"[{n} tokens in {total:.2f} s: prompt {stats['prompt_tokens']} tokens in {first:.2f} s, "
            f"decode {decode_rate:.1f} tokens/s]")


def interactive_chat(model, system, options, quiet):
    if not model.chat_template:
        raise ChatTemplateError("This model has no chat template, so it cannot chat; "
                                "pass --prompt TEXT to continue a text instead.")
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    print("Interactive chat: /reset starts over, Ctrl-D exits.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            reply = print_stream(model, model.generate(messages, chat=True, **options), quiet)
        except ContextOverflowError as e:
            print(f"error: {e} Type /reset to start a new conversation.", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": reply})


def bench_model(model, n_tokens, json_path):
    try:
        from tinyinfer.runtime.bench import run_bench
    except ImportError:
        raise missing_tool("bench") from None
    result = run_bench(model, n_tokens, prompt_len=16, reps=3, json_path=json_path)
    print(json.dumps(result, indent=2, default=str))


def verify_model(path, n_steps):
    try:
        from tinyinfer.runtime.verify import run_verify
    except ImportError:
        raise missing_tool("verify") from None
    result = run_verify(path, n_steps)
    print(json.dumps(result, indent=2, default=str))


# --------------------------------------------------------------------------------- tinyrun info MODEL

@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--tensors", is_flag=True, help="List every tensor instead of one line per kind.")
@click.option("--check", is_flag=True, help="Also verify every tensor's checksum (reads the whole file).")
@click.option("--token", help="Hugging Face token, for a MODEL in a private or gated Hub repo.")
def info_command(model, tensors, check, token):
    """Describe a .tinf file: config, tensors, bits per weight, tokenizer, chat template, provenance."""
    from tinyinfer.formats import open_tinf
    from tinyinfer.runtime.model import check_model

    path = resolve_model(model, token)
    with open_tinf(path) as f:
        check_model(f)
        click.echo(describe(f, per_tensor=tensors))
    if check:
        from tinyinfer.runtime.integrity import check_file

        click.echo(f"checked {check_file(path)} tensors: every checksum matches")


def describe(f, per_tensor: bool = False) -> str:
    from tinyinfer.formats.stats import weight_stats
    from tinyinfer.runtime.tokenizer import Tokenizer

    meta, c = f.metadata, f.config
    tok_meta = meta["tokenizer"]
    tokenizer = Tokenizer.from_metadata(tok_meta)
    lines = [f"file        {f.path} ({f.file_size / 2**20:.1f} MiB, format {f.version[0]}.{f.version[1]})",
             "config      " + ", ".join(f"{k}={v}" for k, v in c.items()),
             f"tokenizer   {tok_meta['kind']}, {tokenizer.vocab_size} tokens, bos {tok_meta.get('bos_id')}, "
             f"eos {tok_meta.get('eos_ids')}, add_bos {tok_meta.get('add_bos')}",
             f"chat        {'template present' if meta.get('chat_template') else 'no chat template'}",
             f"generation  {meta.get('generation') or 'no defaults'}",
             "provenance  " + ", ".join(f"{k}={v}" for k, v in (meta.get("provenance") or {}).items())]
    infos = [f.info(name) for name in f.names]
    lines += ["", f"{'tensor':<22} {'encoding':<9} {'shape':<16} {'count':>5} {'MiB':>9} {'bits/w':>7}"]
    for name, group in group_tensors(infos, per_tensor).items():
        i = group[0]
        enc = i.encoding + (f" g{i.group}" if i.group else "")
        row = weight_stats(group)
        lines.append(f"{name:<22} {enc:<9} {str(list(i.shape)):<16} {len(group):>5} {row.n_bytes / 2**20:>9.2f} "
                     f"{row.bits_per_weight:>7.2f}")
    stats = weight_stats(infos)
    lines.append(f"{'total':<22} {'':<9} {'':<16} {len(infos):>5} {stats.n_bytes / 2**20:>9.2f} "
                 f"{stats.bits_per_weight:>7.2f}")
    lines.append(stats.summary())
    return "\n".join(lines)


def group_tensors(infos, per_tensor: bool) -> dict:
    """Tensors keyed by name, with per-layer tensors of the same kind folded into one 'layers.*.x' row."""
    groups = defaultdict(list)
    for i in infos:
        parts = i.name.split(".")
        key = i.name if per_tensor or parts[0] != "layers" else "layers.*." + ".".join(parts[2:])
        groups[key].append(i)
    return groups


# ------------------------------------------------------------------------------------------ entry point

SUBCOMMANDS = {"info": info_command, "push": push_command, "tune": tune_command}


def main(argv=None) -> None:
    """`tinyrun info MODEL` and other subcommands by their first word; anything else is `tinyrun MODEL`."""
    args = list(sys.argv[1:] if argv is None else argv)
    command, prog = run_command, "tinyrun"
    if args and args[0] in SUBCOMMANDS:
        command, prog = SUBCOMMANDS[args[0]], f"tinyrun {args[0]}"
        args = args[1:]
    try:
        code = command.main(args=args, prog_name=prog, standalone_mode=False)
    except TinyInferError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (click.Abort, KeyboardInterrupt):
        print(file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:   # e.g. `tinyrun ... | head`
        sys.stderr.close()
        sys.exit(0)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
