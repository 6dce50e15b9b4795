"""The interactive chat of `tinyrun MODEL` on a terminal, with Ollama's commands.

Line editing and history come from prompt_toolkit when stdin and stdout are terminals (history in
$XDG_STATE_HOME/tinyinfer/chat_history), else lines are read with input(). Ctrl-C during a reply
stops it: the text streamed so far becomes the assistant's turn, and the model's KV cache still
holds the conversation, so the next turn is prefilled from where it stopped.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path

from tinyinfer.formats import TinyInferError
from tinyinfer.runtime.errors import ChatTemplateError, ContextOverflowError

PROMPT, CONTINUATION = ">>> ", "... "
QUOTES = '"""'
QUIT_WORDS = {"/bye", "/exit", "/quit", "exit", "quit"}
QUIT_HINT = "Use Ctrl + d or /bye to exit."
HELP = """Available commands:
  /set parameter NAME VALUE   set a sampling parameter (/set parameter alone lists them)
  /set system TEXT            set the system message
  /set verbose | quiet        show or hide the tokens/s line after each reply
  /show info | parameters | system | template
  /clear                      start a new conversation
  /bye, /exit                 leave (so does Ctrl-D)
  /?, /help                   this help

Begin a message with \"\"\" to write several lines; end it with \"\"\".
Ctrl-C stops a reply and keeps what was written; on an empty line it says how to leave."""
# Ollama's parameter names (and tinyinfer's own spellings) -> (Model.generate keyword, type).
PARAMETERS = {
    "temperature": ("temperature", float), "temp": ("temperature", float),
    "top_k": ("top_k", int), "top_p": ("top_p", float), "min_p": ("min_p", float),
    "repeat_penalty": ("repetition_penalty", float), "repetition_penalty": ("repetition_penalty", float),
    "seed": ("seed", int), "num_predict": ("max_tokens", int), "max_tokens": ("max_tokens", int),
    "stop": ("stop", list),
}
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def history_path() -> Path:
    state = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(state) / "tinyinfer" / "chat_history"


def open_block(text: str) -> bool:
    """Whether text starts a \"\"\" message that has not been closed yet."""
    text = text.strip()
    return text.startswith(QUOTES) and not (len(text) >= 2 * len(QUOTES) and text.endswith(QUOTES))


def strip_quotes(text: str) -> str:
    """The message inside \"\"\" marks (a message without them is returned as it is)."""
    stripped = text.strip()
    if not stripped.startswith(QUOTES):
        return text
    body = stripped[len(QUOTES):]
    if body.endswith(QUOTES):
        body = body[: -len(QUOTES)]
    return body.strip("\n")


class TerminalReader:
    """prompt_toolkit's line editor: history (arrow keys, Ctrl-R), a \"\"\" block spans lines, Ctrl-C
    clears a typed line and raises KeyboardInterrupt on an empty one, Ctrl-D on an empty line is EOF."""

    def __init__(self):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.filters import Condition
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        path = history_path()
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            history = FileHistory(str(path))
        except OSError:           # e.g. a read-only home: history for this session only
            history = InMemoryHistory()
        keys = KeyBindings()

        @keys.add("c-c")
        def _(event):
            buffer = event.app.current_buffer
            if buffer.text:
                buffer.reset()
            else:
                event.app.exit(exception=KeyboardInterrupt, style="class:aborting")

        self.session = PromptSession(history=history, key_bindings=keys, prompt_continuation=CONTINUATION,
                                     multiline=Condition(lambda: open_block(self.session.default_buffer.text)))

    def read(self) -> str:
        return self.session.prompt(PROMPT)


class PlainReader:
    """input() line by line, for a terminal on stdin whose output goes elsewhere."""

    def read(self) -> str:
        lines = [input(PROMPT)]
        while open_block("\n".join(lines)):
            lines.append(input(CONTINUATION))
        return "\n".join(lines)


def require_chat_template(model) -> None:
    if not model.chat_template:
        raise ChatTemplateError("This model has no chat template, so it cannot chat; "
                                "pass --prompt TEXT to continue a text instead.")


