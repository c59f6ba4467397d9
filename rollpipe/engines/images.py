"""Images in an engine request: the images, the model's vision tokens and the checks
that keep vLLM from silently corrupting a request.

A request with images carries token ids with exactly ONE image pad id per image
(``<|image_pad|>``, unexpanded) and ``images``: all of the conversation's images so far,
in order. The engine expands each pad into the image's tokens and reports the expanded
prompt (``Generation.prompt_token_ids``). vLLM 0.32 accepts and silently misreads what
breaks that rule (already-expanded ids, a wrong pad count, pads with no images, a pad in
a response), so an engine on a vision-language model checks every request here first
and every response after; each failure is an ``ImageTokenError`` naming the counts.

``expand_image_pads`` is the local expansion (each pad becomes ``t*h*w / merge**2``
pads for its image's ``image_grid_thw``), which ``rollpipe.vision.checks`` compares
with what the engine reports.
"""

from __future__ import annotations

import itertools
import json
import os
import reprlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeAlias

import attrs
import numpy as np

from rollpipe.engines.inputs import CheckedIds, PromptView
from rollpipe.engines.records import EngineError, Generation

__all__ = [
    "ImageLike",
    "ImageTokenError",
    "VisionTokens",
    "check_generation",
    "check_image_prompt",
    "check_images",
    "check_reported_prompt",
    "check_response",
    "collapse_image_pads",
    "expand_image_pads",
    "image_token_counts",
    "refuse_images",
    "vision_tokens_of",
]

ImageLike: TypeAlias = Any
"""A ``PIL.Image.Image`` or an ``H x W x 3`` ``uint8`` array (RGB)."""


class ImageTokenError(ValueError):
    """A request's or a response's image tokens do not match its images (see the module
    doc): the message names where (request, turn) and the counts."""


@attrs.frozen
class VisionTokens:
    """A vision-language model's special token ids: ``image_pad`` (one per image in a
    request; many after expansion), and, where the model has them, ``video_pad``,
    ``vision_start`` and ``vision_end``. ``banned``: all of them, never sampled."""

    image_pad: int
    video_pad: int | None = None
    vision_start: int | None = None
    vision_end: int | None = None

    @property
    def banned(self) -> tuple[int, ...]:
        ids = (self.vision_start, self.vision_end, self.image_pad, self.video_pad)
        return tuple(i for i in ids if i is not None)


_CONFIG_KEYS = {
    "image_pad": ("image_token_id", "image_token_index"),
    "video_pad": ("video_token_id",),
    "vision_start": ("vision_start_token_id",),
    "vision_end": ("vision_end_token_id",),
}


