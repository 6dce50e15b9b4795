"""Chat templates rendered the way transformers renders them (apply_chat_template).

The template is untrusted code from the model's author, so it runs in Jinja's immutable sandbox,
with the environment options, filters and globals transformers provides, and with limits the
sandbox lacks: compile and render time (a deadline checked inside the sandbox's own hooks, on every
loop step, call, attribute and item access, so it holds on any thread, with no signals), output
size, the size of strings and lists an operator may build, and powers. Every exception out of Jinja
becomes a ChatTemplateError. Special tokens (bos_token, eos_token, ...) are template variables that
never replace render()'s own (messages, add_generation_prompt, tools, documents); caller kwargs
override them.
"""

from __future__ import annotations

import json
import re
import threading
import time
from datetime import datetime
from functools import lru_cache, wraps

from tinyinfer.formats.errors import shown
from tinyinfer.runtime.errors import ChatTemplateError

MAX_TEMPLATE_CHARS = 128 << 10    # real templates are a few KiB; compile time grows with the source (2 s)
COMPILE_SECONDS = 5.0
RENDER_SECONDS = 5.0              # a long conversation renders in milliseconds
MAX_OUTPUT_CHARS = 1 << 24        # more text than any context holds
MAX_CHARS = 1 << 24               # characters of a string one operation may build
MAX_ITEMS = 1 << 20               # items of a list or tuple (sorting more takes seconds in one call)
MAX_ARGUMENT = 1 << 20            # an integer argument of a call or filter (widths, counts)
MAX_RANGE = 100_000               # items of one range(), as Jinja's own sandbox allows
MAX_POWER_BITS = 4096             # a ** b may yield an integer of this many bits at most
WIDE_FORMAT = re.compile(r"\d{7,}")   # a format width or precision of a million or more
RESERVED = ("messages", "add_generation_prompt", "tools", "documents")

deadline = threading.local()   # per thread: a server renders on its worker threads


class TemplateLimit(Exception):
    """A template went past one of the limits above."""


def tick() -> None:
    if time.monotonic() > getattr(deadline, "at", float("inf")):
        raise TemplateLimit(f"it ran longer than {deadline.seconds:g} s")


def start_clock(seconds: float) -> None:
    deadline.at, deadline.seconds = time.monotonic() + seconds, seconds


def sized(value):
    """The value, when it is not a string or list longer than the limits."""
    if isinstance(value, (str, list, tuple)):
        check_size(type(value), len(value))
    return value


def check_size(kind: type, length: int) -> None:
    """Refuse, before building it, a string or list of `length` items beyond the limits."""
    limit = MAX_CHARS if issubclass(kind, str) else MAX_ITEMS
    if length > limit:
        raise TemplateLimit(f"it built a {kind.__name__} of {length} items, more than {limit}")


def check_arguments(args, kwargs) -> None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ARGUMENT:
            raise TemplateLimit(f"it passed the integer {shown(value)} to a call")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def bounded_range(*args):
    try:
        items = range(*args)
        length = len(items)
    except (TypeError, ValueError, OverflowError) as e:
        raise TemplateLimit(f"range{shown(args)} is invalid ({e})") from None
    if length > MAX_RANGE:
        raise TemplateLimit(f"range() of {length} items exceeds {MAX_RANGE}")
    return items


def bounded_loop(iterable):
    """What every {% for %} iterates: the deadline is checked on each step."""
    for item in iterable:
        tick()
        yield item


def limited(function):
    """A filter or test with its integer arguments, deadline and result size checked."""

    @wraps(function)  # keeps jinja's pass_context/pass_environment marks
    def call(*args, **kwargs):
        tick()
        check_arguments(args, kwargs)
        if function.__name__ == "do_format" and any(isinstance(a, str) and WIDE_FORMAT.search(a) for a in args):
            raise TemplateLimit("it formats with a width of a million characters or more")
        return sized(function(*args, **kwargs))

    return call


@lru_cache(maxsize=16)
def compile_template(source: str):
    import jinja2

    if len(source) > MAX_TEMPLATE_CHARS:
        raise ChatTemplateError(f"The model's chat template is {len(source)} characters, more than the "
                                f"{MAX_TEMPLATE_CHARS} allowed; re-convert with a shorter template.")
    env = limited_environment()
    start_clock(COMPILE_SECONDS)
    try:
        return env.from_string(guarded(env.parse(source)))
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"The model's chat template has a syntax error ({shown(e.message, 150)}, "
                                f"line {e.lineno}); re-convert with a corrected template.") from None
    except Exception as e:   # RecursionError for deep nesting, TemplateLimit, MemoryError, ...
        raise ChatTemplateError(f"The model's chat template cannot be compiled ({type(e).__name__}: "
                                f"{shown(str(e), 150)}); re-convert with a corrected template.") from None
    finally:
        deadline.at = float("inf")


