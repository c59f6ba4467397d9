"""Trajectory records: what one episode sent to the engine, got back, and was rewarded.

Token ids are kept exactly as the engine received and produced them, so the rows built
from these records (``rollpipe.data.rows``) never re-tokenize text. All records are
frozen attrs classes: hashable (``Trajectory.env_metrics`` and ``Group``'s drop counts
take no part), picklable, cheap to ship between processes. ``to_state()`` /
``from_state()`` give checkpoint state as plain data (ints, floats, str, bool, None,
lists, dicts and tensors: ``torch.load(weights_only=True)`` reads it, and it is JSON
apart from the tensors).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs
import numpy as np
import torch

from rollpipe._utils.checks import int_at_least, optional
from rollpipe._utils.freeze import freeze, plain, thaw

EndReason = Literal["terminated", "truncated", "max_turns", "max_length", "error"]
END_REASONS: tuple[str, ...] = ("terminated", "truncated", "max_turns", "max_length", "error")
TURN_FINISH_REASONS: tuple[str, ...] = ("stop", "length")
"""Why a recorded turn's generation ended (an aborted one is regenerated, never recorded)."""


def _env_config(
    value: Mapping[str, Any] | Iterable[tuple[str, Any]],
) -> tuple[tuple[str, Any], ...]:
    """A mapping or pairs as key-sorted pairs of frozen values (hashable, stable)."""
    items = value.items() if isinstance(value, Mapping) else value
    pairs = tuple((str(k), freeze(v)) for k, v in items)
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"EpisodeSpec.env_config has duplicate keys: {keys}")
    return tuple(sorted(pairs, key=lambda kv: kv[0]))


def _ints(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)  # no per-id int(): the engine boundary made them Python ints


def _floats(value: Iterable[float]) -> tuple[float, ...]:
    return tuple(value)


def _known_bool(value: Any) -> bool | None:
    """``None`` (not reported) stays ``None``; anything else becomes a bool."""
    return None if value is None else bool(value)


def _values(x: Any) -> list[Any]:
    """A tensor (or a list, as JSON gives it back) from state as Python scalars."""
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


