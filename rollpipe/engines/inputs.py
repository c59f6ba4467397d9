"""Where data enters an engine: prompt token ids and weights, converted and checked once.

``check_prompt`` turns whatever holds the ids (list, tuple, tensor, ndarray) into one
``list[int]`` and range-checks it in bulk; nothing after it converts ids again.
``CheckedIds`` is a prompt built by appending checked parts (an episode's growing
conversation): it knows its bounds, so ``check_prompt`` accepts it without looking at
its ids again, and a turn's cost does not grow with the history. ``CheckedIds.view()``
hands one to an engine without copying it: a ``PromptView``, the read-only first ``n``
ids of a list that only grows at its end, so what it shows never changes. An engine
whose backend reads prompts as sequences (``Backend.takes_views``) gets the view as it
is; any other gets one copy of the ids, made at the engine's boundary.
``named_tensors`` turns the accepted weight containers into one list of pairs.
"""

from __future__ import annotations

import reprlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import islice
from typing import Any, TypeAlias, overload

import numpy as np
import numpy.typing as npt
import torch

from rollpipe.engines.protocol import WeightsLike

__all__ = [
    "CheckedIds",
    "PromptIds",
    "PromptView",
    "check_prompt",
    "check_prompt_view",
    "named_tensors",
]

PromptIds: TypeAlias = Sequence[int] | torch.Tensor | npt.NDArray[np.integer[Any]]
"""What a prompt's token ids may come as: a sequence of ints or a 1-D integer array."""


class CheckedIds(list[int]):
    """Token ids checked as they were appended, with their smallest and largest id.

    Grow one only with ``extended`` (a copy), ``extend_checked`` or ``catch_up`` (in
    place); any other change to the list would leave its bounds, and its views, stale.
    ``check_prompt`` then needs only the bounds, however long the prompt.
    """

    __slots__ = ("high", "low", "scans")

    def __init__(self, ids: PromptIds = ()) -> None:
        checked = _converted(ids) if len(ids) else []
        super().__init__(checked)
        self.low = min(checked) if checked else None
        self.high = max(checked) if checked else None
        self.scans: dict[Any, Any] = {}
        """What checks that read the ids keep to read only the ids appended since (the
        list only grows): ``rollpipe.engines.images``' pad counts and checked prompts."""

    def extended(self, part: PromptIds, *, trusted: bool = False) -> CheckedIds:
        """A copy with ``part`` appended (only ``part`` is checked; see ``extend_checked``)."""
        out = CheckedIds()
        list.extend(out, self)
        out.low, out.high = self.low, self.high
        out.extend_checked(part, trusted=trusted)
        return out

    def extend_checked(self, part: PromptIds, *, trusted: bool = False) -> None:
        """Append ``part`` in place, checking only it. ``trusted``: ``part`` is a list or
        tuple of Python ints as a tokenizer or an engine gives them, so only its bounds
        are read (at C speed); anything else is converted and checked in bulk."""
        if not len(part):
            return
        trust = trusted and type(part) in (list, tuple)
        ids = part if trust else _converted(part)
        list.extend(self, ids)
        low, high = min(ids), max(ids)
        if low < 0:
            raise ValueError(f"prompt_ids holds ids outside the vocabulary: {low} < 0")
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)

    def view(self) -> PromptView:
        """The ids so far as a read-only ``PromptView``, without copying them: later
        appends do not show in it."""
        return PromptView(self, len(self), self.low, self.high)

    def extend_packed(self, part: Sequence[int], packed: npt.NDArray[np.int64]) -> None:
        """Append ``part`` in place, its bounds read from ``packed`` (the same ids as an
        int64 array, which the caller keeps: one conversion serves both)."""
        if len(packed) != len(part):
            raise ValueError(f"extend_packed: {len(packed)} packed ids for {len(part)} ids")
        if not len(part):
            return
        list.extend(self, part)
        low, high = int(np.minimum.reduce(packed)), int(np.maximum.reduce(packed))
        if low < 0:
            raise ValueError(f"prompt_ids holds ids outside the vocabulary: {low} < 0")
        self.low = low if self.low is None else min(self.low, low)
        self.high = high if self.high is None else max(self.high, high)

    def catch_up(self, longer: CheckedIds) -> None:
        """Append in place what ``longer`` (this list plus more: an ``extended`` copy)
        holds past this list's end, taking its bounds: nothing is checked twice."""
        list.extend(self, longer[len(self) :])
        self.low, self.high = longer.low, longer.high


