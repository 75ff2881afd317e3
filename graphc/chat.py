"""Chat templates rendered as transformers renders them, with a time budget and a bound on the text.

transformers' ``apply_chat_template`` renders a checkpoint's Jinja template in an ``ImmutableSandboxedEnvironment``
with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension and a ``{% generation %}`` block tag, its
own ``tojson`` filter (``ensure_ascii``, ``indent``, ``separators``, ``sort_keys``), the globals ``raise_exception``,
``strftime_now``, ``dict`` and ``namespace``, and the variables ``messages``, ``tools`` (None), ``documents`` (None),
``add_generation_prompt`` and every named special token of the tokenizer.  :func:`render_chat` does the same, so a
template that tests ``tools is not none`` or prints today's date gives the prompt transformers gives.  A template
that runs past :data:`RENDER_SECONDS` or writes more than :data:`MAX_PROMPT_CHARS` characters is refused by name
(before any tokenizer sees the text).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import datetime
from typing import Any

from .errors import SerializationError

__all__ = ["render_chat", "SPECIAL_TOKEN_NAMES", "RENDER_SECONDS", "MAX_PROMPT_CHARS", "ChatTemplateError"]

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""The special tokens transformers hands a chat template by name (its ``SPECIAL_TOKENS_ATTRIBUTES``)."""

RENDER_SECONDS = 10.0
"""How long one chat template may render."""

MAX_PROMPT_CHARS = 1 << 22
"""The most characters a rendered prompt (or a prompt given as text) may hold: 4 Mi, far past any model's context."""


class ChatTemplateError(SerializationError):
    """A chat template failed, refused the conversation, ran too long or wrote too much."""


class _TemplateTimeout(BaseException):
    """Raised inside a render that ran past its budget (a BaseException, so the template cannot catch it)."""


def render_chat(
    template: str,
    messages: list[dict[str, Any]],
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True,
    where: str = "the chat template",
    seconds: float | None = None,
    max_chars: int | None = None,
) -> str:
    """The text of ``messages`` in ``template``, rendered as transformers' ``apply_chat_template(messages,
    add_generation_prompt=..., tokenize=False)`` renders it (``tools`` and ``documents`` None); ``special_tokens``: the
    tokenizer's named special tokens as text; ``seconds`` and ``max_chars`` default to :data:`RENDER_SECONDS` and
    :data:`MAX_PROMPT_CHARS`.  Raises :class:`ChatTemplateError` naming ``where``."""
    seconds = RENDER_SECONDS if seconds is None else seconds
    max_chars = MAX_PROMPT_CHARS if max_chars is None else max_chars
    try:
        compiled = _environment().from_string(template)
    except ImportError:
        raise
    except Exception as e:  # noqa: BLE001 - a template syntax error, named
        raise ChatTemplateError(f"{where} does not parse: {type(e).__name__}: {e}") from None
    variables = {**special_tokens, "messages": messages, "tools": None, "documents": None, "add_generation_prompt": add_generation_prompt}
    pieces: list[str] = []
    size = 0
    deadline = time.monotonic() + seconds
    try:
        with _alarm(seconds):
            for piece in compiled.generate(**variables):
                pieces.append(piece)
                size += len(piece)
                if size > max_chars:
                    raise ChatTemplateError(f"{where} wrote more than {max_chars:,} characters for one conversation; refused")
                if time.monotonic() > deadline:
                    raise _TemplateTimeout
    except _TemplateTimeout:
        raise ChatTemplateError(f"{where} ran for more than {seconds:g} s without finishing; refused") from None
    except ChatTemplateError:
        raise
    except Exception as e:  # noqa: BLE001 - a template error, named
        raise ChatTemplateError(f"{where} failed: {type(e).__name__}: {e}") from None
    return "".join(pieces)


@contextmanager
def _alarm(seconds: float) -> Iterator[None]:
    """Interrupt the block after ``seconds`` (a loop that writes nothing is stopped too); only the main thread can
    take a signal, elsewhere the render is checked between the pieces it writes."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum: int, frame: Any) -> None:
        raise _TemplateTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _environment() -> Any:
    """transformers' chat-template environment (``_compile_jinja_template``)."""
    try:
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise SerializationError("chat templates need the jinja2 library: pip install jinja2") from None

    class GenerationBlock(Extension):
        """``{% generation %}...{% endgeneration %}``: marks the assistant's text for training masks; renders its body."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    class TemplateDict:
        """``dict(...)`` without attribute access to the type."""

        def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        """``namespace(...)`` that refuses underscore-prefixed attributes."""

        def __init__(*args: Any, **kwargs: Any) -> None:
            self, rest = args[0], args[1:]
            attrs = dict(*rest, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template cannot store the underscore-prefixed attribute {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _raise_exception(message: Any) -> None:
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")
