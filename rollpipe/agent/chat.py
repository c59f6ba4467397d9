"""ChatFormat: turn observations into the prompt token ids an engine receives.

Two modes:

* conversation (``history_window=None``): turn 0 renders system message and
  instruction + observation as a user turn with the tokenizer's chat template, ending
  in the generation prompt. Each later turn *appends* a continuation after the model's
  response: the end-of-turn token (only if the response did not already end with it),
  the new observation as a user turn and the generation prompt. The continuation is
  cut out of a template rendering, so the concatenation is what the template would
  render for the whole conversation, while the model's tokens are never re-tokenized.
* window (``history_window=k``, GiGPO style): every turn's prompt is rendered afresh
  from the last ``k`` (observation, action, reward) entries and the current
  observation, so a prompt's size is bounded whatever the episode length.

Chat envs (tools, chat-message observations, structured actions) render through
:meth:`ChatFormat.render_messages` with ``tools=``; :class:`rollpipe.agent.dialog.Dialog`
keeps their conversation token-exact. ``tool_parser`` / ``reasoning_parser`` name the
model's own vLLM parsers (:mod:`rollpipe.agent.parsers`) that split a response into an
:class:`~rollpipe.agent.actions.AssistantAction`.

The tokenizer shortcuts at the end of the module each give exactly what the general
path gives: the Rust tokenizer's own ``encode`` / ``decode`` where transformers' wrappers
would return the same, prompt pieces packed once, tool-call arguments as templates take
them.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from functools import lru_cache
from typing import Any, cast

import attrs
import numpy as np
import numpy.typing as npt

from rollpipe.agent.parsers import ResponseParser
from rollpipe.agent.records import Turn
from rollpipe.agent.repeats import Repeats
from rollpipe.agent.template import KeptJson, Render, template_renderer
from rollpipe.agent.tools import schemas_key

Packed = tuple[tuple[int, ...], "npt.NDArray[np.int64]"]


def packed(ids: tuple[int, ...]) -> Packed:
    """``ids`` with the same ids as a read-only int64 array."""
    array = np.fromiter(ids, np.int64, len(ids))
    array.flags.writeable = False
    return ids, array


def fast_encoder(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """The Rust tokenizer's own ``encode`` (no special tokens added, special-token markup
    recognised) where transformers' ``__call__`` would give the same ids: a
    tokenizers-backed tokenizer with transformers' own ``__call__`` and ``_encode_plus``
    that does not split special tokens; None otherwise. It skips the argument handling
    of ``__call__`` (about 40% of encoding a short suffix)."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its __call__, as it is
        return None
    cls = type(tokenizer)
    same = (
        isinstance(tokenizer, TokenizersBackend)
        and cls.__call__ is PreTrainedTokenizerBase.__call__
        and cls._encode_plus is TokenizersBackend._encode_plus
        and getattr(tokenizer, "split_special_tokens", False) is False
    )
    backend = getattr(tokenizer, "_tokenizer", None)
    if not same or backend is None:
        return None

    def encode(text: str) -> list[int]:
        if backend.encode_special_tokens:  # what transformers' _encode_plus resets too
            backend.encode_special_tokens = False
        ids: list[int] = backend.encode(text, add_special_tokens=False).ids
        return ids

    return encode


def template_message(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """``message`` with its tool calls' ``arguments`` as a dict, as chat templates take
    them (and as vLLM's renderer passes them): OpenAI messages carry them as JSON text,
    which many templates reject and others render double-encoded."""
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not calls:
        return message
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, Mapping) else None
        arguments = function.get("arguments") if isinstance(function, Mapping) else None
        if isinstance(function, Mapping) and isinstance(arguments, str):
            try:
                parsed = json.loads(arguments)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):  # its JSON kept for the template's tojson
                call = {**call, "function": {**function, "arguments": KeptJson(parsed)}}
        out.append(call)
    return {**message, "tool_calls": out}


