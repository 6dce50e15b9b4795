"""tinyrun: stream text from a .tinf model, chat with it, or describe it (tinyrun info MODEL)."""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import click

from tinyinfer.formats import TinyInferError
from tinyinfer.runtime.errors import ContextOverflowError, LoadError
from tinyinfer.runtime.hub_commands import push_command, tune_command
from tinyinfer.runtime.model_store import list_command, pull_command, rm_command
from tinyinfer.runtime.serve_command import serve_command


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

SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class ByteSize(click.ParamType):
    """A memory size: 6G, 512M, 1.5G, 0 (or a plain number of bytes)."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().upper().removesuffix("IB").removesuffix("B")
        unit = text[-1:] if text[-1:] in SIZE_UNITS else ""
        try:
            number = float(text[: len(text) - len(unit)])
        except ValueError:
            number = -1.0
        if not number >= 0:
            self.fail(f"{value!r} is not a size; write it like 6G, 512M or 0.", param, ctx)
        return int(number * SIZE_UNITS[unit])


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("model")
@click.option("--prompt", "-p", help="Text to continue (or, with --chat, the user message).")
@click.option("--file", "-f", "prompt_file", type=click.File("r", encoding="utf-8"),
              help="Read the prompt from this file (- for stdin).")
@click.option("--chat", is_flag=True, help="Wrap the prompt in the model's chat template.")
@click.option("--system", "--system-prompt", "system", help="System message for --chat and interactive chat.")
@click.option("--n-predict", "-n", "--max-tokens", "max_tokens", type=click.IntRange(min=0),
              help="Tokens to generate [default: 256, or what fits].")
@click.option("--temp", "--temperature", "temperature", type=click.FloatRange(min=0),
              help="0 = greedy [default: the model's, else 0].")
@click.option("--top-k", type=click.IntRange(min=0), help="Keep the k most likely tokens (0 = off).")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), help="Nucleus sampling (1 = off).")
@click.option("--min-p", type=click.FloatRange(min=0, max=1), help="Drop tokens below min_p * max prob (0 = off).")
@click.option("--repeat-penalty", type=click.FloatRange(min=0, min_open=True), help="Repetition penalty (1 = off).")
@click.option("--seed", "-s", type=int, help="Random seed: the same seed gives the same output.")
@click.option("--stop", multiple=True, help="Stop when this text appears (not printed); repeatable.")
@click.option("--ctx-size", "-c", type=click.IntRange(min=0),
              help="Context size in tokens, up to the model's (0 = the model's) [default: 0].")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True)
@click.option("--threads", "-t", type=click.IntRange(min=1),
              help="Threads of the CPU backend's BLAS [default: all cores].")
@click.option("--weight-cache", type=ByteSize(), metavar="SIZE",
              help="CPU backend: memory for float32 weights, e.g. 6G or 0 [default: 80% of the available memory].")
@click.option("--quiet", "-q", is_flag=True, help="Print no notes or tokens/s on stderr.")
@click.option("--verbose", is_flag=True, help="Print backend details (kernels, memory) on stderr.")
@click.option("--verbose-prompt", is_flag=True, help="Print the prompt as the model sees it, and its token count.")
@click.option("--bench", type=click.IntRange(min=1), metavar="N", help="Benchmark decoding N tokens and exit.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="With --bench: write results to this file.")
@click.option("--verify", type=click.IntRange(min=1), metavar="N",
              help="Compare N decode steps of the GPU against the NumPy reference and exit.")
@click.option("--token", help="Hugging Face token, for a MODEL in a private or gated Hub repo.")
@click.version_option(package_name="tinyinfer", prog_name="tinyrun", message="%(prog)s %(version)s")
def run_command(model, prompt, prompt_file, chat, system, max_tokens, temperature, top_k, top_p, min_p,
                repeat_penalty, seed, stop, ctx_size, device, threads, weight_cache, quiet, verbose, verbose_prompt,
                bench, json_path, verify, token):
    """Stream the continuation of --prompt (or of --file, or of stdin), or chat interactively when no
    prompt is given on a terminal.

    \b
    Also:  tinyrun list          the .tinf files in the Hub cache and a models folder
           tinyrun pull ORG/REPO[/FILE]   download a .tinf file into the Hub cache
           tinyrun rm MODEL      remove a pulled model (or a local .tinf file)
           tinyrun info MODEL    describe a .tinf file (--check: verify every tensor)
           tinyrun push FILE ORG/REPO   publish a .tinf file on the Hugging Face Hub
           tinyrun tune MODEL    store this GPU's autotune choices in the file
           tinyrun serve MODEL   an OpenAI-compatible HTTP server (needs the [serve] extra)
    """
    if prompt is not None and prompt_file is not None:
        raise click.UsageError("pass the prompt with --prompt or with --file, not both.")
    path = resolve_model(model, token)
    if verify:
        return verify_model(path, verify)
    if threads:
        from threadpoolctl import threadpool_limits

        threadpool_limits(threads, user_api="blas")   # for the rest of the process
    from tinyinfer.runtime import load

    with load(path, device=device, verbose=verbose, max_context=ctx_size or None,
              weight_cache_bytes=weight_cache) as m:
        # The notes come once the inputs are checked, so a user error stays one line.
        notes = (lambda: None) if quiet else (lambda: print_notes(m, device, ctx_size))
        if bench:
            notes()
            return bench_model(m, bench, json_path)
        options = dict(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       repetition_penalty=repeat_penalty, seed=seed, stop=list(stop))
        if prompt_file is not None:
            prompt = prompt_file.read()
        if prompt is None and sys.stdin.isatty():
            from tinyinfer.runtime.repl import interactive_chat, require_chat_template

            require_chat_template(m)
            notes()
            return interactive_chat(m, system, options, quiet, verbose_prompt)
        if prompt is None:
            prompt = sys.stdin.read()
        chat = chat or system is not None
        if verbose_prompt:
            show_prompt(m, prompt, chat, system)
        try:
            chunks = m.generate(prompt, chat=chat, system=system, **options)
        except ContextOverflowError as e:
            raise ContextOverflowError(overflow_message(e, m, chat=False, explicit=max_tokens is not None)) from None
        notes()
        print_stream(m, chunks, quiet)


def print_notes(model, device: str, ctx_size: int | None) -> None:
    """One line each on stderr: the CPU fallback of --device auto, and a -c beyond the model's context."""
    from tinyinfer.runtime.numpy_backend import NumpyBackend

    if device == "auto" and isinstance(model.backend, NumpyBackend):
        rate = model.backend.expected_tokens_per_s()
        rate_text = f"{rate:.0f}" if rate >= 10 else f"{rate:.1f}"
        print(f"note: no usable CUDA GPU, so tinyrun runs on the CPU (NumPy backend): expect roughly {rate_text} "
              f"tokens/s for this model (--device cpu hides this note).", file=sys.stderr)
    if ctx_size and ctx_size > model.config["max_context"]:
        print(f"note: -c {ctx_size} is beyond the model's context of {model.config['max_context']} tokens; "
              f"using {model.max_context}.", file=sys.stderr)


