"""The protocol's records: request parameters, results and errors.

Frozen attrs classes validated at construction, so a bad value fails where it is
written, with a message naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import attrs

from rollpipe._utils.checks import check_int, float_in, int_at_least, int_in
from rollpipe.runtime import RuntimeClosedError

__all__ = [
    "FINISH_REASONS",
    "STRUCTURED_KINDS",
    "EngineClosedError",
    "EngineError",
    "Generation",
    "SamplingParams",
]

FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")


class EngineError(RuntimeError):
    """The engine failed (died, rejected a request, or a weight update went wrong).

    Examples:
        >>> from rollpipe.engines.scripted import ScriptedEngine
        >>> with ScriptedEngine(lambda prompt, params: [7]) as scripted:
        ...     try:  # a scripted engine has no top log-probs to give
        ...         scripted.generate_batch([[1, 2]], SamplingParams(top_logprobs=2))
        ...     except EngineError as e:
        ...         print(e)
        SamplingParams.top_logprobs=2: ScriptedEngine does not support top_logprobs; ...
    """


class EngineClosedError(EngineError, RuntimeClosedError):
    """The engine was closed; create a new one to generate again.

    Also a ``RuntimeClosedError``: ``except RuntimeClosedError`` catches every close
    (the engine's, the pipeline's) that woke a waiting call.

    Examples:
        >>> from rollpipe.engines.scripted import ScriptedEngine
        >>> scripted = ScriptedEngine(lambda prompt, params: [7])
        >>> scripted.close()
        >>> try:
        ...     scripted.generate_batch([[1, 2]], SamplingParams())
        ... except EngineClosedError as e:
        ...     print(isinstance(e, EngineError), e)
        True ScriptedEngine is closed; create a new engine to generate again
    """


def _token_ids(value: Any) -> tuple[int, ...]:
    if isinstance(value, int):
        value = (value,)
    return tuple(int(v) if isinstance(v, int) and not isinstance(v, bool) else v for v in value)


def _check_stop_ids(inst: Any, attr: attrs.Attribute[Any], value: tuple[Any, ...]) -> None:
    for i, v in enumerate(value):
        check_int(f"SamplingParams.stop_token_ids[{i}]", v, 0)


def _check_seed(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is not None:
        check_int("SamplingParams.seed", value, 0)


def _check_bool(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{type(inst).__name__}.{attr.name} must be a bool, got {value!r}")


STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
"""What ``SamplingParams.structured_outputs`` may hold: vLLM's ``StructuredOutputsParams``."""


def _structured_text(value: Any) -> Any:
    """Structured outputs given as a dict are stored as JSON text (the params stay
    hashable)."""
    return json.dumps(value, sort_keys=True) if isinstance(value, dict) else value


def _check_structured(inst: Any, attr: attrs.Attribute[Any], value: Any) -> None:
    if value is None:
        return
    try:
        spec = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError as exc:
        spec, value = None, f"{value[:80]!r} ({exc})"
    if not isinstance(spec, dict) or not spec or not set(spec) <= set(STRUCTURED_KINDS):
        raise ValueError(
            f"SamplingParams.structured_outputs must be an object (a dict or its JSON text) "
            f"with one of {STRUCTURED_KINDS}, as vLLM's StructuredOutputsParams, e.g. "
            f'{{"json": <a JSON schema>}}; got {value!r}'
        )