def fast_decoder(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust tokenizer's own ``decode`` where transformers' ``decode`` would return
    its text unchanged (a tokenizers-backed tokenizer, transformers' own ``decode`` and
    ``_decode``, no clean-up of spaces); None otherwise."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers: its decode, as it is
        return None
    cls = type(tokenizer)
    same = (
        isinstance(tokenizer, TokenizersBackend)
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
        and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False
    )
    backend = getattr(tokenizer, "_tokenizer", None)
    return backend.decode if same and backend is not None else None


DEFAULT_SYSTEM_PROMPT = (
    "You are an agent acting in a text game. Think briefly, then give your action "
    "in the requested answer format."
)
_SENTINEL = "XQZSENTINELZQX"
PROMPT_CACHE_SIZE = 4096  # observations whose rendered prompt pieces are kept


def parser_name(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    """Validator: None or a non-empty str (vLLM looks the name up when a parser is built)."""
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be None or a vLLM parser name "
            f"such as 'hermes' (tools) or 'qwen3' (reasoning), got {value!r}"
        )


def _window(instance: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(
            f"ChatFormat.history_window must be None (whole conversation) or an int >= 0, "
            f"got {value!r}"
        )


@attrs.frozen
class ChatFormat:
    """Renders prompts with ``tokenizer``'s chat template; see the module docstring.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        system_prompt: the system message; ``None`` leaves it to the template.
        instruction: text put before the first observation (window mode: before the
            history) in the user turn; empty by default since the envs' observations
            already state the task and answer format.
        history_window: ``None`` for one growing conversation, ``k`` for step prompts
            showing the last ``k`` turns.
        task_header / history_header / history_entry / current_header: window-mode
            text pieces. After turn 0 the prompt repeats the first observation (it
            states the task) under ``task_header``; ``history_entry`` gets ``step``,
            ``observation``, ``action``, ``reward``; ``current_header`` gets ``step``.
        tool_parser / reasoning_parser: names of the model's vLLM parsers (``"hermes"``,
            ``"qwen3"``, ...) for chat envs; checked against the tokenizer here.

    Examples:
        A conversation grows by appending ids, and equals the template's whole rendering:

        >>> chat = ChatFormat(tokenizer, system_prompt=None)
        >>> first = chat.first_prompt("Move?")
        >>> response = [*chat.encode("Up"), chat.eot_id]  # as the engine returned it
        >>> more = chat.continuation("You moved up.", response)
        >>> talk = [{"role": "user", "content": "Move?"}, {"role": "assistant", "content": "Up"},
        ...         {"role": "user", "content": "You moved up."}]
        >>> whole = chat.render_messages(talk, generation_prompt=True)
        >>> first + response + more == chat.encode(whole)
        True
        >>> tokenizer.decode(chat.eot_id), chat.continuation("Hi", response[:-1])[0] == chat.eot_id
        ('<|im_end|>', True)
    """

    tokenizer: Any = attrs.field(eq=False, repr=False)
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    instruction: str = ""
    history_window: int | None = attrs.field(default=None, validator=_window)
    history_header: str = "Your most recent steps (oldest first):"
    history_entry: str = (
        "Step {step}. Observation:\n{observation}\nYour answer: {action}\nReward: {reward:g}"
    )
    current_header: str = "Step {step}. Current observation:"
    task_header: str = "The task, as first shown:"
    tool_parser: str | None = attrs.field(default=None, validator=parser_name)
    reasoning_parser: str | None = attrs.field(default=None, validator=parser_name)
    _eot_id: int | None = attrs.field(init=False, eq=False, repr=False, default=None)
    # Per-observation caches of the rendered and tokenized pieces (conversation mode and
    # every turn 0): envs repeat observations (a group shares its first one, FrozenLake
    # revisits cells), and rendering plus tokenizing is most of rollpipe's CPU per turn.
    # Each holds the ids and the same ids packed (a read-only int64 array, as rows take
    # them), so a repeated observation is neither rendered, tokenized nor packed again.
    _first_cached: Callable[[str], Packed] = attrs.field(
        init=False, eq=False, repr=False, default=None
    )
    # the continuation pieces: all of them, and without their first id (the end of turn,
    # when the response already ends with it)
    _suffix_cached: Callable[[str], tuple[Packed, Packed]] = attrs.field(
        init=False, eq=False, repr=False, default=None
    )
    _fast_decode: Callable[..., str] | None = attrs.field(
        init=False, eq=False, repr=False, default=None
    )
    _fast_encode: Callable[[str], list[int]] | None = attrs.field(
        init=False, eq=False, repr=False, default=None
    )
    _fast_render: Render | None = attrs.field(init=False, eq=False, repr=False, default=None)
    # chat turns' work kept by its whole input (``rollpipe.agent.repeats``), shared by the
    # dialogs of every episode with this format
    repeats: Repeats = attrs.field(init=False, eq=False, repr=False, factory=Repeats)
    _parsers: dict[str, ResponseParser] = attrs.field(
        init=False, eq=False, repr=False, factory=dict
    )
    _variants: dict[str | None, ChatFormat] = attrs.field(
        init=False, eq=False, repr=False, factory=dict
    )

    def __attrs_post_init__(self) -> None:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                "ChatFormat.tokenizer has no chat_template; use a chat model's tokenizer "
                "or set tokenizer.chat_template"
            )
        object.__setattr__(self, "_fast_encode", fast_encoder(self.tokenizer))
        cache = lru_cache(maxsize=PROMPT_CACHE_SIZE)
        first_cached = cache(lambda obs: packed(self._first_prompt_ids(obs)))
        suffix_cached = cache(lambda obs: _with_cut(packed(self._suffix_ids(obs))))
        object.__setattr__(self, "_first_cached", first_cached)
        object.__setattr__(self, "_suffix_cached", suffix_cached)
        first = self._suffix_ids("x")[0]
        special = set(self.tokenizer.all_special_ids)
        object.__setattr__(self, "_eot_id", first if first in special else None)
        object.__setattr__(self, "_fast_decode", fast_decoder(self.tokenizer))
        object.__setattr__(self, "_fast_render", template_renderer(self.tokenizer))
        if self.parses_responses:
            self.response_parser(())  # a name unknown to vLLM, or unfit for the tokenizer

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the settings only; the caches are rebuilt on the other side."""
        settings = {a.name: getattr(self, a.name) for a in attrs.fields(ChatFormat) if a.init}
        return (_rebuild, (settings,))

    # -- rendering --------------------------------------------------------------------
    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text)}")
        return text

    def _encode(self, text: str) -> tuple[int, ...]:
        if self._fast_encode is not None:
            return tuple(self._fast_encode(text))
        return tuple(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _system(self) -> list[dict[str, str]]:
        return (
            []
            if self.system_prompt is None
            else [{"role": "system", "content": self.system_prompt}]
        )

    def _suffix_ids(self, observation: str) -> tuple[int, ...]:
        """Template text after an assistant message's content, up to the next generation
        prompt, with ``observation`` as the user turn in between."""
        messages = [
            *self._system(),
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": _SENTINEL},
            {"role": "user", "content": observation},
        ]
        text = self._render(messages, generation_prompt=True)
        cut = text.rfind(_SENTINEL)
        if cut < 0:
            raise ValueError("the chat template dropped the assistant message content")
        return self._encode(text[cut + len(_SENTINEL) :])

    @property
    def eot_id(self) -> int | None:
        """The special token that ends an assistant turn in the template (e.g.
        ``<|im_end|>``); ``None`` if the template puts no special token there."""
        return self._eot_id

    def user_content(self, observation: str) -> str:
        """The first user message: instruction (if any) then the observation."""
        return f"{self.instruction}\n\n{observation}" if self.instruction else observation

    def _first_prompt_ids(self, observation: str) -> tuple[int, ...]:
        messages = [*self._system(), {"role": "user", "content": self.user_content(observation)}]
        return self._encode(self._render(messages, generation_prompt=True))

    def first_prompt(self, observation: str) -> list[int]:
        """Turn 0's prompt ids: system, user (instruction + observation), generation prompt."""
        return list(self._first_cached(observation)[0])

    def continuation(self, observation: str, response_ids: Sequence[int]) -> list[int]:
        """Ids appended after ``response_ids`` so the conversation goes on with
        ``observation``: end of turn (added when the response lacks it, e.g. cut at
        ``max_tokens``), the user turn, the generation prompt."""
        return list(self._continuation(observation, response_ids)[0])

    def _continuation(self, observation: str, response_ids: Sequence[int]) -> Packed:
        whole, cut = self._suffix_cached(observation)
        if self._eot_id is not None and len(response_ids) > 0 and response_ids[-1] == self._eot_id:
            return cut
        return whole

    def packed_turn_prompt(
        self, observation: str, history: Sequence[Turn]
    ) -> tuple[Sequence[int], npt.NDArray[np.int64] | None]:
        """``turn_prompt`` and, in conversation mode, the same ids as a read-only int64
        array. Conversation mode gives the cached pieces themselves (a tuple and its
        array, shared by every turn that repeats the observation: nothing is copied or
        packed again, and the turns that record them hold one tuple, not one each); window
        mode a fresh list and None (its prompts are not cached)."""
        if self.history_window is not None:
            return self.window_prompt(observation, history), None
        if not history:
            return self._first_cached(observation)
        return self._continuation(observation, history[-1].response_ids)

    def window_prompt(self, observation: str, history: Sequence[Turn]) -> list[int]:
        """A step prompt: the task (first observation), the last ``history_window`` turns
        of ``history``, then the current ``observation``."""
        k = self.history_window or 0
        step = len(history)
        recent = history[max(0, step - k) :] if k else []
        parts = [self.instruction] if self.instruction else []
        if len(recent) < step:  # turn 0 (which states the task) fell out of the window
            parts.append(f"{self.task_header}\n{history[0].observation}")
        if recent:
            first = step - len(recent)
            entries = [
                self.history_entry.format(
                    step=first + i,
                    observation=t.observation,
                    action=t.action_text,
                    reward=t.reward,
                )
                for i, t in enumerate(recent)
            ]
            parts.append("\n\n".join([self.history_header, *entries]))
        parts.append(f"{self.current_header.format(step=step)}\n{observation}")
        messages = [*self._system(), {"role": "user", "content": "\n\n".join(parts)}]
        return list(self._encode(self._render(messages, generation_prompt=True)))

    def turn_prompt(self, observation: str, history: Sequence[Turn]) -> list[int]:
        """The ids a new turn adds (conversation mode) or its whole prompt (window mode)."""
        if self.history_window is not None:
            return self.window_prompt(observation, history)
        if not history:
            return self.first_prompt(observation)
        return self.continuation(observation, history[-1].response_ids)

    def decode(self, response_ids: Sequence[int]) -> str:
        """The action text of a response: its tokens decoded without special tokens."""
        if self._fast_decode is not None:  # the same text, without the wrapper's checks
            return str(self._fast_decode(list(response_ids), skip_special_tokens=True))
        return str(self.tokenizer.decode(list(response_ids), skip_special_tokens=True))

    # -- chat envs --------------------------------------------------------------------
    @property
    def parses_responses(self) -> bool:
        """Whether a tool or reasoning parser is set."""
        return self.tool_parser is not None or self.reasoning_parser is not None

    def for_env(self, env: Any) -> ChatFormat:
        """This format, or one with the env's own ``system_prompt`` when the env (its class
        or the instance) declares one: a task's instructions instead of the default game
        prompt. One copy is kept per prompt, so its caches serve every episode."""
        if not hasattr(env, "system_prompt"):
            return self
        prompt = env.system_prompt
        if prompt == self.system_prompt:
            return self
        if prompt is not None and not isinstance(prompt, str):
            raise ValueError(
                f"{type(env).__name__}.system_prompt must be a str or None (no system "
                f"message), got {prompt!r}"
            )
        variant = self._variants.get(prompt)
        if variant is None:
            variant = self._variants.setdefault(prompt, attrs.evolve(self, system_prompt=prompt))
        return variant

    def system_messages(self) -> list[dict[str, str]]:
        """The system message a conversation starts with (none if ``system_prompt`` is None)."""
        return self._system()

    def render_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> str:
        """``messages`` rendered by the tokenizer's chat template, with ``tools=`` (their
        OpenAI schemas) when there are any (``rollpipe.agent.template``: the same text as
        ``apply_chat_template``, cheaper)."""
        shown = [template_message(m) for m in messages]
        return self.render_shown(shown, generation_prompt=generation_prompt, tools=tools)

    def render_shown(
        self,
        shown: Sequence[Mapping[str, Any]],
        *,
        generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] = (),
    ) -> str:
        """:meth:`render_messages` of messages already in their template form
        (:func:`template_message`: a dialog makes each message's once)."""
        if self._fast_render is not None:
            schemas = cast("list[dict[str, Any]]", list(tools)) if tools else None
            return self._fast_render(shown, generation_prompt, schemas)
        extra = {"tools": list(tools)} if tools else {}
        text = self.tokenizer.apply_chat_template(
            list(shown),
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **extra,
        )
        if not isinstance(text, str):
            raise TypeError(f"apply_chat_template(tokenize=False) returned {type(text)}")
        return text

    def encode(self, text: str) -> list[int]:
        """``text`` as token ids, special-token markup recognised, nothing added."""
        return list(self._encode(text))

    def decode_for_parsing(self, response_ids: Sequence[int]) -> str:
        """A response decoded with its special tokens kept (parsers need markers that are
        special tokens), the end-of-turn token that closed it left out."""
        ids = list(response_ids)
        if ids and self._eot_id is not None and ids[-1] == self._eot_id:
            ids.pop()
        return self.decode_text(ids, skip_special_tokens=not self.parses_responses)

    def decode_text(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        """``tokenizer.decode(ids, skip_special_tokens=...)`` (the Rust tokenizer's own
        where that gives the same text)."""
        if self._fast_decode is not None:
            return str(self._fast_decode(list(ids), skip_special_tokens=skip_special_tokens))
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def response_parser(
        self, tools: Sequence[Mapping[str, Any]], key: str | None = None
    ) -> ResponseParser:
        """The :class:`ResponseParser` of ``tool_parser`` / ``reasoning_parser`` for a
        request with ``tools`` (``key``: their :func:`schemas_key`, when known). Parsers
        are built once per tokenizer, parser names and tool set, and shared by the
        formats of one tokenizer (``for_env``'s variants too): a parse keeps no state."""
        key = schemas_key(tools) if key is None else key
        parser = self._parsers.get(key)
        if parser is None:
            shared = _shared_parsers(self.tokenizer)
            whole = (self.tool_parser, self.reasoning_parser, key)
            parser = shared.get(whole)
            if parser is None:
                parser = ResponseParser(
                    self.tokenizer,
                    self.tool_parser,
                    self.reasoning_parser,
                    [dict(t) for t in tools],
                )
                shared[whole] = parser
            self._parsers[key] = parser
        return parser


_PARSERS: weakref.WeakKeyDictionary[Any, dict[Hashable, ResponseParser]] = (
    weakref.WeakKeyDictionary()
)  # a tokenizer -> its parsers by (tool parser, reasoning parser, tools key)


def _shared_parsers(tokenizer: Any) -> dict[Hashable, ResponseParser]:
    """The parsers kept for ``tokenizer`` (a fresh dict where it cannot be weakly kept)."""
    try:
        found = _PARSERS.get(tokenizer)
        if found is None:
            found = _PARSERS[tokenizer] = {}
    except TypeError:
        found = {}
    return found


def _with_cut(pieces: Packed) -> tuple[Packed, Packed]:
    """``pieces`` and the same without their first id."""
    ids, array = pieces
    return pieces, (ids[1:], array[1:])


def _rebuild(settings: dict[str, Any]) -> ChatFormat:
    return ChatFormat(**settings)
