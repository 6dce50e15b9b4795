"""Chat templates rendered the way transformers renders them (apply_chat_template).

The template is untrusted code from the model's author, so it runs in Jinja's immutable sandbox,
with the environment options, filters and globals transformers provides. Special tokens
(bos_token, eos_token, ...) are template variables, and caller kwargs override them.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from tinyinfer.runtime.errors import ChatTemplateError


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters, which would change the prompt.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str):
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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"The model's chat template has a syntax error ({e}); "
                                "re-convert with a corrected template.") from None


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
    variables = {"tools": None, "documents": None, **(special_tokens or {}), **template_kwargs}
    try:
        return compiled.render(messages=check_messages(messages), add_generation_prompt=add_generation_prompt,
                               **variables)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"The model's chat template rejected this conversation: {e}.") from None


def encode_chat(tokenizer, template, messages, add_generation_prompt=True, **template_kwargs) -> list[int]:
    """Render and encode a conversation. The template writes its own special tokens; BOS is added
    only when the model wants one and the template did not already write it (never twice)."""
    text = render_chat(template, messages, tokenizer.special_tokens, add_generation_prompt, **template_kwargs)
    ids = tokenizer.encode(text, add_bos=False)
    if tokenizer.add_bos and ids[:1] != [tokenizer.bos_id]:
        ids = [tokenizer.bos_id] + ids
    return ids
