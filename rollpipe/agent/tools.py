"""Tool declarations: OpenAI function schemas, or typed Python callables turned into them.

An env declares its tools as a sequence of either. A callable's schema comes from
transformers' ``get_json_schema`` (type hints plus a Google-style docstring with an
``Args:`` section), the helper chat templates are written against; a dict is taken as an
OpenAI function schema (``{"type": "function", "function": {"name", "description",
"parameters"}}``; the bare ``function`` part is accepted too). The schemas reach the
prompt through the tokenizer's own chat template (``tools=``).

A tool's callable runs on a worker thread under its time limit, unless it declares
``blocking = False`` (a function attribute, as an env's class declares it): a fast, pure
tool such as the calculator then runs inline on the event loop, which costs less than the
thread hop; every episode waits while it runs.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Tool", "ToolSet", "runs_inline", "schemas_key"]

Tool = Callable[..., Any] | Mapping[str, Any]
"""A typed callable with a docstring, or an OpenAI function schema."""


def runs_inline(fn: Callable[..., Any]) -> bool:
    """Whether a tool's callable declares ``blocking = False`` (fast and pure: run inline
    on the event loop) and is not a coroutine function (those are awaited).

    Examples:
        >>> def double(x: int) -> int:
        ...     return 2 * x
        >>> double.blocking = False
        >>> runs_inline(double), runs_inline(print)
        (True, False)
    """
    return getattr(fn, "blocking", True) is False and not inspect.iscoroutinefunction(fn)


def _binds_by_schema(schema: Mapping[str, Any], functions: Mapping[str, Any]) -> bool:
    """Whether every argument set the schema accepts binds to the callable: its
    parameters are all named ones (no ``*args``, ``**kwargs`` or positional-only), the
    schema's properties are exactly their names, its required ones exactly those without
    a default, and it takes no other names (``additionalProperties`` unset or false)."""
    function = schema["function"]
    fn = functions.get(function["name"])
    parameters = function.get("parameters", {})
    if fn is None or parameters.get("additionalProperties", False) is not False:
        return False
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    params = signature.parameters.values()
    if any(p.kind not in named for p in params):
        return False
    needed = {p.name for p in params if p.default is inspect.Parameter.empty}
    return (
        set(parameters.get("properties", {}) or {}) == {p.name for p in params}
        and set(parameters.get("required", []) or []) == needed
    )


_SCHEMAS: weakref.WeakKeyDictionary[Any, tuple[Any, dict[str, Any]]] = (
    weakref.WeakKeyDictionary()
)  # a callable -> (what its schema was made from, the schema): made once per callable


def _schema_of_callable(fn: Callable[..., Any]) -> dict[str, Any]:
    """``fn``'s schema (transformers' ``get_json_schema``), kept per callable while its
    name, docstring and annotations stay what they were (~0.5 ms a schema: an env built
    per episode slot builds its tools again); each caller gets its own copy."""
    source = (
        getattr(fn, "__name__", None),
        getattr(fn, "__doc__", None),
        dict(getattr(fn, "__annotations__", None) or {}),
    )
    try:
        kept = _SCHEMAS.get(fn)
    except TypeError:  # not weakly referable, or unhashable: made each time
        kept = None
    if kept is not None and kept[0] == source:
        return copy.deepcopy(kept[1])
    schema = _made_schema(fn)
    with contextlib.suppress(TypeError):  # not weakly referable: not kept
        _SCHEMAS[fn] = (source, copy.deepcopy(schema))
    return schema


def _made_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    from transformers.utils import get_json_schema

    try:
        return dict(get_json_schema(fn))
    except Exception as exc:  # transformers' DocstringParsingException / TypeHintParsingException
        name = getattr(fn, "__name__", repr(fn))
        raise ValueError(
            f"tool {name!r}: no schema could be made from it ({exc}); give every argument a "
            "type hint and the function a docstring with an Args: section describing each, "
            "or pass an OpenAI function schema dict instead"
        ) from exc


def _schema_of_dict(schema: Mapping[str, Any]) -> dict[str, Any]:
    function = (
        schema.get("function", schema) if schema.get("type", "function") == "function" else None
    )
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(
            f"tool schema {schema!r} is not an OpenAI function schema; write "
            '{"type": "function", "function": {"name": ..., "description": ..., '
            '"parameters": {"type": "object", "properties": {...}}}}'
        )
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping):
        raise ValueError(
            f"tool {function['name']!r}: parameters must be a dict, got {parameters!r}"
        )
    return {"type": "function", "function": {**function, "parameters": dict(parameters)}}


class ToolSet:
    """An env's tools: their schemas (for the template) and callables (to run them).

    ``ToolSet([add, {"type": "function", "function": {...}}])``: a dict-declared tool has
    a schema but nothing to run unless ``functions`` maps its name to a callable.

    Examples:
        >>> def add(a: int, b: int) -> int:
        ...     '''Add two integers.
        ...
        ...     Args:
        ...         a: the first addend
        ...         b: the second addend
        ...     '''
        ...     return a + b
        >>> tools = ToolSet([add, {"type": "function", "function": {"name": "search"}}])
        >>> tools.names, sorted(tools.parameters("add")["properties"]), sorted(tools.functions)
        (('add', 'search'), ['a', 'b'], ['add'])
    """

    def __init__(
        self, tools: Sequence[Tool] = (), functions: Mapping[str, Callable[..., Any]] | None = None
    ) -> None:
        if isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence):
            raise ValueError(f"tools must be a list of callables or schema dicts, got {tools!r}")
        self.schemas: tuple[dict[str, Any], ...] = ()
        self.functions: dict[str, Callable[..., Any]] = dict(functions or {})
        schemas = []
        for tool in tools:
            if isinstance(tool, Mapping):
                schemas.append(_schema_of_dict(tool))
            elif callable(tool):
                schema = _schema_of_callable(tool)
                schemas.append(schema)
                self.functions.setdefault(schema["function"]["name"], tool)
            else:
                raise ValueError(f"tool {tool!r} is neither a callable nor a schema dict")
        names = [s["function"]["name"] for s in schemas]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tools: names {repeated} are declared more than once")
        self.schemas = tuple(schemas)
        self._names = tuple(names)
        self._parameters = {s["function"]["name"]: s["function"]["parameters"] for s in schemas}
        self.inline = frozenset(n for n, fn in self.functions.items() if runs_inline(fn))
        """The names of the tools that run inline (:func:`runs_inline`)."""
        self.bound_by_schema = frozenset(
            s["function"]["name"] for s in schemas if _binds_by_schema(s, self.functions)
        )
        """The tools whose schema says all their signature does: arguments that pass the
        schema's check (required names present, no others) bind to it."""
        self._signatures: dict[str, inspect.Signature] = {}
        self._key: str | None = None

    @property
    def key(self) -> str:
        """The schemas as sorted JSON (equal schemas, equal keys; made once: a tool set's
        schemas do not change once it is made)."""
        if self._key is None:
            self._key = schemas_key(self.schemas)
        return self._key

    def signature(self, name: str) -> inspect.Signature:
        """Tool ``name``'s callable's signature (read once: ~10 µs a call otherwise)."""
        found = self._signatures.get(name)
        if found is None:
            found = self._signatures[name] = inspect.signature(self.functions[name])
        return found

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    def parameters(self, name: str) -> Mapping[str, Any]:
        """The JSON schema of tool ``name``'s arguments (``KeyError`` for an unknown name)."""
        parameters: Mapping[str, Any] = self._parameters[name]
        return parameters

    def __len__(self) -> int:
        return len(self.schemas)

    def __bool__(self) -> bool:
        return bool(self.schemas)


def schemas_key(schemas: Sequence[Mapping[str, Any]]) -> str:
    """Tool schemas as sorted JSON: equal schemas, equal keys."""
    return json.dumps(list(schemas), sort_keys=True, default=repr)


def tool_set(value: ToolSet | Sequence[Tool] | None) -> ToolSet:
    """``value`` as a :class:`ToolSet` (``None``: no tools)."""
    if isinstance(value, ToolSet):
        return value
    return ToolSet(() if value is None else value)