def vision_tokens_of(model_path: str | os.PathLike[str]) -> VisionTokens | None:
    """The vision tokens a model's ``config.json`` names, None for a text-only model
    (no ``vision_config``, or no image token id)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict) or "vision_config" not in cfg:
        return None
    found: dict[str, int | None] = {}
    for field, keys in _CONFIG_KEYS.items():
        values = [cfg[k] for k in keys if isinstance(cfg.get(k), int)]
        found[field] = values[0] if values else None
    if found["image_pad"] is None:
        return None
    return VisionTokens(**found)  # type: ignore[arg-type]


def check_images(images: Sequence[ImageLike]) -> tuple[Any, ...]:
    """``images`` as RGB ``PIL.Image``s (arrays converted, other modes converted to RGB).

    Raises ``TypeError`` / ``ValueError`` naming the image for anything else.
    """
    if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
        raise TypeError(
            f"images must be a sequence of PIL images or HxWx3 uint8 arrays, got "
            f"{type(images).__name__}"
        )
    from PIL import Image

    out = []
    for i, image in enumerate(images):
        if isinstance(image, Image.Image):
            out.append(image if image.mode == "RGB" else image.convert("RGB"))
        elif isinstance(image, np.ndarray):
            if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
                raise ValueError(
                    f"images[{i}] must be an HxWx3 uint8 array, got shape {image.shape} "
                    f"dtype {image.dtype}"
                )
            out.append(Image.fromarray(image, "RGB"))
        else:
            raise TypeError(
                f"images[{i}] must be a PIL image or an HxWx3 uint8 array, got "
                f"{type(image).__name__}"
            )
    return tuple(out)


def _as_list(ids: Sequence[int]) -> list[int]:
    """``ids`` as a list (a list as it is; a prompt view or tuple copied at C speed)."""
    if isinstance(ids, list):
        return ids
    tolist = getattr(ids, "tolist", None)
    return list(tolist()) if callable(tolist) else list(ids)


def _pad_positions(ids: Sequence[int], pad: int) -> list[int]:
    """Where ``pad`` stands in ``ids``: one C-level ``list.index`` scan per pad, so a
    prompt costs a few Python steps per image, not one per id (the whole conversation
    is checked on every turn)."""
    ids = _as_list(ids)
    out: list[int] = []
    at = -1
    for _ in range(ids.count(pad)):
        at = ids.index(pad, at + 1)
        out.append(at)
    return out


def _source(ids: Sequence[int]) -> tuple[CheckedIds, int] | None:
    """A grown-in-place prompt's list and length (a ``PromptView`` or ``CheckedIds``),
    whose ``scans`` let a check read only what was appended since it last ran."""
    if isinstance(ids, PromptView):
        return ids.source()
    if isinstance(ids, CheckedIds):
        return ids, len(ids)
    return None


def _census(ids: Sequence[int], token: int) -> tuple[int, int]:
    """``(how many ids are token, how many of those follow another)``: on a prompt that
    grows in place only its new ids are read (the counts so far kept in its ``scans``),
    so a long conversation costs each turn what the turn added."""
    source = _source(ids)
    if source is None:
        positions = _pad_positions(_as_list(ids), token)
        return len(positions), sum(b - a == 1 for a, b in itertools.pairwise(positions))
    base, n = source
    done, count, adjacent, last = base.scans.get(("census", token), (0, 0, 0, False))
    if done > n:  # a shorter view of a list counted further: count it afresh
        done, count, adjacent, last = 0, 0, 0, False
    part = list.__getitem__(base, slice(done, n))
    positions = _pad_positions(part, token)
    count += len(positions)
    adjacent += sum(b - a == 1 for a, b in itertools.pairwise(positions))
    adjacent += bool(last and positions and positions[0] == 0)
    last = part[-1] == token if part else last
    base.scans[("census", token)] = (n, count, adjacent, last)
    return count, adjacent


def check_image_prompt(
    prompt_ids: Sequence[int], num_images: int, tokens: VisionTokens, where: str = "request"
) -> None:
    """Raise ``ImageTokenError`` unless ``prompt_ids`` holds exactly one image pad per
    image (``num_images``), none of them next to another (already-expanded ids), and no
    video pad.

    Examples:
        >>> tokens = VisionTokens(image_pad=9)
        >>> check_image_prompt([1, 9, 2, 9], 2, tokens)  # one pad per image: fine
        >>> check_image_prompt([1, 9, 9, 9, 9, 2], 1, tokens, "turn 2")
        Traceback (most recent call last):
        ...
        rollpipe.engines.images.ImageTokenError: turn 2: the prompt holds 4 image pad ids ...
    """
    count, runs = _census(prompt_ids, tokens.image_pad)
    if count != num_images:
        raise ImageTokenError(
            f"{where}: the prompt holds {count} image pad ids (id {tokens.image_pad}) for "
            f"{num_images} images; send exactly one unexpanded pad per image and all of the "
            "conversation's images so far, in order (the engine expands them)"
        )
    if runs:
        raise ImageTokenError(
            f"{where}: {runs} image pad ids follow another pad ({count} pads for "
            f"{num_images} images): the prompt holds already-expanded image tokens; "
            "send one pad per image (the engine expands them; keep the expanded ids "
            "for the training row only)"
        )
    if tokens.video_pad is not None and _census(prompt_ids, tokens.video_pad)[0]:
        raise ImageTokenError(
            f"{where}: the prompt holds video pad ids (id {tokens.video_pad}); videos are "
            "not supported"
        )


def check_response(token_ids: Sequence[int], tokens: VisionTokens, where: str = "response") -> None:
    """Raise ``ImageTokenError`` if a response holds a vision token (fed back in the next
    prompt, a pad there would bind to an image).

    Examples:
        >>> check_response([5, 6], VisionTokens(image_pad=9, vision_start=7))
        >>> check_response([5, 9, 9], VisionTokens(image_pad=9), "turn 1's response")
        Traceback (most recent call last):
        ...
        rollpipe.engines.images.ImageTokenError: turn 1's response holds 2 vision token ids ...
    """
    banned = set(tokens.banned)
    found = [t for t in token_ids if t in banned]
    if found:
        raise ImageTokenError(
            f"{where} holds {len(found)} vision token ids ({reprlib.repr(found)}); they must "
            "be banned when sampling (the engine does it for a vision-language model)"
        )


def collapse_image_pads(ids: Sequence[int], pad_id: int) -> list[int]:
    """``ids`` with each run of consecutive ``pad_id`` replaced by one (an expanded
    prompt back to the unexpanded one).

    Examples:
        >>> collapse_image_pads([1, 9, 9, 9, 2, 9, 9, 3], 9)
        [1, 9, 2, 9, 3]
    """
    ids = _as_list(ids)
    out: list[int] = []
    start = 0
    while True:  # C-level scans: a few Python steps per run
        try:
            at = ids.index(pad_id, start)
        except ValueError:
            break
        out.extend(ids[start : at + 1])
        start = _run_end(ids, at + 1, pad_id)  # the rest of its run left out
    out.extend(ids[start:])
    return out


def _run_end(ids: list[int], start: int, pad_id: int) -> int:
    """The end of the run of ``pad_id`` starting at ``start``: the next id that is not a
    pad, found by C-level slices (doubling steps), not one Python step per id."""
    step = 1
    while start < len(ids):
        chunk = ids[start : start + step]
        if chunk.count(pad_id) != len(chunk):
            return start + next(i for i, v in enumerate(chunk) if v != pad_id)
        start += len(chunk)
        step *= 2
    return start


def check_reported_prompt(
    sent: Sequence[int],
    reported: Sequence[int] | None,
    tokens: VisionTokens,
    where: str = "request",
) -> None:
    """Raise ``ImageTokenError`` unless the engine's expanded prompt ``reported`` is
    ``sent`` with each image pad expanded into one run of pads (text kept, one run per
    pad). Needs no image sizes; ``rollpipe.vision.checks.check_expanded_prompt`` also
    checks each run's length."""
    if reported is None:
        raise ImageTokenError(f"{where}: the engine reported no expanded prompt")
    if not _reports_expansion(sent, reported, tokens.image_pad):
        raise ImageTokenError(
            f"{where}: the engine's expanded prompt ({len(reported)} ids, "
            f"{len(_pad_positions(reported, tokens.image_pad))} image pads) is not the sent "
            f"prompt ({len(sent)} ids, {len(_pad_positions(sent, tokens.image_pad))} image "
            "pads) with each pad expanded"
        )