class PromptView(Sequence[int]):
    """The first ``len(view)`` ids of a ``CheckedIds`` that only grows at its end, with
    their bounds: a prompt shared with an engine without a copy (``CheckedIds.view``).

    Read-only and fixed: the list under it only grows past the view's end. Indexing,
    iteration, ``len`` and ``==`` (against any sequence of ints) work as on a list;
    a slice is a new ``list``; ``tolist()`` copies the ids (with their bounds) for
    code that needs a real list.
    """

    __slots__ = ("_ids", "_n", "high", "low")

    def __init__(self, ids: CheckedIds, n: int, low: int | None, high: int | None) -> None:
        self._ids, self._n, self.low, self.high = ids, n, low, high

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...
    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            span = range(self._n)[index]
            if span.step == 1:
                return self._ids[span.start : span.stop]
            return [self._ids[i] for i in span]
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError(f"PromptView index {index} out of range for {self._n} ids")
        return self._ids[i]

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids) if len(self._ids) == self._n else islice(self._ids, self._n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PromptView | list | tuple):
            return len(other) == self._n and self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # as a list's: compared by value

    def __repr__(self) -> str:
        return f"PromptView({reprlib.repr(self.tolist())})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as the ``CheckedIds`` copy it stands for (never the longer list under it)."""
        return (
            _checked_copy,
            (list.__getitem__(self._ids, slice(0, self._n)), self.low, self.high),
        )

    def source(self) -> tuple[CheckedIds, int]:
        """The ``CheckedIds`` under the view and the view's length (the view is its first
        ``n`` ids)."""
        return self._ids, self._n

    def tolist(self) -> CheckedIds:
        """The ids as a new ``CheckedIds`` (a ``list[int]``, its bounds kept)."""
        out = CheckedIds()
        ids = self._ids
        list.extend(out, ids if len(ids) == self._n else list.__getitem__(ids, slice(0, self._n)))
        out.low, out.high = self.low, self.high
        return out


def _checked_copy(ids: list[int], low: int | None, high: int | None) -> CheckedIds:
    out = CheckedIds()
    list.extend(out, ids)
    out.low, out.high = low, high
    return out


def _converted(prompt_ids: PromptIds) -> list[int]:
    """``prompt_ids`` as a list of ints, each >= 0 (no vocabulary check)."""
    return check_prompt(prompt_ids, None)


def check_prompt(prompt_ids: PromptIds, vocab_size: int | None = None) -> list[int]:
    """Prompt token ids as a ``list[int]``, after checking them all at once.

    Accepts a sequence of ints, a 1-D integer tensor or ndarray. Raises ``ValueError``
    naming ``prompt_ids`` for anything else, for an empty prompt, and for ids outside
    ``[0, vocab_size)``. A ``CheckedIds`` is checked by its bounds and returned as it is
    (not copied: an engine never changes a prompt), a ``PromptView`` by its bounds and
    copied (``tolist``); any other input gives a new list.
    """
    if type(prompt_ids) is CheckedIds:
        _check_bounds(prompt_ids, vocab_size)
        return prompt_ids
    if type(prompt_ids) is PromptView:
        _check_bounds(prompt_ids, vocab_size)
        return prompt_ids.tolist()
    source = prompt_ids.detach().cpu() if isinstance(prompt_ids, torch.Tensor) else prompt_ids
    try:
        ids = np.asarray(source)
    except (TypeError, ValueError, OverflowError) as e:  # ragged or otherwise not array-like
        raise ValueError(
            f"prompt_ids must be a 1-D sequence of ints, got {reprlib.repr(prompt_ids)}"
        ) from e
    if ids.ndim == 1 and ids.size == 0:
        raise ValueError("prompt_ids is empty; a prompt needs at least one token")
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise ValueError(
            f"prompt_ids must be a 1-D sequence of ints, got {reprlib.repr(prompt_ids)}"
        )
    if ids.min() < 0 or (vocab_size is not None and ids.max() >= vocab_size):
        outside = ids < 0 if vocab_size is None else (ids < 0) | (ids >= vocab_size)
        bad = ids[outside][:5].tolist()
        raise ValueError(f"prompt_ids holds ids outside the vocabulary [0, {vocab_size}): {bad}")
    out: list[int] = ids.tolist()
    return out


def check_prompt_view(
    prompt_ids: PromptIds, vocab_size: int | None = None
) -> list[int] | PromptView:
    """``check_prompt``, but a ``PromptView`` is checked by its bounds and returned as it
    is, not copied: for a backend that reads prompts as sequences (``takes_views``)."""
    if type(prompt_ids) is PromptView:
        _check_bounds(prompt_ids, vocab_size)
        return prompt_ids
    return check_prompt(prompt_ids, vocab_size)


def _check_bounds(ids: CheckedIds | PromptView, vocab_size: int | None) -> None:
    """Check ids checked as they were appended: by their bounds only."""
    if not len(ids):
        raise ValueError("prompt_ids is empty; a prompt needs at least one token")
    high = ids.high
    if vocab_size is not None and high is not None and high >= vocab_size:
        bad = [i for i in ids if i >= vocab_size][:5]
        raise ValueError(f"prompt_ids holds ids outside the vocabulary [0, {vocab_size}): {bad}")


def named_tensors(weights: WeightsLike) -> list[tuple[str, torch.Tensor]]:
    """Normalise a state dict, an iterable of (name, tensor) or a module to a list."""
    if isinstance(weights, torch.nn.Module):
        items: Iterable[Any] = weights.state_dict().items()
    elif isinstance(weights, Mapping):
        items = weights.items()
    else:
        items = weights
    out: list[tuple[str, torch.Tensor]] = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(
                f"update_weights: expected (name, tensor) pairs, got {type(item).__name__}; "
                "pass a state dict, an iterable of (name, tensor) or a torch module"
            )
        name, tensor = item
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"update_weights: weight {name!r} must be (str, Tensor), "
                f"got ({type(name).__name__}, {type(tensor).__name__})"
            )
        # the tensor itself when it needs no detaching: a pool's ranks then see one update
        out.append((name, tensor.detach() if tensor.requires_grad else tensor))
    if not out:
        raise ValueError("update_weights: got no weights; pass a non-empty state dict")
    return out
