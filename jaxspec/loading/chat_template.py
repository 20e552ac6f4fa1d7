"""Render a model's Jinja chat template in a sandbox, the way Hugging Face transformers renders it.

Chat templates come with downloaded models and are untrusted code. They run in jinja2's
ImmutableSandboxedEnvironment, tightened further: any access to an unsafe attribute (``__class__``,
``__globals__``, ...) fails at once instead of rendering as an empty string, namespaces refuse
underscore names, and rendering runs under limits (`TemplateLimits`):

* time: at most ``time_s`` seconds (default 2; env ``JAXSPEC_TEMPLATE_TIME_S``). In the main thread a
  SIGALRM interval timer interrupts any Python-level loop; in other threads the deadline is checked
  at every call, attribute/item lookup, operator, concatenation and output chunk the template makes.
* size: no string or list the template builds, and not its output, may exceed ``max_chars``
  characters / items (default 4,000,000; env ``JAXSPEC_TEMPLATE_MAX_CHARS``). Operations that could
  allocate more are refused *before* they allocate: ``*`` and ``+`` on sequences, ``~``, ``%`` and
  ``str.format`` widths and precisions, ``center``/``ljust``/``rjust``/``zfill``/``expandtabs``,
  ``replace``, ``join`` (as methods and as filters), ``**`` with a huge result, ``range`` beyond
  jinja2's 100,000 items.

Every failure (syntax, ``raise_exception``, sandbox escape, a limit, a Python error inside the
template, recursion) is a `TemplateError` whose message starts with the template's source (the model
file) when the caller gives it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import json
import math
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedFormatter
from markupsafe import EscapeFormatter, Markup

from jaxspec.errors import InputError, TemplateError

TIME_ENV = "JAXSPEC_TEMPLATE_TIME_S"
MAX_CHARS_ENV = "JAXSPEC_TEMPLATE_MAX_CHARS"
MAX_POWER_BITS = 100_000  # largest integer `**` may build (bits)


@dataclasses.dataclass(frozen=True)
class TemplateLimits:
    """Resource limits of one chat-template rendering.

    time_s: wall-clock limit in seconds. max_chars: longest string / list the template may build,
    and longest output.
    """

    time_s: float = 2.0
    max_chars: int = 4_000_000

    def __post_init__(self) -> None:
        if not (isinstance(self.time_s, (int, float)) and self.time_s > 0 and math.isfinite(self.time_s)):
            raise InputError(f"TemplateLimits.time_s must be a finite number > 0, got {self.time_s!r}")
        if not (isinstance(self.max_chars, int) and self.max_chars >= 1):
            raise InputError(f"TemplateLimits.max_chars must be an integer >= 1, got {self.max_chars!r}")

    @classmethod
    def from_env(cls) -> TemplateLimits:
        """The defaults, overridden by JAXSPEC_TEMPLATE_TIME_S / JAXSPEC_TEMPLATE_MAX_CHARS if set."""
        values: dict[str, Any] = {}
        for name, env, kind in (("time_s", TIME_ENV, float), ("max_chars", MAX_CHARS_ENV, int)):
            text = os.environ.get(env)
            if text:
                try:
                    values[name] = kind(text)
                except ValueError:
                    raise InputError(f"{env}={text!r} is not a valid {kind.__name__}") from None
        return cls(**values)


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool,
    bos_token: str,
    eos_token: str,
    source: str | None = None,
    limits: TemplateLimits | None = None,
    **extra: Any,
) -> str:
    """Render `messages` (list of {"role": str, "content": str, ...}) with a chat template.

    Raises InputError for malformed messages (naming the index and field) and TemplateError for a
    template that does not compile, calls raise_exception, tries to leave the sandbox, fails inside,
    or passes a limit (`limits`, default `TemplateLimits.from_env()`). `source` (the model file the
    template came from) prefixes every TemplateError message.
    """
    validate_messages(messages)
    prefix = f"{source}: " if source else ""
    if not isinstance(template, str):
        raise TemplateError(f"{prefix}chat template must be a string, got {type(template).__name__}")
    limits = limits if limits is not None else TemplateLimits.from_env()
    try:
        compiled = _compile(template)
    except TemplateError as error:
        raise TemplateError(f"{prefix}{error}") from None
    context = dict(
        messages=[dict(message) for message in messages],
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **extra,
    )
    try:
        return _render_limited(compiled, context, limits)
    except _LimitExceeded as error:
        raise TemplateError(f"{prefix}chat template stopped: {error}") from None
    except SecurityError as error:
        raise TemplateError(f"{prefix}chat template tried to escape its sandbox: {error}") from None
    except _TemplateRaised as error:
        raise TemplateError(f"{prefix}chat template raised an exception: {error}") from None
    except RecursionError:
        raise TemplateError(f"{prefix}chat template failed to render: recursion too deep") from None
    except MemoryError:
        raise TemplateError(f"{prefix}chat template failed to render: out of memory") from None
    except jinja2.TemplateError as error:
        kind = type(error).__name__
        raise TemplateError(f"{prefix}chat template failed to render: {kind}: {error}") from None
    except (ArithmeticError, TypeError, ValueError, LookupError, AttributeError) as error:
        kind = type(error).__name__
        raise TemplateError(f"{prefix}chat template failed to render: {kind}: {error}") from None


def validate_messages(messages: Any) -> None:
    """Messages must be a list of dicts, each with string 'role' and 'content'."""
    if not isinstance(messages, (list, tuple)):
        raise InputError(f"messages must be a list of dicts, got {type(messages).__name__}")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InputError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        for field in ("role", "content"):
            if field not in message:
                raise InputError(f"messages[{index}] lacks the field {field!r}")
            if not isinstance(message[field], str):
                kind = type(message[field]).__name__
                raise InputError(f"messages[{index}][{field!r}] must be a string, got {kind}")


class _TemplateRaised(Exception):
    """A template called raise_exception(message)."""


class _LimitExceeded(Exception):
    """The rendering passed its time or size limit."""


@dataclasses.dataclass(frozen=True)
class _Budget:
    deadline: float  # time.monotonic() value
    limits: TemplateLimits

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _LimitExceeded(f"ran past its time limit of {self.limits.time_s:g} s (set {TIME_ENV})")

    def check_size(self, size: int, what: str) -> None:
        if size > self.limits.max_chars:
            raise _LimitExceeded(
                f"{what} of {size:,} is over the limit of {self.limits.max_chars:,} characters / items "
                f"(set {MAX_CHARS_ENV})"
            )


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("template_budget", default=None)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # rendered outside render_chat_template: the default limits, starting now
        return _Budget(time.monotonic() + TemplateLimits().time_s, TemplateLimits())
    return budget


def _render_limited(compiled: jinja2.Template, context: dict[str, Any], limits: TemplateLimits) -> str:
    budget = _Budget(time.monotonic() + limits.time_s, limits)
    token = _BUDGET.set(budget)
    try:
        with _alarm(limits.time_s):
            size, chunks = 0, []
            for chunk in compiled.generate(**context):
                size += len(chunk)
                budget.check_size(size, "output")
                budget.check_time()
                chunks.append(chunk)
            return "".join(chunks)
    finally:
        _BUDGET.reset(token)


@contextlib.contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Raise _LimitExceeded after `seconds` via SIGALRM: main thread only, and only when no other
    interval timer is running (otherwise the budget's checks alone enforce the deadline)."""
    usable = (
        hasattr(signal, "setitimer")
        and threading.current_thread() is threading.main_thread()
        and signal.getitimer(signal.ITIMER_REAL)[0] == 0
    )
    if not usable:
        yield
        return

    def on_alarm(signum: int, frame: Any) -> None:
        raise _LimitExceeded(f"ran past its time limit of {seconds:g} s (set {TIME_ENV})")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


