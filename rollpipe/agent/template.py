"""Chat-template renders without transformers' per-call work: the same text, cheaper.

``tokenizer.apply_chat_template(messages, tokenize=False, ...)`` compiles the template
once, then on every call picks the template, checks the tools, and renders in Jinja's
immutable sandbox, which decides for every attribute the template reads (``loop.first``,
``message.get``, ``content.startswith``) whether it is safe: ``isinstance`` checks
against the abstract mutable types, most of a short render. A decision depends only on
the object's type and the attribute's name, so :func:`template_renderer` keeps them per
``(type, name)`` and renders the same template source, with the same variables
(``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the tokenizer's
special tokens), in an overlay of transformers' own environment (its filters, globals
and extensions). Same text, about half the time of a window render here. Where that
cannot be promised (a tokenizer that overrides ``apply_chat_template``, a template
chosen by name, another transformers) it gives ``None`` and callers keep
``apply_chat_template``.

Examples:
    >>> render = template_renderer(tokenizer)
    >>> talk = [{"role": "user", "content": "Hi"}]
    >>> render(talk, True, None) == tokenizer.apply_chat_template(
    ...     talk, tokenize=False, add_generation_prompt=True)
    True
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["KeptJson", "Render", "template_renderer"]

Render = Callable[[Sequence[Mapping[str, Any]], bool, "list[dict[str, Any]] | None"], str]
"""``render(messages, add_generation_prompt, tools)``: the template's text."""

_COMPILED: dict[str, Any] = {}  # template source -> the overlay's compiled template
_LOCK = threading.Lock()


class KeptJson(dict):  # type: ignore[type-arg]
    """A dict that keeps the text the template's ``tojson`` filter gives it (no options),
    made at its first render: a template dumps each tool schema and each call's
    arguments on every render otherwise (~5 µs each). Only rollpipe's own copies are
    made so (a dialog's template forms and tool schemas), and none changes once made
    (the template's sandbox cannot change it either)."""

    __slots__ = ("kept",)
    kept: tuple[Any, str]  # (the filter, its text): set at the first render

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled and copied as a plain dict (the filter it keeps does not pickle)."""
        return (dict, (dict(self),))


def template_renderer(tokenizer: Any) -> Render | None:
    """A render of ``tokenizer``'s chat template equal to its ``apply_chat_template``
    (``tokenize=False``, tools as schema dicts, no documents), or None where that equality
    is not known (see the module doc)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.utils import chat_template_utils
    except ImportError:
        return None
    source = getattr(tokenizer, "chat_template", None)
    same = (
        type(tokenizer).apply_chat_template is PreTrainedTokenizerBase.apply_chat_template
        and type(tokenizer).get_chat_template is PreTrainedTokenizerBase.get_chat_template
        and isinstance(source, str)
        and hasattr(chat_template_utils, "_compile_jinja_template")
    )
    if not same or not isinstance(source, str):
        return None
    compile_template = chat_template_utils._compile_jinja_template
    current: list[Any] = [source, _compiled(source, compile_template)]

    def render(
        messages: Sequence[Mapping[str, Any]],
        generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
    ) -> str:
        if not messages:  # apply_chat_template's own error
            raise ValueError("Cannot apply chat template to an empty conversation.")
        source = tokenizer.chat_template
        if source is not current[0]:  # the tokenizer's template was changed since
            if not isinstance(source, str):
                raise ValueError(
                    "the tokenizer's chat_template is no longer one template string; build "
                    "the ChatFormat again after changing it"
                )
            current[:] = [source, _compiled(source, compile_template)]
        text: str = current[1].render(
            messages=messages,
            tools=tools,
            documents=None,
            add_generation_prompt=generation_prompt,
            **tokenizer.special_tokens_map,
        )
        return text

    return render


def _compiled(source: str, compile_template: Callable[[str], Any]) -> Any:
    """``source`` compiled in an overlay of transformers' environment whose sandbox
    decisions are kept per ``(type, attribute)``; one per template source."""
    with _LOCK:
        found = _COMPILED.get(source)
        if found is None:
            environment = compile_template(source).environment.overlay()
            decide = type(environment).is_safe_attribute
            decisions: dict[tuple[type, str], bool] = {}

            def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
                key = (type(obj), attr)
                safe = decisions.get(key)
                if safe is None:
                    safe = decisions[key] = bool(decide(environment, obj, attr, value))
                return safe

            environment.is_safe_attribute = is_safe_attribute
            _plain_reads(environment, decisions)
            dumps = environment.filters.get("tojson")
            if dumps is not None:  # a KeptJson's text, dumped once by the filter itself

                def tojson(value: Any, *args: Any, **kwargs: Any) -> Any:
                    if type(value) is not KeptJson or args or kwargs:
                        return dumps(value, *args, **kwargs)
                    kept = getattr(value, "kept", None)
                    if kept is None or kept[0] is not dumps:
                        kept = value.kept = (dumps, dumps(value))
                    return kept[1]

                environment.filters = {**environment.filters, "tojson": tojson}
            found = _COMPILED[source] = environment.from_string(source)
        return found


_PLAIN = (dict, str)  # builtin types whose attributes are their class's (no instance ones)
_FORMATS = ("format", "format_map")  # str methods the sandbox wraps (wrap_str_format)


def _plain_reads(environment: Any, decisions: dict[tuple[type, str], bool]) -> None:
    """The sandbox's ``getattr`` and ``call`` made cheaper where their answer is known:
    an attribute of a dict, a str or a loop (``message.get``, ``loop.first``) already
    decided safe is returned as the sandbox would (no ``str.format`` wrap applies to
    another name), and a dict's or a str's builtin method is called as the context would
    call it (it takes no context, and none is unsafe); anything else goes to the
    sandbox's own."""
    from jinja2.runtime import LoopContext

    readable = (*_PLAIN, LoopContext)
    sandbox_getattr, sandbox_call = environment.getattr, environment.call
    undefined, builtin_getattr = environment.undefined, getattr
    method: Any = types.BuiltinMethodType  # a builtin's bound method ({}.get)

    def read(obj: Any, attribute: str) -> Any:
        kind = type(obj)
        if kind in readable and attribute not in _FORMATS and decisions.get((kind, attribute)):
            try:
                return builtin_getattr(obj, attribute)
            except AttributeError:
                pass
        return sandbox_getattr(obj, attribute)

    def call(__context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        if type(__obj) is method and type(getattr(__obj, "__self__", None)) in _PLAIN:
            kwargs.pop("_block_vars", None)
            kwargs.pop("_loop_vars", None)
            try:
                return __obj(*args, **kwargs)
            except StopIteration:
                return undefined(
                    "value was undefined because a callable raised a StopIteration exception"
                )
        return sandbox_call(__context, __obj, *args, **kwargs)

    environment.getattr, environment.call = read, call