def guarded(tree):
    """The parsed template with every {% for %} iterating through bounded_loop and every `~`
    concatenation's result size-checked (the sandbox has no hook for either)."""
    from jinja2 import nodes
    from jinja2.visitor import NodeTransformer

    def through(name: str, node):
        return nodes.Filter(node, name, [], [], None, None, lineno=node.lineno)

    class Guard(NodeTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = through("tinyinfer_loop", node.iter)
            return node

        def visit_Concat(self, node):
            return through("tinyinfer_sized", self.generic_visit(node))

    return Guard().visit(tree)


@lru_cache(maxsize=1)
def limited_environment():
    """The sandbox transformers uses, plus the limits (the class is made here: jinja2 loads lazily)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %} marks assistant text for training masks; here a no-op."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller):
            return caller()

    class CompileDeadline(jinja2.ext.Extension):
        """Checks the compile deadline on every token the parser reads."""

        def filter_stream(self, stream):
            for token in stream:
                tick()
                yield token

    class LimitedSandbox(ImmutableSandboxedEnvironment):
        # Intercepted operators are also never folded into constants at compile time.
        intercepted_binops = frozenset(["*", "**", "+", "%", "//"])

        def call_binop(self, context, operator, left, right):
            tick()
            if operator == "**" and isinstance(left, int) and isinstance(right, (int, float)):
                if abs(left) > 1 and right * max(abs(left).bit_length(), 1) > MAX_POWER_BITS:
                    raise TemplateLimit(f"it raised {shown(left)} to the power {shown(right)}")
            if operator == "*" and isinstance(left, int) and isinstance(right, (str, list, tuple)):
                left, right = right, left
                operator = "r*"
            if operator in ("*", "r*") and isinstance(left, (str, list, tuple)) and isinstance(right, int):
                check_size(type(left), len(left) * max(right, 0))
            if operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                check_size(type(left), len(left) + len(right))
            if operator == "%" and isinstance(left, str) and WIDE_FORMAT.search(left):
                raise TemplateLimit("it formats with a width of a million characters or more")
            if operator == "r*":
                return sized(right * left)
            return sized(super().call_binop(context, operator, left, right))

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            tick()
            check_arguments(args, kwargs)
            return sized(super().call(__context, __obj, *args, **kwargs))

        def getattr(self, obj, attribute):
            tick()
            if isinstance(obj, str) and attribute in ("format", "format_map") and WIDE_FORMAT.search(obj):
                raise TemplateLimit("it formats with a width of a million characters or more")
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            tick()
            return super().getitem(obj, argument)

    env = LimitedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[GenerationBlock, CompileDeadline, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: limited(f) for name, f in env.filters.items()}
    env.tests = {name: limited(f) for name, f in env.tests.items()}
    env.filters["tinyinfer_loop"] = bounded_loop
    env.filters["tinyinfer_sized"] = sized
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["range"] = bounded_range
    return env


def check_messages(messages) -> list[dict]:
    """Copies of the messages without their None-valued keys, as transformers passes them (an
    assistant turn of tool calls may come with content None)."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise ChatTemplateError("Chat messages must be a list of dicts with 'role' and 'content' keys.")
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    if not all("role" in m and ("content" in m or "tool_calls" in m) for m in messages):
        raise ChatTemplateError("Chat messages must be a list of dicts with 'role' and 'content' keys.")
    return messages


def render_chat(template: str | None, messages, special_tokens: dict | None = None,
                add_generation_prompt: bool = True, **template_kwargs) -> str:
    """Render a conversation to the prompt text, exactly as transformers' apply_chat_template(tokenize=False);
    template_kwargs (tools=[...] JSON schemas, date_string=..., ...) are template variables as there."""
    if not template:
        raise ChatTemplateError("This model has no chat template; use a plain prompt instead of chat "
                                "(or convert a checkpoint whose tokenizer_config.json has one).")
    import jinja2

    compiled = compile_template(template)
    tokens = {k: v for k, v in (special_tokens or {}).items() if isinstance(k, str) and k not in RESERVED}
    variables = {**tokens, "messages": check_messages(messages), "add_generation_prompt": add_generation_prompt,
                 "tools": None, "documents": None, **template_kwargs}
    start_clock(RENDER_SECONDS)
    try:
        return bounded_output(compiled.generate(variables))
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"The model's chat template rejected this conversation: "
                                f"{shown(str(e), 200)}.") from None
    except Exception as e:   # the template's own errors: ZeroDivisionError, TypeError, TemplateLimit, ...
        raise ChatTemplateError(f"The model's chat template failed on this conversation because "
                                f"{template_failure(e)}; use a plain prompt or re-convert with a corrected "
                                f"template.") from None
    finally:
        deadline.at = float("inf")


def bounded_output(chunks) -> str:
    parts, total = [], 0
    for chunk in chunks:
        tick()
        total += len(chunk)
        if total > MAX_OUTPUT_CHARS:
            raise TemplateLimit(f"it wrote more than {MAX_OUTPUT_CHARS} characters")
        parts.append(chunk)
    return "".join(parts)


def template_failure(e: Exception) -> str:
    if isinstance(e, TemplateLimit):
        return str(e)
    return f"it raised {type(e).__name__} ({shown(str(e), 120)})"


def encode_chat(tokenizer, template, messages, add_generation_prompt=True, **template_kwargs) -> list[int]:
    """Render and encode a conversation. The template writes its own special tokens; BOS is added
    only when the model wants one and the template did not already write it (never twice)."""
    text = render_chat(template, messages, tokenizer.special_tokens, add_generation_prompt, **template_kwargs)
    ids = tokenizer.encode(text, add_bos=False)
    if tokenizer.add_bos and ids[:1] != [tokenizer.bos_id]:
        ids = [tokenizer.bos_id] + ids
    return ids