def _check_percent_format(text: str, values: Any) -> None:
    """`text % values`: refuse widths / precisions (literal or `*`) beyond the size limit."""
    budget = _budget()
    star = False
    for match in _PERCENT_SPEC.finditer(text):
        for group in match.groups():
            if group == "*":
                star = True
            elif group:
                budget.check_size(int(group), "format width / precision")
    if star:
        for value in values if isinstance(values, tuple) else (values,):
            if isinstance(value, int):
                budget.check_size(abs(value), "format width / precision")


def _check_format_spec(spec: str) -> None:
    for digits in _DIGITS.findall(spec):
        _budget().check_size(int(digits), "format width / precision")


class _BoundedFormatter(SandboxedFormatter):
    """str.format in the sandbox, refusing huge widths / precisions (checked after nested fields)."""

    def format_field(self, value: Any, format_spec: str) -> Any:
        _check_format_spec(format_spec)
        return super().format_field(value, format_spec)


class _BoundedEscapeFormatter(_BoundedFormatter, EscapeFormatter):
    pass


def _sequence_length(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


def _check_string_method(obj: str, name: str, args: tuple, kwargs: dict) -> tuple:
    """Refuse a str method call whose result would pass the size limit, before it allocates.
    Returns the arguments to call it with (an iterable given to `join` is read into a list here)."""
    budget = _budget()
    first = args[0] if args else None
    if name in ("center", "ljust", "rjust", "zfill") and isinstance(first, int):
        budget.check_size(first, f"str.{name} width")
    elif name == "expandtabs":
        tab = first if first is not None else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            budget.check_size(len(obj) + obj.count("\t") * max(tab, 0), "str.expandtabs result")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        budget.check_size(_replaced_length(obj, args[0], args[1]), "str.replace result")
    elif name == "join" and args:
        parts = list(first)
        budget.check_size(len(parts), "join input")
        budget.check_size(sum(len(str(p)) for p in parts) + len(obj) * len(parts), "str.join result")
        return (parts, *args[1:])
    return args


def _replaced_length(text: str, old: str, new: str) -> int:
    count = len(text) + 1 if not old else text.count(old)
    return len(text) + count * (len(new) - len(old))


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, failing loudly on unsafe attributes, bounding time and sizes."""

    intercepted_binops = frozenset(["*", "+", "%", "**"])

    def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is unsafe")

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.check_time()
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                length = _sequence_length(sequence)
                if length is not None and isinstance(count, int):
                    budget.check_size(length * count, "sequence built with `*`")
        elif operator == "+":
            left_length, right_length = _sequence_length(left), _sequence_length(right)
            if left_length is not None and right_length is not None:
                budget.check_size(left_length + right_length, "sequence built with `+`")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left, right)
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
            bits = right * max(abs(left).bit_length() - 1, 0)
            if bits > MAX_POWER_BITS:
                raise _LimitExceeded(f"`**` result of about {bits:,} bits is over {MAX_POWER_BITS:,} bits")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _budget().check_time()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            args = _check_string_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def getattr(self, obj: Any, attribute: str) -> Any:
        _budget().check_time()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _budget().check_time()
        return super().getitem(obj, argument)

    def concat(self, parts: tuple) -> str:
        """`a ~ b ~ ...` (the code generator routes `~` here)."""
        texts = [str(part) for part in parts]
        budget = _budget()
        budget.check_time()
        budget.check_size(sum(len(t) for t in texts), "string built with `~`")
        joined = "".join(texts)
        return Markup(joined) if any(isinstance(p, Markup) for p in parts) else joined

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        owner = value.__self__
        formatter = _BoundedEscapeFormatter(self, escape=owner.escape) if isinstance(owner, Markup) else None
        formatter = formatter or _BoundedFormatter(self)
        is_format_map = value.__name__ == "format_map"

        def bounded(*args: Any, **kwargs: Any) -> str:
            if is_format_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one positional argument")
                args, kwargs = (), args[0]
            return type(owner)(formatter.vformat(owner, args, kwargs))

        return functools.update_wrapper(bounded, value)


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles `~` to `environment.concat(...)`, so that the sandbox bounds what it builds."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:  # noqa: N802 (jinja2's name)
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _center(value: Any, width: int = 80) -> str:
    text = str(value)
    if isinstance(width, int):
        _budget().check_size(width, "center width")
    return text.center(width)


def _replace(value: Any, old: str, new: str, count: int | None = None) -> str:
    text, old, new = str(value), str(old), str(new)
    _budget().check_size(_replaced_length(text, old, new), "replace result")
    return text.replace(old, new, -1 if count is None else count)


def _format(value: Any, *args: Any, **kwargs: Any) -> str:
    if args and kwargs:
        raise jinja2.FilterArgumentError("can't handle positional and keyword arguments at the same time")
    text = str(value)
    _check_percent_format(text, kwargs or args)
    return text % (kwargs or args)


def _indent(value: Any, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    text = str(value)
    pad = width if isinstance(width, str) else " " * _bounded_int(width, "indent width")
    _budget().check_size(len(text) + (text.count("\n") + 1) * len(pad), "indent result")
    lines = text.split("\n")
    out = [line if (not blank and not line.strip()) else pad + line for line in lines[1:]]
    head = pad + lines[0] if first else lines[0]
    return "\n".join([head, *out])


def _bounded_int(value: Any, what: str) -> int:
    number = int(value)
    _budget().check_size(number, what)
    return number


def _join(value: Any, separator: str = "", attribute: Any = None) -> str:
    parts = list(value)
    budget = _budget()
    budget.check_size(len(parts), "join input")
    if attribute is not None:
        raise jinja2.FilterArgumentError("join(attribute=...) is not supported in chat templates")
    texts = [str(p) for p in parts]
    budget.check_size(sum(len(t) for t in texts) + len(str(separator)) * len(texts), "join result")
    return str(separator).join(texts)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (marks assistant text in transformers): renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


class _SafeNamespace(jinja2.utils.Namespace):
    """jinja2's `namespace()` that refuses attribute names starting with an underscore and values
    over the size limit (`{% set ns.s = ns.s ~ ns.s %}` in a loop)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja2's own signature trick)
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        length = _sequence_length(value)
        if length is not None:
            _budget().check_size(length, f"namespace value {name!r}")
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"namespace attribute {name!r} starts with an underscore")


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


MAX_JSON_INDENT = 64


def _tojson(value: Any, ensure_ascii: bool = False, indent: Any = None, **options: Any) -> str:
    """jinja's tojson without HTML escaping (as transformers does); passes separators / sort_keys on."""
    width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    if width > MAX_JSON_INDENT:
        raise _LimitExceeded(f"tojson indent {width} is over {MAX_JSON_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **options)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _make_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
    return dict(*args, **kwargs)


@functools.lru_cache(maxsize=32)
def _compile(template: str) -> jinja2.Template:
    environment = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    environment.code_generator_class = _BoundedCodeGenerator
    environment.filters.update(center=_center, replace=_replace, format=_format, indent=_indent, join=_join)
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _make_dict
    environment.globals["namespace"] = _SafeNamespace
    try:
        return environment.from_string(template)
    except jinja2.TemplateSyntaxError as error:
        raise TemplateError(f"chat template syntax error at line {error.lineno}: {error.message}") from None