def _reports_expansion(sent: Sequence[int], reported: Sequence[int], pad: int) -> bool:
    """``_is_expansion`` of the whole prompt; on a prompt that grows in place, of what it
    added since the last request checked on it, once the reported prompt is seen to
    begin with the one reported then (a C-level comparison)."""
    source = _source(sent)
    if source is None:
        return _is_expansion(_as_list(sent), _as_list(reported), pad)
    base, n = source
    done, before = base.scans.get(("reported", pad), (0, ()))
    if done > n or tuple(reported[: len(before)]) != before:
        done, before = 0, ()
    new = list.__getitem__(base, slice(done, n))
    if not _is_expansion(new, _as_list(reported[len(before) :]), pad):
        return False
    base.scans[("reported", pad)] = (n, tuple(reported))
    return True


def _is_expansion(sent: list[int], reported: list[int], pad: int) -> bool:
    """Whether ``reported`` is ``sent`` with each (isolated) pad as a run of one or more
    pads: the text between pads compared as C-level slices, each run's end found by the
    id that follows its pad in ``sent``."""
    at = 0  # in reported
    start = 0  # in sent
    for p in _pad_positions(sent, pad):
        text = sent[start:p]
        if reported[at : at + len(text)] != text:
            return False
        at += len(text)
        if at >= len(reported) or reported[at] != pad:
            return False
        end = _run_end(reported, at, pad)
        at, start = end, p + 1
    return reported[at:] == sent[start:]