def interactive_chat(model, system, options, quiet, verbose_prompt=False) -> None:
    require_chat_template(model)
    reader = TerminalReader() if sys.stdin.isatty() and sys.stdout.isatty() else PlainReader()
    print(f"Interactive chat with {model.tinf.path.name}: /? for help, /bye or Ctrl-D to leave, Ctrl-C stops "
          f"a reply.", file=sys.stderr)
    Chat(model, system, options, quiet, verbose_prompt).run(reader)


class Chat:
    def __init__(self, model, system, options, quiet, verbose_prompt):
        self.model, self.system, self.quiet, self.verbose_prompt = model, system, quiet, verbose_prompt
        self.options = dict(options)
        self.explicit_max_tokens = options.get("max_tokens") is not None
        self.history: list[dict] = []          # user and assistant turns, without the system message

    def messages(self) -> list[dict]:
        start = [{"role": "system", "content": self.system}] if self.system else []
        return start + self.history

    def run(self, reader) -> None:
        while True:
            try:
                line = reader.read()
            except EOFError:
                print(file=sys.stderr)
                return
            except KeyboardInterrupt:
                print(QUIT_HINT, file=sys.stderr)
                continue
            text = line.strip()
            if text.lower() in QUIT_WORDS:
                return
            if text.startswith("/"):
                self.command(text)
            elif strip_quotes(line).strip():
                self.reply(strip_quotes(line))

    # ------------------------------------------------------------------------------ a turn

    def reply(self, message: str) -> None:
        from tinyinfer.runtime.cli import overflow_message, show_prompt, speed_line

        self.history.append({"role": "user", "content": message})
        text, chunks = [], None
        try:
            if self.verbose_prompt:
                show_prompt(self.model, self.messages(), chat=True, system=None)
            with ctrl_c_as_flag() as stopped:
                chunks = self.model.generate(self.messages(), chat=True, **self.options)
                for chunk in chunks:
                    text.append(chunk)
                    sys.stdout.write(on_screen(chunk))
                    sys.stdout.flush()
                    if stopped.is_set():
                        break     # the reply stops here; what was written is kept below
        except KeyboardInterrupt:
            pass                  # (off the main thread Ctrl-C still raises)
        except ContextOverflowError as e:
            print(f"error: {overflow_message(e, self.model, chat=True, explicit=self.explicit_max_tokens)}",
                  file=sys.stderr)
            self.history.pop()
            return
        except TinyInferError as e:
            print(f"error: {e}", file=sys.stderr)
            self.history.pop()
            return
        finally:
            if chunks is not None:
                chunks.close()    # a Ctrl-C between chunks: the model records what it fed back
        sys.stdout.write("\n")
        sys.stdout.flush()
        if text:
            self.history.append({"role": "assistant", "content": "".join(text)})
        else:
            self.history.pop()    # stopped before a word: as if the message was never sent
        if not self.quiet and chunks is not None:
            print(speed_line(self.model.last_stats, self.model.max_context), file=sys.stderr)

    # ------------------------------------------------------------------------------ commands

    def command(self, text: str) -> None:
        words = text.split(maxsplit=2)
        name, args = words[0].lower(), words[1:]
        if name in ("/?", "/help"):
            print(HELP)
        elif name == "/clear":
            self.history = []
            print("Cleared the conversation.")
        elif name == "/set":
            self.set(args, text)
        elif name == "/show":
            self.show(args[0].lower() if args else "")
        else:
            print(f"Unknown command {words[0]!r}; type /? for help.")

    def set(self, args: list[str], text: str) -> None:
        what = args[0].lower() if args else ""
        if what == "system":
            system = text.split(maxsplit=2)[2] if len(args) > 1 else ""
            self.system = strip_quotes(system) or None
            print("Set the system message." if self.system else "Cleared the system message.")
        elif what == "parameter":
            self.set_parameter(text.split()[2:])
        elif what in ("verbose", "quiet"):
            self.quiet = what == "quiet"
            print(f"{'Hiding' if self.quiet else 'Showing'} the tokens/s line.")
        else:
            print("Usage: /set parameter NAME VALUE, /set system TEXT, /set verbose or /set quiet.")

    def set_parameter(self, words: list[str]) -> None:
        if words and words[0].lower() == "num_ctx":
            print(f"The context ({self.model.max_context} tokens) is set when the model loads; restart with -c N.")
            return
        if len(words) < 2 or words[0].lower() not in PARAMETERS:
            print(f"Usage: /set parameter NAME VALUE, with NAME one of {', '.join(PARAMETERS)}.")
            return
        name, values = words[0].lower(), words[1:]
        key, kind = PARAMETERS[name]
        try:
            value = values if kind is list else kind(values[0])
        except ValueError:
            print(f"{values[0]!r} is not {'an integer' if kind is int else 'a number'}; {name} needs one.")
            return
        if key == "max_tokens" and value < 0:
            print(f"{name} must be >= 0.")
            return
        trial = {**self.options, key: value}
        try:
            self.model.sampling_params(**{k: trial.get(k) for k in SAMPLING_KEYS})
        except TinyInferError as e:
            print(f"error: {e}")
            return
        self.options = trial
        if key == "max_tokens":
            self.explicit_max_tokens = True
        print(f"Set parameter {name!r} to {' '.join(values)!r}.")

    def show(self, what: str) -> None:
        if what == "info":
            print(self.info())
        elif what == "parameters":
            params = self.model.sampling_params(**{k: self.options.get(k) for k in SAMPLING_KEYS})
            shown = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p,
                     "min_p": params.min_p, "repeat_penalty": params.repetition_penalty,
                     "seed": self.options.get("seed"), "num_predict": self.options.get("max_tokens") or "default",
                     "stop": self.options.get("stop") or []}
            print("\n".join(f"  {k:<15} {v}" for k, v in shown.items()))
        elif what == "system":
            print(self.system or "No system message.")
        elif what == "template":
            print(self.model.chat_template)
        else:
            print("Usage: /show info, /show parameters, /show system or /show template.")

    def info(self) -> str:
        from tinyinfer.formats.stats import file_weight_stats

        m, c = self.model, self.model.config
        backend = "CUDA (GPU)" if type(m.backend).__name__ == "CudaBackend" else "NumPy (CPU)"
        used = len(m.cached_ids)
        return "\n".join([
            f"  model          {m.tinf.path}",
            f"  architecture   {c['architecture']}, {c['n_layers']} layers, dim {c['dim']}, "
            f"{c['n_heads']}/{c['n_kv_heads']} heads, vocab {c['vocab_size']}",
            f"  weights        {file_weight_stats(m.tinf).summary()}",
            f"  quantization   {(m.metadata.get('provenance') or {}).get('quant', 'not recorded')}",
            f"  context        {m.max_context} tokens (the model's: {c['max_context']}), {used} in use",
            f"  backend        {backend}",
            f"  conversation   {len(self.history)} messages",
        ])


@contextmanager
def ctrl_c_as_flag():
    """While a reply streams, Ctrl-C sets a flag read between chunks instead of raising: a
    KeyboardInterrupt could land between keeping a chunk and showing it, and the kept turn would then
    differ from what the user saw (llama.cpp's chat stops at a flag too)."""
    stopped = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return
    previous = signal.signal(signal.SIGINT, lambda *_: stopped.set())
    try:
        yield stopped
    finally:
        signal.signal(signal.SIGINT, previous)


# Control characters in a reply (C0 but tab and newline, DEL, C1) are shown as U+FFFD: a model's output
# is untrusted, and an escape sequence written raw to the terminal could move the cursor, rewrite what
# is shown or set the window title.
CONTROL_CHARS = {c: "\ufffd" for c in [*range(0x20), *range(0x7F, 0xA0)] if chr(c) not in "\t\n"}


def on_screen(text: str) -> str:
    return text.translate(CONTROL_CHARS)