@attrs.frozen
class SamplingParams:
    """How to sample one completion. ``temperature=0`` is greedy; ``top_k=0`` is off.

    ``seed`` makes a sampled completion reproducible; ``None`` draws fresh randomness.
    Generation ends at EOS (unless ``ignore_eos``), at any ``stop_token_ids`` (the stop
    token is kept in the output) or after ``max_tokens``.

    ``top_logprobs=k`` also returns, per token, the ``k`` most likely tokens and their
    log-probabilities (OpenAI's ``top_logprobs``, vLLM's ``logprobs=k``; at most 20).
    ``structured_outputs`` constrains the output as vLLM's ``StructuredOutputsParams`` with
    those fields does (``{"json": schema}``, ``{"regex": ...}``, ``{"structural_tag":
    ...}``, ...). Engines that cannot do either raise ``EngineError`` naming the field.

    Examples:
        >>> params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=2)
        >>> params.greedy, params.stop_token_ids, params.replace(seed=7).seed
        (True, (2,), 7)
        >>> SamplingParams(top_p=0)
        Traceback (most recent call last):
        ...
        ValueError: SamplingParams.top_p must be a finite number in (0.0, 1.0], got 0
    """

    max_tokens: int = attrs.field(default=64, validator=int_at_least(1))
    temperature: float = attrs.field(default=1.0, validator=float_in(0.0, 100.0))
    top_p: float = attrs.field(default=1.0, validator=float_in(0.0, 1.0, low_open=True))
    top_k: int = attrs.field(default=0, validator=int_at_least(0))
    stop_token_ids: tuple[int, ...] = attrs.field(
        default=(), converter=_token_ids, validator=_check_stop_ids
    )
    seed: int | None = attrs.field(default=None, validator=_check_seed)
    logprobs: bool = attrs.field(default=True, validator=_check_bool)
    ignore_eos: bool = attrs.field(default=False, validator=_check_bool)
    top_logprobs: int = attrs.field(default=0, validator=int_in(0, 20))
    structured_outputs: str | None = attrs.field(
        default=None, converter=_structured_text, validator=_check_structured
    )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied (validated like the constructor)."""
        return attrs.evolve(self, **changes)

    def for_request(self, max_tokens: int, seed: int | None) -> SamplingParams:
        """``replace(max_tokens=..., seed=...)`` for one request: only the two new values
        are checked (the rest were when this one was built), a few µs less per turn."""
        check_int("SamplingParams.max_tokens", max_tokens, 1)
        if seed is not None:
            check_int("SamplingParams.seed", seed, 0)
        out = object.__new__(SamplingParams)
        for name in _SAMPLING_FIELDS:
            _set(out, name, getattr(self, name))
        _set(out, "max_tokens", max_tokens)
        _set(out, "seed", seed)
        return out


_SAMPLING_FIELDS = tuple(a.name for a in attrs.fields(SamplingParams))
_set = object.__setattr__  # the frozen class's own fields, set once on a new copy


def _frozen_ints(values: Iterable[int]) -> tuple[int, ...]:
    return tuple(values)  # one copy, no per-element conversion


def _frozen_floats(values: Iterable[float]) -> tuple[float, ...]:
    return tuple(values)


def _check_generation(inst: Generation, attr: attrs.Attribute[Any], value: Any) -> None:
    n = len(inst.token_ids)
    if len(inst.versions) != n:
        raise ValueError(
            f"Generation.versions must have one entry per token ({n}), got {len(inst.versions)}"
        )
    if len(inst.logprobs) not in (0, n):
        raise ValueError(
            f"Generation.logprobs must be empty or have one entry per token ({n}), "
            f"got {len(inst.logprobs)}"
        )
    if inst.finish_reason not in FINISH_REASONS:
        raise ValueError(
            f"Generation.finish_reason must be one of {FINISH_REASONS}, got {inst.finish_reason!r}"
        )


def _optional_ints(value: Any) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


def _top_entries(value: Any) -> tuple[tuple[tuple[int, float], ...], ...]:
    return value if isinstance(value, tuple) else tuple(tuple(pos) for pos in value)


def _check_top(inst: Generation, attr: attrs.Attribute[Any], value: Any) -> None:
    if value and len(value) != len(inst.token_ids):
        raise ValueError(
            f"Generation.top_logprobs must be empty or have one entry per token "
            f"({len(inst.token_ids)}), got {len(value)}"
        )


@attrs.frozen
class Generation:
    """One completion: sampled tokens, their log-probabilities and policy versions.

    ``logprobs`` is empty when the request asked for none. ``versions[i]`` is the
    engine version whose weights produced ``token_ids[i]``; a request that spans a
    weight update holds both versions. ``cached_tokens``: how many prompt tokens the
    engine's prefix cache served (None where the engine does not say; vLLM in-process
    does). ``top_logprobs[i]``: the request's ``top_logprobs`` most likely
    ``(token_id, logprob)`` pairs at position ``i``, most likely first (empty when the
    request asked for none). ``prompt_token_ids``: the prompt as the model saw it, where
    the engine reports one that differs from the ids sent (a request with images: each
    image pad expanded into the image's tokens); None otherwise.

    Backends build it from the Python ints and floats they already hold: the fields are
    stored as tuples, and only their lengths are checked (no per-element conversion).

    Examples:
        >>> params = SamplingParams(max_tokens=4, ignore_eos=True)
        >>> gen = engine.generate_batch([tokenizer.encode("Hello")], params)[0]
        >>> gen.num_tokens, len(gen.logprobs), gen.finish_reason
        (4, 4, 'length')
        >>> gen.versions == (engine.version,) * 4  # every token's policy version
        True
    """

    token_ids: tuple[int, ...] = attrs.field(converter=_frozen_ints)
    logprobs: tuple[float, ...] = attrs.field(converter=_frozen_floats)
    finish_reason: str = attrs.field()
    versions: tuple[int, ...] = attrs.field(converter=_frozen_ints, validator=_check_generation)
    cached_tokens: int | None = None  # prompt tokens the engine's prefix cache served
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] = attrs.field(
        default=(), converter=_top_entries, validator=_check_top
    )
    prompt_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_optional_ints)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @classmethod
    def joined(cls, parts: Iterable[Generation], finish_reason: str) -> Generation:
        """One generation of ``parts`` produced one after the other (a request continued
        from the tokens of one that was aborted), ending with ``finish_reason``."""
        parts = list(parts)
        return cls(
            [t for g in parts for t in g.token_ids],
            [lp for g in parts for lp in g.logprobs],
            finish_reason,
            [v for g in parts for v in g.versions],
            top_logprobs=[top for g in parts for top in g.top_logprobs],
            prompt_token_ids=parts[0].prompt_token_ids if parts else None,
        )