def image_token_counts(grid_thws: Any, merge_size: int) -> list[int]:
    """Tokens each image expands to: ``t * h * w // merge_size**2`` per ``image_grid_thw``
    row (a tensor, an array or a list of ``[t, h, w]``).

    Examples:
        >>> image_token_counts([[1, 4, 4], [1, 6, 4]], 2)
        [4, 6]
    """
    rows = np.asarray(grid_thws.tolist() if hasattr(grid_thws, "tolist") else grid_thws)
    rows = rows.reshape(-1, 3) if rows.size else np.zeros((0, 3), dtype=np.int64)
    counts: list[int] = (rows.prod(axis=1) // (merge_size * merge_size)).astype(int).tolist()
    return counts


def expand_image_pads(
    prompt_ids: Sequence[int], grid_thws: Any, merge_size: int, pad_id: int
) -> list[int]:
    """``prompt_ids`` with the ``i``-th image pad replaced by image ``i``'s tokens
    (``image_token_counts``): what the model sees, as a processor expands it.

    Raises ``ImageTokenError`` unless there is exactly one isolated pad per grid row.

    Examples:
        >>> expand_image_pads([1, 9, 2, 9, 3], [[1, 4, 4], [1, 2, 4]], 2, 9)
        [1, 9, 9, 9, 9, 2, 9, 9, 3]
    """
    counts = image_token_counts(grid_thws, merge_size)
    check_image_prompt(prompt_ids, len(counts), VisionTokens(image_pad=pad_id), "expand_image_pads")
    ids = _as_list(prompt_ids)
    positions = _pad_positions(ids, pad_id)
    out: list[int] = []
    start = 0
    for pos, n in zip(positions, counts, strict=True):
        out.extend(ids[start:pos])
        out.extend([pad_id] * n)
        start = pos + 1
    out.extend(ids[start:])
    return out


def check_generation(
    sent: Sequence[int], gen: Generation, tokens: VisionTokens, where: str, images: bool
) -> None:
    """What an engine on a vision-language model checks on each generation: no vision
    token in the response, and (a request with ``images``) the reported expanded prompt
    is the sent one with its pads expanded."""
    check_response(gen.token_ids, tokens, f"{where}'s response")
    if images:
        check_reported_prompt(sent, gen.prompt_token_ids, tokens, where)


def refuse_images(engine: str, backend: Any) -> EngineError:
    """The error for ``images`` sent to an engine that cannot take them: the backend's
    ``no_images`` reason (its model reads text only), else what to use instead."""
    reason = getattr(backend, "no_images", None) or (
        f"{engine} does not take images (supports('images') is False); use a VLLMEngine "
        "or HFEngine on a vision-language model in this process, or an EnginePool of them"
    )
    return EngineError(f"{engine}.generate(images=...): {reason}")
