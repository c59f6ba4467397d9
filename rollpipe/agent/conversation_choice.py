"""Which conversation an episode or an agent session runs, and the image hook.

``rollpipe.agent`` never imports ``rollpipe.vision``: the image conversation registers
itself here (:func:`use_image_conversation`, called by ``rollpipe.vision.conversation``
on import) and the episode (``run_episode``) and the front door's sessions build it
through :func:`image_conversation`.

The choice (:func:`episode_conversation`): a text env (string observations, no tools,
no structured actions) keeps the text conversation; a chat env runs the image
conversation when its first observation holds an image, or when the engine supports
images (``engine.supports("images")``) and an image conversation is registered, so an
env whose images come later (a tool's picture, a second observation) is already in
it. On an engine without images, a chat env runs the chat conversation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rollpipe.agent.chat import ChatFormat
from rollpipe.agent.conversation import ChatConversation, Conversation
from rollpipe.agent.env_caller import Clock
from rollpipe.agent.env_contract import env_tools, is_chat_env, takes_action
from rollpipe.agent.env_returns import has_images
from rollpipe.agent.records import EpisodeSpec
from rollpipe.agent.tools import ToolSet, tool_set
from rollpipe.engines.protocol import Engine, engine_supports
from rollpipe.engines.records import SamplingParams
from rollpipe.engines.routing import Route

__all__ = [
    "ImageConversationFactory",
    "episode_conversation",
    "image_conversation",
    "image_conversation_registered",
    "use_image_conversation",
]

ImageConversationFactory = Callable[..., Any]
"""Builds an image conversation: ``(spec, chat, sampling, clock, route, *, tools,
system, structured)``, the keywords as :class:`ChatConversation` takes them."""
_IMAGE_CONVERSATION: list[ImageConversationFactory] = []


def use_image_conversation(factory: ImageConversationFactory) -> None:
    """Make ``factory`` build the image conversations (``rollpipe.vision.conversation``
    registers ``ImageConversation`` on import)."""
    _IMAGE_CONVERSATION[:] = [factory]


def image_conversation_registered() -> bool:
    """Whether an image conversation is registered (``rollpipe.vision.conversation`` was
    imported)."""
    return bool(_IMAGE_CONVERSATION)


def image_conversation(
    spec: EpisodeSpec,
    chat: ChatFormat,
    sampling: SamplingParams,
    clock: Clock | None = None,
    route: Route | None = None,
    *,
    tools: ToolSet | None = None,
    system: bool = True,
    structured: bool = False,
) -> ChatConversation:
    """The registered image conversation (a ``ChatConversation``); ``ValueError`` naming
    the import when none is registered."""
    if not _IMAGE_CONVERSATION:
        raise ValueError(
            "the conversation holds images but no image conversation is registered; "
            "import rollpipe.vision.conversation (it needs the vision extra)"
        )
    made = _IMAGE_CONVERSATION[0](
        spec, chat, sampling, clock, route, tools=tools, system=system, structured=structured
    )
    return made  # type: ignore[no-any-return]


def episode_conversation(
    spec: EpisodeSpec,
    chat: ChatFormat,
    env: Any,
    observation: Any,
    sampling: SamplingParams,
    clock: Clock,
    route: Route,
    engine: Engine,
) -> Conversation | None:
    """The conversation of an episode of ``env`` on ``engine`` (see the module doc);
    None for a text env (it keeps the text conversation; ``run_episode`` asks only for a
    chat env, ``is_chat_env``)."""
    if not is_chat_env(env, observation):
        return None
    tools = env_tools(env)
    structured = takes_action(env)
    images = has_images(observation)
    kind = ChatConversation
    if images or (engine_supports(engine, "images") and image_conversation_registered()):
        kind = image_conversation  # type: ignore[assignment]
    return kind(spec, chat, sampling, clock, route, tools=tool_set(tools), structured=structured)
