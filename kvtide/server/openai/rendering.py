"""Chat templates rendered with a deadline and an output cap, so a hostile or runaway template (a
request's own with --trust-request-chat-template, or a model's) ends with an error instead of
holding a thread, the GIL or gigabytes for minutes.

The template is compiled in transformers' own sandbox (its filters and globals: `tojson`,
`raise_exception`, `namespace`, the `{% generation %}` tag), so the text is the one
`tokenizer.apply_chat_template(..., tokenize=False)` renders; what differs is how it runs:

- output is consumed chunk by chunk (`Template.generate`) up to `max_bytes`;
- a trace function on the rendering thread raises once the deadline passes, also inside loops
  that print nothing (`{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}...`);
- the operations that can build a huge value in one C call are checked before they run: `*`,
  `**`, `%` and `+` (intercepted binary operators), calls and filters with a huge integer argument
  or a huge format width, and namespace attributes (the only state a loop can grow);
- the optimizer is off, so nothing is evaluated while compiling.
"""

from __future__ import annotations

import functools
import math
import re
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateRenderError(ValueError):
    """The template failed, ran past its deadline or rendered too much (the caller's 400)."""


class _Budget(threading.local):
    deadline: float = math.inf
    max_bytes: int = 1 << 62


_budget = _Budget()
_TEMPLATE_FILENAME = "<template>"
"""co_filename of the code Jinja compiles from a string: the frames the deadline tracer watches."""
_FORMAT_NUMBER = re.compile(r"\d{7,}")
"""A number of 7+ digits in a %- or {}-format string: a width that would build megabytes."""


