"""ImageConversation: a conversation whose observations hold images (the third kind).

An env's messages may hold content parts (``rollpipe.agent.content``): text and images.
The conversation renders each turn's new messages with the vision-language model's chat
template through the same render diff as a chat env (:class:`~rollpipe.agent.dialog.Dialog`:
no whole-conversation render per turn). Qwen2-VL's template writes
``<|vision_start|><|image_pad|><|vision_end|>`` per image part: ONE pad per image, the
unexpanded form vLLM takes. Each turn then:

* keeps the conversation's images so far, in order, and the new images' features from
  the processor's image processor (``pixel_values``, ``image_grid_thw``);
* sends the unexpanded ids and ALL the images so far to the engine
  (``engine.generate(..., images=...)``);
* expands the new ids locally (each pad becomes its image's ``t*h*w / merge**2`` pads)
  and checks that the engine's reported prompt (``Generation.prompt_token_ids``) equals
  the local expansion of the whole conversation so far: an :class:`ImageTokenError` names
  the turn and the counts otherwise (what vLLM would silently misread);
* records an :class:`ImageTurn` whose ``prompt_ids`` are the EXPANDED ids (what the
  model saw), so rows, logprobs and masks align, with the turn's new images' features.

The episode's ``max_length`` counts the expanded length (:meth:`seen_length`). Vision
tokens are banned in sampling by the engine (a ``-inf`` bias) and a response holding one
is refused (by the engine, and here again before the turn is recorded).

A front-door session (``rollpipe.frontdoor.session.AgentSession`` on an engine that
supports images) drives the same object through :meth:`propose` / :meth:`adopt`: a
request's prompt (an :class:`ImagePrompt`) carries the row's images and expanded ids up
to it, its request sends them, and nothing changes until the answer is adopted (a new
row starts with the images of its own messages only).

Importing this module registers it (``rollpipe.agent.conversation_choice``: episodes of
chat envs on an engine with images, or whose first observation holds one, and front-door
sessions on such an engine run it); ``rollpipe.agent`` does not import ``rollpipe.vision``.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import torch

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.conversation import Admit, ChatConversation, ChatPrompt, TurnPrompt
from rollpipe.agent.conversation_choice import use_image_conversation
from rollpipe.agent.dialog import Observation
from rollpipe.agent.env_caller import Clock
from rollpipe.agent.env_returns import as_messages
from rollpipe.agent.records import EpisodeSpec, Turn
from rollpipe.agent.tools import ToolSet
from rollpipe.engines.images import (
    ImageTokenError,
    VisionTokens,
    check_images,
    check_response,
    expand_image_pads,
    vision_tokens_of,
)
from rollpipe.engines.protocol import Engine, OnTokens
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.engines.routing import Route

__all__ = ["ImageConversation", "ImagePrompt", "ImageTurn", "load_processor", "new_images"]


@attrs.frozen
class ImageTurn(Turn):
    """A :class:`Turn` of an image conversation: ``prompt_ids`` are expanded (each image
    pad repeated as the model saw it); ``pixel_values`` / ``image_grid_thw`` are the
    image processor's features of the images this turn's prompt added (``None`` when it
    added none), in order. A row's features are its turns' concatenated."""

    pixel_values: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    image_grid_thw: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])


@attrs.frozen
class ImagePrompt(ChatPrompt):
    """A front-door request's prompt in an image conversation: ``ids`` unexpanded (what
    the engine is sent), ``added`` EXPANDED (what the row gets); ``images``: the row's
    images up to this prompt, in order; ``expanded``: the row's expanded ids up to it;
    ``pixel_values`` / ``image_grid_thw``: the features of the images it adds."""

    images: tuple[Any, ...] = ()
    expanded: tuple[int, ...] = ()
    pixel_values: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)
    image_grid_thw: torch.Tensor | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def seen_length(self) -> int:
        """The prompt's length as the model sees it (images expanded)."""
        return len(self.expanded)


@functools.cache
def load_processor(path: str) -> Any:
    """The HF processor of the model at ``path`` (loaded once per path)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(path)


def new_images(messages: Sequence[dict[str, Any]]) -> list[Any]:
    """The image parts' images of checked ``messages``, in order."""
    return [
        p["image"]
        for m in messages
        if not isinstance(m["content"], str)
        for p in m["content"]
        if p["type"] == "image"
    ]


_NO_TOOLS = ToolSet()


class _WithImages:
    """``engine`` whose ``generate`` sends ``images`` with every request (the one turn
    path, :func:`~rollpipe.agent.conversation.generate_turn`, makes the requests)."""

    def __init__(self, engine: Engine, images: tuple[Any, ...]) -> None:
        self._engine, self._images = engine, images

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, *, on_tokens: OnTokens = None
    ) -> Awaitable[Generation]:
        return self._engine.generate(prompt_ids, params, on_tokens=on_tokens, images=self._images)

    def __getattr__(self, name: str) -> Any:  # interruptions, supports, ...: the engine's
        return getattr(self._engine, name)