def show_prompt(model, prompt, chat: bool, system: str | None) -> None:
    """--verbose-prompt: the text the model is given (the rendered chat template) and its token ids."""
    from tinyinfer.runtime.chat import render_chat

    ids = model.prompt_ids(prompt, chat, system)
    if chat:
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        if system is not None:
            messages = [{"role": "system", "content": system}] + messages
        text = render_chat(model.chat_template, messages, model.tokenizer.special_tokens)
    else:
        text = prompt
    print(f"--- prompt, {len(ids)} tokens ---\n{text}\n--- token ids: {' '.join(map(str, ids))}", file=sys.stderr)


def overflow_message(error: ContextOverflowError, model, chat: bool, explicit: bool) -> str:
    """The context overflow in the words of the CLI (-n, -c) or the chat (/set parameter, /clear)."""
    used, new, context = error.prompt_tokens, error.new_tokens, error.context
    if used is None:
        return str(error)
    what = "The conversation" if chat else "The prompt"
    larger = model.config["max_context"] > context
    if used >= context or not explicit:
        fix = "/clear starts a new conversation" if chat else "shorten it"
        if larger:
            fix += f", or restart with a larger -c (the model allows {model.config['max_context']})"
        return f"{what} is {used} tokens, which leaves no room in the context of {context} tokens; {fix}."
    if chat:
        fix = f"lower it with /set parameter num_predict {context - used}, or /clear to start over"
    else:
        fix = f"lower -n to at most {context - used}" + (" or raise -c" if larger else "") + ", or shorten the prompt"
    flag = "num_predict" if chat else "-n"
    return f"{what} ({used} tokens) plus {flag} {new} new tokens exceeds the context of {context} tokens; {fix}."


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
        print(speed_line(model.last_stats, model.max_context), file=sys.stderr)
    return "".join(text)


def speed_line(stats: dict, max_context: int) -> str:
    n, total, first = stats["new_tokens"], stats.get("total_s", 0.0), stats.get("first_token_s", 0.0)
    decode_rate = (n - 1) / (total - first) if n > 1 and total > first else 0.0
    cached = f" ({stats['reused_tokens']} cached)" if stats.get("reused_tokens") else ""
    context = stats["prompt_tokens"] + n
    return (f"[{n} tokens in {total:.2f} s: prompt {stats['prompt_tokens']} tokens{cached} in {first:.2f} s, "
            f"decode {decode_rate:.1f} tokens/s, context {context}/{max_context}]")


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

SUBCOMMANDS = {"info": info_command, "push": push_command, "tune": tune_command,
               "list": list_command, "pull": pull_command, "rm": rm_command, "serve": serve_command}


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