def _size(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return len(value)
    return 0


def _check_deadline() -> None:
    if time.monotonic() > _budget.deadline:
        raise TemplateRenderError("the chat template ran past its time limit")


def _check_value(value: Any) -> Any:
    if _size(value) > _budget.max_bytes:
        raise TemplateRenderError(f"the chat template built a value over {_budget.max_bytes} characters or items")
    return value


def _check_arguments(args: tuple, kwargs: Mapping[str, Any]) -> None:
    """Huge integers (widths, repeat counts) and huge format widths are refused before the call."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, int) and not isinstance(arg, bool) and abs(arg) > _budget.max_bytes:
            raise TemplateRenderError(f"the chat template passed {arg} to a call, over the limit of "
                                      f"{_budget.max_bytes}")
        if isinstance(arg, str) and _size(arg) > _budget.max_bytes:
            _check_value(arg)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox with every value-building operation checked against the thread's budget."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _check_deadline()
        if operator == "*":
            for seq, count in ((left, right), (right, left)):
                if _size(seq) and isinstance(count, int) and _size(seq) * max(count, 0) > _budget.max_bytes:
                    raise TemplateRenderError(f"the chat template repeats a value {count} times, over the limit "
                                              f"of {_budget.max_bytes} characters or items")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 \
                and right * math.log2(abs(left)) > 4096:
            raise TemplateRenderError("the chat template computes a power over 4096 bits")
        elif operator == "%" and isinstance(left, str):
            self._check_format(left)
        return _check_value(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 (jinja's signature)
        _check_deadline()
        _check_arguments(args, kwargs)
        return _check_value(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        _check_deadline()
        if attribute in ("format", "format_map") and isinstance(obj, str):
            self._check_format(obj)
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _check_deadline()
        return super().getitem(obj, argument)

    @staticmethod
    def _check_format(text: str) -> None:
        if _FORMAT_NUMBER.search(text):
            raise TemplateRenderError("the chat template formats with a width of millions of characters")


def _bounded_filter(function: Any) -> Any:
    @functools.wraps(function)  # keeps jinja_pass_arg (pass_context & co.)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_deadline()
        _check_arguments(args, kwargs)
        if getattr(function, "__name__", None) in ("do_format", "format") and args and isinstance(args[-1], str):
            BoundedSandbox._check_format(args[-1])
        return _check_value(function(*args, **kwargs))

    return bounded


@functools.lru_cache(maxsize=1)
def _environment() -> BoundedSandbox:
    """A BoundedSandbox configured as transformers' chat-template environment."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    reference = _compile_jinja_template("{{ '' }}").environment
    env = BoundedSandbox(trim_blocks=reference.trim_blocks, lstrip_blocks=reference.lstrip_blocks,
                         extensions=[type(ext) for ext in reference.extensions.values()], optimized=False)
    env.filters.update(reference.filters)
    env.filters = {name: _bounded_filter(f) for name, f in env.filters.items()}
    env.globals.update(reference.globals)
    env.globals["namespace"] = _bounded_namespace(reference.globals.get("namespace", jinja2.utils.Namespace))
    return env


def _bounded_namespace(base: type) -> type:
    """The template's namespace(), whose attributes are checked as they are set: a loop can grow a
    value only through one, e.g. `{% set ns.s = ns.s ~ ns.s %}`."""

    class BoundedNamespace(base):  # type: ignore[misc, valid-type]
        def __setitem__(self, name: str, value: Any) -> None:
            _check_deadline()
            _check_value(value)
            super().__setitem__(name, value)

    return BoundedNamespace


@functools.lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as e:
        raise TemplateRenderError(f"the chat template does not compile: {e}") from e
    except RecursionError as e:
        raise TemplateRenderError("the chat template is nested too deeply") from e


def _template_context(tokenizer: Any, conversation: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                      add_generation_prompt: bool, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The variables apply_chat_template passes (its special tokens, the caller's kwargs over
    them), converted to plain data as transformers does where it can."""
    from transformers.utils import chat_template_utils as utils

    plain = getattr(utils, "_plain_template_data", lambda value: value)
    normalize = getattr(utils, "_normalize_chat_messages", lambda value: value)
    alias = getattr(utils, "_alias_reasoning_fields", lambda value: value)
    template_kwargs = plain({**getattr(tokenizer, "special_tokens_map", {}), **kwargs})
    return {"messages": alias(plain(normalize(conversation))), "tools": plain(tools), "documents": None,
            "add_generation_prompt": add_generation_prompt, **template_kwargs}


def render_template(tokenizer: Any, template: str, conversation: list[dict[str, Any]],
                    tools: list[dict[str, Any]] | None, add_generation_prompt: bool, kwargs: dict[str, Any],
                    max_bytes: int, timeout_s: float) -> str:
    """The prompt text, as tokenizer.apply_chat_template(conversation, chat_template=template,
    tools=tools, tokenize=False, ...) renders it; TemplateRenderError past `timeout_s` seconds or
    `max_bytes` UTF-8 bytes of output. Blocking: call it off the event loop."""
    budget = _budget
    budget.deadline, budget.max_bytes = time.monotonic() + timeout_s, max_bytes
    previous_trace = sys.gettrace()
    sys.settrace(_trace_calls)
    try:
        compiled = compile_template(template)
        chunks, size = [], 0
        for chunk in compiled.generate(**_template_context(tokenizer, conversation, tools, add_generation_prompt,
                                                           kwargs)):
            size += len(chunk.encode("utf-8", "surrogatepass"))
            if size > max_bytes:
                raise TemplateRenderError(f"the chat template rendered more than {max_bytes} bytes")
            chunks.append(chunk)
            _check_deadline()
        return "".join(chunks)
    except TemplateRenderError:
        raise
    except RecursionError as e:
        raise TemplateRenderError("the chat template recursed too deeply") from e
    except MemoryError as e:
        raise TemplateRenderError("the chat template ran out of memory") from e
    except Exception as e:  # jinja2 errors, a template's raise_exception(...)
        raise TemplateRenderError(f"cannot render the messages with the chat template: {e}") from e
    finally:
        sys.settrace(previous_trace)
        budget.deadline, budget.max_bytes = math.inf, 1 << 62


def _trace_calls(frame: Any, event: str, arg: Any) -> Any:
    """Trace only the template's own frames, line by line, for the deadline."""
    if frame.f_code.co_filename == _TEMPLATE_FILENAME:
        return _trace_lines
    return None


def _trace_lines(frame: Any, event: str, arg: Any) -> Any:
    if event == "line" and time.monotonic() > _budget.deadline:
        raise TemplateRenderError("the chat template ran past its time limit")
    return _trace_lines