class ImageConversation(ChatConversation):
    """A conversation with images (see the module doc).

    ``processor``: the model's HF processor (default: loaded from the chat tokenizer's
    directory); ``vision``: its vision token ids (default: from its ``config.json``).
    ``tools`` / ``system`` / ``structured`` as :class:`ChatConversation` takes them
    (``tools``: an env's tools, default none; None for a front-door session, whose
    requests bring theirs).
    """

    def __init__(
        self,
        spec: EpisodeSpec,
        chat: ChatFormat,
        sampling: SamplingParams,
        clock: Clock | None = None,
        route: Route | None = None,
        *,
        tools: ToolSet | None = _NO_TOOLS,
        system: bool = True,
        structured: bool = False,
        processor: Any = None,
        vision: VisionTokens | None = None,
    ) -> None:
        super().__init__(
            spec, chat, sampling, clock, route, tools=tools, system=system, structured=structured
        )
        path = str(getattr(chat.tokenizer, "name_or_path", ""))
        self.processor = load_processor(path) if processor is None else processor
        found = vision_tokens_of(path) if vision is None else vision
        if found is None:
            raise ValueError(
                f"ImageConversation: the model at {path!r} names no image token (its "
                "config.json has no vision_config with an image_token_id); an env with "
                "images needs a vision-language model and its tokenizer"
            )
        self.vision: VisionTokens = found
        self.merge = int(getattr(self.processor.image_processor, "merge_size", 2))
        self.images: tuple[Any, ...] = ()  # every image so far, in order (RGB PIL)
        self.expanded: list[int] = []  # the row's ids as the model saw them
        self._pending: list[torch.Tensor | None] = [None, None]  # the next turn's features
        self._sent_images = 0  # images of the turn's request
        self._proposed: ImagePrompt | None = None  # a session's request being answered

    # -- a turn -----------------------------------------------------------------------
    def _expand(
        self, added: Sequence[int], pictures: tuple[Any, ...]
    ) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        """``added`` (one pad per image) with each pad expanded, and ``pictures``'
        features; ``ImageTokenError`` when the template wrote another number of pads."""
        pads = list(added).count(self.vision.image_pad)
        if pads != len(pictures):
            raise ImageTokenError(
                f"turn {len(self.turns)}: the chat template wrote {pads} image pads for "
                f"the {len(pictures)} images of the new messages; use the model's own chat "
                "template (one <|image_pad|> per image part)"
            )
        if not pictures:
            return list(added), None, None
        features = self.processor.image_processor(images=list(pictures), return_tensors="pt")
        pixels, grid = features["pixel_values"], features["image_grid_thw"]
        return expand_image_pads(added, grid, self.merge, self.vision.image_pad), pixels, grid

    def prompt(self, observation: Observation) -> TurnPrompt:
        """The next turn's engine prompt (unexpanded: one pad per image), the EXPANDED
        ids it adds to the row, those packed, and whether the template broke the prefix.
        The observation's images join the conversation's."""
        messages = as_messages(observation)
        pictures = check_images(new_images(messages))
        prompt, unexpanded, _, broke = super().prompt(messages)
        added, *self._pending = self._expand(unexpanded, pictures)
        self.images = (*self.images, *pictures)
        self.expanded.extend(added)
        packed: npt.NDArray[np.int64] = np.fromiter(added, np.int64, len(added))
        return prompt, added, packed, broke

    def seen_length(self) -> int:
        """The prompt's length as the model sees it (images expanded): what
        ``max_length`` counts."""
        return len(self.expanded)

    # -- an agent's requests ------------------------------------------------------------
    def propose(
        self,
        messages: list[dict[str, Any]],
        tools: tuple[dict[str, Any], ...],
        tool_set: Callable[[], ToolSet],
    ) -> ImagePrompt:
        """The request's prompt (:meth:`ChatConversation.propose`) as an
        :class:`ImagePrompt`: its new messages' images and features, ``added`` expanded.
        Nothing changes until :meth:`adopt`; the next :meth:`generate` of its ids sends
        its images."""
        base = super().propose(messages, tools, tool_set)
        pictures = check_images(new_images(base.new))
        added, pixels, grid = self._expand(base.added, pictures)
        continued = bool(self.turns) and not base.new_row
        images = (*self.images, *pictures) if continued else pictures
        expanded = (*self.expanded, *added) if continued else tuple(added)
        fields = {str(f.alias): getattr(base, f.name) for f in attrs.fields(ChatPrompt)}
        fields["added"] = added
        proposed = ImagePrompt(
            **fields, images=images, expanded=expanded, pixel_values=pixels, image_grid_thw=grid
        )
        self._proposed = proposed
        return proposed

    def adopt(self, prompt: ChatPrompt, gen: Generation) -> None:
        """Make the request's ``prompt`` and its answer ``gen`` the conversation's: its
        row's images and expanded ids, its new images' features for the turn recorded
        next."""
        super().adopt(prompt, gen)
        if isinstance(prompt, ImagePrompt):
            self.images = prompt.images
            self.expanded = [*prompt.expanded, *gen.token_ids]
            self._pending = [prompt.pixel_values, prompt.image_grid_thw]
        self._proposed = None

    # -- the engine ---------------------------------------------------------------------
    def generate(
        self,
        engine: Engine,
        prompt: Sequence[int],
        params: SamplingParams,
        *,
        admit: Admit = None,
        max_aborts: int,
        timeout_s: float | None = None,
        on_tokens: OnTokens = None,
    ) -> Awaitable[Generation]:
        """The turn's request with all of the conversation's images so far (a proposed
        request's: its row's), checked (:meth:`check`) when it is a proposed one (an
        episode checks in :meth:`responded`)."""
        proposed = self._proposed
        if proposed is not None and prompt is not proposed.ids:
            proposed = None  # an episode's turn, or a streamed turn sent again
        images = self.images if proposed is None else proposed.images
        self._sent_images = len(images)
        with_images: Any = _WithImages(engine, images) if images else engine
        request = super().generate(
            with_images,
            prompt,
            params,
            admit=admit,
            max_aborts=max_aborts,
            timeout_s=timeout_s,
            on_tokens=on_tokens,
        )
        if proposed is None:
            return request
        return self._checked(request, list(proposed.expanded))

    async def _checked(self, request: Awaitable[Generation], expanded: list[int]) -> Generation:
        gen = await request
        self._check(gen, expanded)
        return gen

    def check(self, gen: Generation) -> None:
        """Raise :class:`ImageTokenError` unless the engine saw the local expansion of
        the conversation so far and the response holds no vision token."""
        self._check(gen, self.expanded)

    def _check(self, gen: Generation, expanded: list[int]) -> None:
        turn = len(self.turns)
        check_response(gen.token_ids, self.vision, f"turn {turn}'s response")
        if not self._sent_images:
            return
        reported = gen.prompt_token_ids
        if reported is None:
            raise ImageTokenError(
                f"turn {turn}: the engine reported no expanded prompt for a request with "
                f"{self._sent_images} images; use an engine that supports('images')"
            )
        if list(reported) != expanded:
            pad = self.vision.image_pad
            raise ImageTokenError(
                f"turn {turn}: the engine's expanded prompt ({len(reported)} ids, "
                f"{list(reported).count(pad)} image pads) differs from the local expansion "
                f"({len(expanded)} ids, {expanded.count(pad)} image pads, "
                f"{self._sent_images} images); the engine would have read other tokens "
                "than the row holds"
            )

    def record(
        self,
        added: Sequence[int],
        gen: Generation,
        action_text: str,
        observation: str,
        reward: float,
        action_valid: bool | None,
        stepped: bool = True,
        prefix_break: bool = False,
        prompt_array: npt.NDArray[np.int64] | None = None,
        new_row: bool = False,
        constrained: bool = False,
    ) -> Turn:
        """The turn (:meth:`Conversation.record`) as an :class:`ImageTurn` carrying its
        new images' features."""
        base = super().record(
            added,
            gen,
            action_text,
            observation,
            reward,
            action_valid,
            stepped,
            prefix_break,
            prompt_array,
            new_row,
            constrained,
        )
        pixels, grid = self._pending
        self._pending = [None, None]
        fields: dict[str, Any] = {
            str(f.alias): getattr(base, f.name) for f in attrs.fields(Turn) if f.init
        }
        fields["prompt_array"] = base.prompt_array
        turn = ImageTurn(**fields, pixel_values=pixels, image_grid_thw=grid)
        self.turns[-1] = turn
        return turn

    def responded(self, gen: Generation) -> None:
        """``gen`` checked (:meth:`check`: before the env is stepped with it), then its ids
        join the conversation."""
        self.check(gen)
        super().responded(gen)
        self.expanded.extend(gen.token_ids)


def _image_conversation(
    spec: EpisodeSpec,
    chat: ChatFormat,
    sampling: SamplingParams,
    clock: Clock | None = None,
    route: Route | None = None,
    *,
    tools: ToolSet | None = _NO_TOOLS,
    system: bool = True,
    structured: bool = False,
) -> ImageConversation:
    return ImageConversation(
        spec, chat, sampling, clock, route, tools=tools, system=system, structured=structured
    )


use_image_conversation(_image_conversation)