@attrs.frozen
class EpisodeSpec:
    """What to run: the group, the episode's unique id, the env seed and which env.

    All members of a group share ``seed`` (same initial state); ``episode_id`` is
    unique per trajectory and, with ``seed``, determines every sampling seed. A group
    drawn from a dataset also shares its ``row`` (plain data, handed to the env's
    ``reset(seed, row=...)``) and ``row_index`` (the row's position in the dataset).

    Examples:
        >>> spec = EpisodeSpec(group_id=3, episode_id=12, seed=7, env_config={"size": 4})
        >>> spec.env_kwargs, EpisodeSpec.from_state(spec.to_state()) == spec
        ({'size': 4}, True)
    """

    group_id: int = attrs.field(validator=int_at_least(0))
    episode_id: int = attrs.field(validator=int_at_least(0))
    seed: int = attrs.field(validator=int_at_least(0))
    env_name: str = "frozenlake"
    env_config: tuple[tuple[str, Any], ...] = attrs.field(default=(), converter=_env_config)
    tag: str = ""
    row: Any = attrs.field(
        default=None, converter=lambda r: plain(r, "EpisodeSpec.row"), hash=False
    )
    row_index: int | None = attrs.field(default=None, validator=optional(int_at_least(0)))

    @property
    def env_kwargs(self) -> dict[str, Any]:
        """``env_config`` as keyword arguments for ``rollpipe.envs.make``."""
        return dict(self.env_config)

    def to_state(self) -> dict[str, Any]:
        """Plain-data state; ``from_state`` rebuilds an equal spec."""
        config = {k: thaw(v, f"EpisodeSpec.env_config[{k!r}]") for k, v in self.env_config}
        return {
            "group_id": self.group_id,
            "episode_id": self.episode_id,
            "seed": self.seed,
            "env_name": self.env_name,
            "env_config": config,
            "tag": self.tag,
            "row": self.row,
            "row_index": self.row_index,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> EpisodeSpec:
        state = dict(state)
        if "env" in state:  # checkpoints written before the field was named env_name
            state["env_name"] = state.pop("env")
        return cls(**state)


@attrs.frozen
class Turn:
    """One engine request and what followed it.

    ``prompt_ids`` are the ids this turn *added* to the engine's prompt. In conversation
    mode (``ChatFormat.history_window is None``) that is the whole first prompt at turn
    0 and the continuation (end of the previous assistant turn, the new observation as
    a user turn, the generation prompt) afterwards, so the engine's prompt at turn t is
    every earlier turn's prompt and response ids plus this turn's ``prompt_ids``. In
    window mode each turn's prompt is rendered afresh and ``prompt_ids`` is all of it.

    ``action_text`` is the decoded response; it is what ``env.step`` received when
    ``stepped`` is true. A response cut at ``max_tokens`` (``finish_reason ==
    "length"``) is stepped like any other by default; with ``on_length="skip"`` or
    ``"end"`` it is not, and ``reward`` is then the explicit length penalty.
    ``observation`` is the env observation this turn answered.

    ``action_valid`` is the env's ``info["action_valid"]`` for a stepped turn, ``None``
    when the env did not report it (unknown, not invalid: ``valid_action_rate`` leaves
    such turns out), and ``False`` for a turn that was not stepped (a cut response under
    ``on_length="skip"`` / ``"end"``, or a step that raised).

    Chat envs: tool results are in ``prompt_ids`` (never in ``response_mask``);
    ``prefix_break``: the template re-rendered earlier history at this turn, so the ids
    (exactly what the engine saw) differ from a fresh render (``rollpipe.agent.dialog``).
    ``new_row``: this turn's ``prompt_ids`` are its whole prompt, with no earlier turn's
    ids before them (an agent that rewrote its history, ``rollpipe.frontdoor``): rows
    built from the trajectory start a new row here.

    ``constrained``: every response token was sampled under a grammar (a forced tool
    call's structured outputs, ``rollpipe.frontdoor.forced``), so ``logprobs`` are the
    engine's logprobs of the grammar-masked, renormalised distribution, not the policy's;
    rows mark these tokens in ``constrained_mask``.

    Examples:
        >>> turn = Turn(prompt_ids=[1, 2, 3], response_ids=[4, 5], logprobs=[-0.5, -0.1],
        ...             versions=[0, 0], reward=1.0, finish_reason="stop", action_valid=True,
        ...             action_text="Up", observation="Move?")
        >>> turn.token_array.tolist(), turn.length_cut, Turn.from_state(turn.to_state()) == turn
        ([1, 2, 3, 4, 5], False, True)
    """

    prompt_ids: tuple[int, ...] = attrs.field(converter=_ints)
    response_ids: tuple[int, ...] = attrs.field(converter=_ints)
    logprobs: tuple[float, ...] = attrs.field(converter=_floats)
    versions: tuple[int, ...] = attrs.field(converter=_ints)
    reward: float = attrs.field(converter=float)
    finish_reason: str = attrs.field(validator=attrs.validators.in_(TURN_FINISH_REASONS))
    action_valid: bool | None = attrs.field(converter=_known_bool)
    action_text: str
    observation: str
    stepped: bool = attrs.field(default=True, converter=bool)
    prefix_break: bool = attrs.field(default=False, converter=bool)
    new_row: bool = attrs.field(default=False, converter=bool)
    constrained: bool = attrs.field(default=False, converter=bool)
    # Packed copies for collation, made here, on the rollout loop while the engine
    # generates, so building a batch copies arrays instead of converting Python ints.
    # ``prompt_array``: ``prompt_ids`` already packed (the episode has them packed with
    # the cached prompt pieces), kept as it is when read-only: turns that repeat an
    # observation share one array.
    _prompt_array: np.ndarray | None = attrs.field(
        default=None, eq=False, repr=False, alias="prompt_array"
    )
    response_array: np.ndarray = attrs.field(init=False, eq=False, repr=False)
    logprob_array: np.ndarray = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            name = "logprobs" if len(self.logprobs) != n else "versions"
            raise ValueError(
                f"Turn.{name} has {len(getattr(self, name))} entries but response_ids has "
                f"{n}; give one {name[:-1]} per generated token"
            )
        packed, p = self._prompt_array, len(self.prompt_ids)
        if packed is None or len(packed) != p or packed.dtype != np.int64:
            packed = np.fromiter(self.prompt_ids, np.int64, p)
        elif packed.flags.writeable:  # the caller's own array: a copy it cannot change
            packed = packed.copy()
        response = np.fromiter(self.response_ids, np.int64, n)
        logprobs = np.fromiter(self.logprobs, np.float32, n)
        packed.flags.writeable = response.flags.writeable = logprobs.flags.writeable = False
        object.__setattr__(self, "_prompt_array", packed)
        object.__setattr__(self, "response_array", response)
        object.__setattr__(self, "logprob_array", logprobs)

    @property
    def prompt_array(self) -> np.ndarray:
        """``prompt_ids`` as a read-only int64 array (shared by turns that repeat them)."""
        packed: np.ndarray = self._prompt_array  # type: ignore[assignment]  # never None
        return packed

    @property
    def token_array(self) -> np.ndarray:
        """Prompt then response ids, one read-only int64 array (a new one each call)."""
        tokens: np.ndarray = np.concatenate((self.prompt_array, self.response_array))
        tokens.flags.writeable = False
        return tokens

    @property
    def length_cut(self) -> bool:
        """Whether the response stopped at ``max_tokens`` rather than at end of turn."""
        return self.finish_reason == "length"

    def to_state(self) -> dict[str, Any]:
        """Plain-data state: ids and versions as int64 tensors, logprobs as float64 (every
        Python float exactly); ``from_state`` rebuilds an equal turn.

        A subclass's turn (an image turn: ``rollpipe.vision.conversation.ImageTurn``) adds
        ``turn_type`` (``"module:Class"``) and ``turn_fields``: its own fields, tensors
        as they are (dtype and bits kept: ``pixel_values`` come back bitwise), so it
        comes back as its class with its features; a plain turn's state has neither key.
        """
        ids = torch.from_numpy(self.token_array.copy())  # the packed ids: no per-id work
        state = {
            "prompt_ids": ids[: len(self.prompt_ids)],
            "response_ids": ids[len(self.prompt_ids) :],
            "logprobs": torch.tensor(self.logprobs, dtype=torch.float64),
            "versions": torch.tensor(self.versions, dtype=torch.int64),
            "reward": self.reward,
            "finish_reason": self.finish_reason,
            "action_valid": self.action_valid,
            "action_text": self.action_text,
            "observation": self.observation,
            "stepped": self.stepped,
            "prefix_break": self.prefix_break,
            "new_row": self.new_row,
            "constrained": self.constrained,
        }
        if type(self) is not Turn:
            kind = type(self)
            state["turn_type"] = f"{kind.__module__}:{kind.__qualname__}"
            state["turn_fields"] = {
                name: _field_state(getattr(self, name)) for name in _own_fields(kind)
            }
        return state

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Turn:
        """The turn ``to_state`` gave: of the class named by ``turn_type`` (imported when
        it is a rollpipe module not loaded yet), else a plain :class:`Turn`."""
        kind = _turn_class(state["turn_type"]) if "turn_type" in state else cls
        return kind(
            **state.get("turn_fields", {}),
            prompt_ids=_values(state["prompt_ids"]),
            response_ids=_values(state["response_ids"]),
            logprobs=_values(state["logprobs"]),
            versions=_values(state["versions"]),
            reward=state["reward"],
            finish_reason=state["finish_reason"],
            action_valid=state["action_valid"],
            action_text=state["action_text"],
            observation=state["observation"],
            stepped=state["stepped"],
            prefix_break=state.get("prefix_break", False),  # absent in older checkpoints
            new_row=state.get("new_row", False),
            constrained=state.get("constrained", False),
        )


_BASE_FIELDS = frozenset(a.name for a in attrs.fields(Turn))


def _own_fields(kind: type[Turn]) -> tuple[str, ...]:
    """The init fields ``kind`` adds to :class:`Turn`."""
    fields: tuple[attrs.Attribute[Any], ...] = attrs.fields(kind)
    return tuple(a.name for a in fields if a.init and a.name not in _BASE_FIELDS)


def _field_state(value: Any) -> Any:
    """A subclass field in state: a tensor detached (its dtype and bits kept), plain data
    as it is."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def _turn_class(name: str) -> type[Turn]:
    """The ``Turn`` subclass a state's ``turn_type`` (``"module:Class"``) names."""
    module_name, _, qualname = str(name).partition(":")
    module = sys.modules.get(module_name)
    if module is None and module_name.split(".")[0] == "rollpipe":
        import importlib  # a rollpipe module not loaded yet (e.g. rollpipe.vision's)

        module = importlib.import_module(module_name)
    kind = getattr(module, qualname, None) if module is not None else None
    if not (isinstance(kind, type) and issubclass(kind, Turn)):
        raise ValueError(
            f"Turn.from_state: turn_type {name!r} names no Turn subclass; import the module "
            "that defines it before loading the state"
        )
    return kind


def _turns(value: Iterable[Turn]) -> tuple[Turn, ...]:
    return tuple(value)


def _metrics(value: Mapping[str, float]) -> dict[str, float]:
    return {str(k): float(v) for k, v in dict(value).items()}


@attrs.frozen
class Trajectory:
    """One finished episode: its spec, turns, score and why it ended.

    ``score`` is the sum of turn rewards (length penalties included). ``end_reason``:
    ``terminated``/``truncated`` (the env said so), ``max_turns``, ``max_length`` (the
    token budget left no room for another turn — possibly at turn 0, with no turns),
    ``error`` (the env raised; ``error`` holds its repr, then where: env class and call,
    env name, seed, episode, turn, as ``rollpipe.agent.env_errors`` writes it;
    ``error_type`` the exception's class name, ``error_call`` the call, e.g.
    ``"FrozenLake.step"`` or ``"engine request"``). ``history_window`` is the
    ``ChatFormat`` mode the prompts were built in (``None``: one growing conversation).
    ``env_metrics`` are the env's step ``info["metrics"]`` aggregated over the episode
    (``rollpipe.agent.env_contract``); they take part in equality, not in hashing.

    Examples:
        >>> turn = Turn([1, 2], [3, 4], [-0.5, -0.2], [5, 6], 1.0, "stop", True, "Up", "Move?")
        >>> traj = Trajectory(EpisodeSpec(0, 9, 7), 0, [turn, turn], 2.0, True, "terminated")
        >>> traj.traj_id, traj.num_turns, traj.num_generated_tokens, traj.version_span
        ('frozenlake/g0/e9', 2, 4, (5, 6))
    """

    spec: EpisodeSpec
    env_id: int = attrs.field(validator=int_at_least(0))
    turns: tuple[Turn, ...] = attrs.field(converter=_turns)
    score: float = attrs.field(converter=float)
    success: bool = attrs.field(converter=bool)
    end_reason: EndReason = attrs.field(validator=attrs.validators.in_(END_REASONS))
    error: str | None = None
    env_time_s: float = 0.0
    engine_time_s: float = 0.0
    aborted_tokens: int = 0  # generated, aborted by suspend(mode="abort"), regenerated
    clipped_rewards: int = 0  # step rewards clipped to ±reward_clip
    final_observation: str = ""
    history_window: int | None = None
    env_metrics: Mapping[str, float] = attrs.field(factory=dict, converter=_metrics, hash=False)
    error_type: str | None = None
    error_call: str | None = None
    # (oldest, newest) policy version of the generated tokens, None if none; computed on
    # first use: the group assembler and the batch both read it for every trajectory
    _span: tuple[int, int] | None = attrs.field(init=False, default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if (self.end_reason == "error") != (self.error is not None):
            raise ValueError(
                f"Trajectory.error must be set exactly when end_reason == 'error'; got "
                f"end_reason={self.end_reason!r}, error={self.error!r}"
            )
        for name in ("error_type", "error_call"):
            if self.error is None and getattr(self, name) is not None:
                raise ValueError(
                    f"Trajectory.{name}={getattr(self, name)!r} needs an error; got "
                    f"end_reason={self.end_reason!r}, error=None"
                )

    @property
    def group_id(self) -> int:
        return self.spec.group_id

    @property
    def episode_id(self) -> int:
        return self.spec.episode_id

    @property
    def seed(self) -> int:
        return self.spec.seed

    @property
    def tag(self) -> str:
        """The spec's tag, else the env name."""
        return self.spec.tag or self.spec.env_name

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(t.response_ids) for t in self.turns)

    @property
    def version_span(self) -> tuple[int, int] | None:
        """(oldest, newest) policy version that generated a token here; None if no token
        was generated."""
        if self._span is None and self.num_generated_tokens:
            versions = [t.versions for t in self.turns if t.versions]
            span = (min(map(min, versions)), max(map(max, versions)))
            object.__setattr__(self, "_span", span)
        return self._span

    @property
    def min_version(self) -> int:
        """Oldest policy version that generated a token here; -1 if none was generated."""
        span = self.version_span
        return -1 if span is None else span[0]

    @property
    def max_version(self) -> int:
        """Newest policy version that generated a token here; -1 if none was generated."""
        span = self.version_span
        return -1 if span is None else span[1]

    @property
    def group_uid(self) -> str:
        """Readable group id, e.g. ``"frozenlake/g12"`` (shared by the group's members)."""
        return f"{self.tag}/g{self.group_id}"

    @property
    def prefix_breaks(self) -> int:
        """Turns at which the chat template re-rendered earlier history (agent/dialog.py)."""
        return sum(t.prefix_break for t in self.turns)

    @property
    def traj_id(self) -> str:
        """Readable trajectory id, e.g. ``"frozenlake/g12/e98"`` (unique per episode)."""
        return f"{self.group_uid}/e{self.episode_id}"

    @property
    def initial_observation(self) -> str:
        """The observation from ``env.reset`` (the final one if no turn was taken)."""
        return self.turns[0].observation if self.turns else self.final_observation

    @property
    def step_scores(self) -> list[float]:
        return [t.reward for t in self.turns]

    def to_state(self) -> dict[str, Any]:
        """Plain-data state (see ``Turn.to_state``); ``from_state`` rebuilds an equal one."""
        return {
            "spec": self.spec.to_state(),
            "env_id": self.env_id,
            "turns": [t.to_state() for t in self.turns],
            "score": self.score,
            "success": self.success,
            "end_reason": self.end_reason,
            "error": self.error,
            "env_time_s": float(self.env_time_s),
            "engine_time_s": float(self.engine_time_s),
            "aborted_tokens": int(self.aborted_tokens),
            "clipped_rewards": int(self.clipped_rewards),
            "final_observation": self.final_observation,
            "history_window": self.history_window,
            "env_metrics": dict(self.env_metrics),
            "error_type": self.error_type,
            "error_call": self.error_call,
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Trajectory:
        spec = EpisodeSpec.from_state(state["spec"])
        turns = tuple(Turn.from_state(t) for t in state["turns"])
        return cls(**{**state, "spec": spec, "turns": turns})


def _trajectories(value: Iterable[Trajectory]) -> tuple[Trajectory, ...]:
    return tuple(value)


def _drops(value: Mapping[str, int]) -> dict[str, int]:
    return {str(k): int(v) for k, v in dict(value).items()}


def _tag_drops(value: Mapping[str, Mapping[str, int]]) -> dict[str, dict[str, int]]:
    return {str(tag): _drops(counts) for tag, counts in dict(value).items()}


def _errors(value: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Any], ...]:
    return tuple(dict(e) for e in value)


@attrs.frozen
class Group:
    """The trajectories of one group id, plus counts of what was dropped before it.

    ``drops`` counts by reason; ``tag_drops`` splits the same counts by env tag
    (``{tag: {reason: n}}``), so per-tag metrics can report them; ``errors`` holds the
    most recent errored trajectories behind them (``error_entry``: env, seed, turn,
    call, type, message). None takes part in equality.

    Examples:
        >>> turn = Turn([1, 2], [3], [-0.5], [4], 1.0, "stop", True, "Up", "Move?")
        >>> trajs = [Trajectory(EpisodeSpec(0, e, 7), 0, [turn], 1.0 - e, e == 0, "terminated")
        ...          for e in range(2)]
        >>> group = Group(0, trajs, drops={"error": 1})
        >>> len(group), group.scores, group.min_version, Group.from_state(group.to_state()) == group
        (2, [1.0, 0.0], 4, True)
    """

    group_id: int = attrs.field(validator=int_at_least(0))
    trajectories: tuple[Trajectory, ...] = attrs.field(converter=_trajectories)
    drops: Mapping[str, int] = attrs.field(factory=dict, converter=_drops, eq=False)
    tag_drops: Mapping[str, Mapping[str, int]] = attrs.field(
        factory=dict, converter=_tag_drops, eq=False
    )
    errors: tuple[Mapping[str, Any], ...] = attrs.field(default=(), converter=_errors, eq=False)

    def __attrs_post_init__(self) -> None:
        wrong = [t.traj_id for t in self.trajectories if t.group_id != self.group_id]
        if wrong:
            raise ValueError(
                f"Group {self.group_id} holds trajectories of other groups: {wrong}; "
                "group trajectories by spec.group_id first"
            )

    def __len__(self) -> int:
        return len(self.trajectories)

    @property
    def scores(self) -> list[float]:
        return [t.score for t in self.trajectories]

    @property
    def min_version(self) -> int:
        """Oldest policy version in the group (-1 if no token was generated)."""
        spans = [span for t in self.trajectories if (span := t.version_span) is not None]
        return min(span[0] for span in spans) if spans else -1

    def to_state(self) -> dict[str, Any]:
        """Plain-data state, drop counts included; ``from_state`` rebuilds an equal group."""
        return {
            "group_id": self.group_id,
            "trajectories": [t.to_state() for t in self.trajectories],
            "drops": dict(self.drops),
            "tag_drops": {tag: dict(counts) for tag, counts in self.tag_drops.items()},
            "errors": [dict(e) for e in self.errors],
        }

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> Group:
        trajectories = tuple(Trajectory.from_state(t) for t in state["trajectories"])
        tag_drops, errors = state.get("tag_drops", {}), state.get("errors", ())
        return cls(state["group_id"], trajectories, state["drops"], tag_drops, errors)
