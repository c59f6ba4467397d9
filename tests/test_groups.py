"""GroupAssembler on arbitrary arrival orders (hypothesis), keep/drop rules, staleness,
errors, and drop counts per env tag."""

from __future__ import annotations

from collections import Counter

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torchdata.nodes import IterableWrapper, Loader

from rollpipe.agent.records import Group
from rollpipe.nodes.groups import (
    GroupAssembler,
    check_group_rule,
    resolve_group_rule,
    scores_differ,
    zero_variance,
)
from rollpipe.nodes.signals import PipelineSignals

from records import make_trajectory


def tagged(traj, tag):
    return attrs.evolve(traj, spec=attrs.evolve(traj.spec, tag=tag))


def arrivals(num_groups: int, members: int, order: list[int], scores=None, errors=(), tags=None):
    """Trajectories of ``num_groups`` groups, ``members`` each, permuted by ``order``;
    group ``g`` has env tag ``tags[g]`` (default: none, so the env name)."""
    trajs = [
        make_trajectory(
            g,
            g * members + m,
            score=(scores[g][m] if scores else 1.0),
            end_reason="error" if (g, m) in errors else "terminated",
        )
        for g in range(num_groups)
        for m in range(members)
    ]
    if tags is not None:
        trajs = [tagged(t, tags[t.group_id]) for t in trajs]
    return [trajs[i] for i in order]


def summed_over_tags(tag_drops) -> Counter:
    total: Counter = Counter()
    for counts in tag_drops.values():
        total.update(counts)
    return +total


@st.composite
def group_streams(draw):
    num_groups = draw(st.integers(1, 6))
    group_size = draw(st.integers(1, 4))
    redundancy = draw(st.integers(0, 2))
    members = group_size + redundancy
    order = draw(st.permutations(list(range(num_groups * members))))
    return num_groups, group_size, redundancy, order


@settings(max_examples=60, deadline=None)
@given(group_streams())
def test_every_group_once_with_its_first_finishers(stream):
    num_groups, group_size, redundancy, order = stream
    members = group_size + redundancy
    trajs = arrivals(num_groups, members, order)
    groups = list(GroupAssembler(IterableWrapper(trajs), group_size, redundancy=redundancy))

    assert sorted(g.group_id for g in groups) == list(range(num_groups))
    for g in groups:
        arrived = [t.episode_id for t in trajs if t.group_id == g.group_id]
        assert [t.episode_id for t in g.trajectories] == arrived[:group_size]
    ids = [t.episode_id for g in groups for t in g.trajectories]
    assert len(ids) == len(set(ids))
    drops: Counter[str] = Counter()
    for g in groups:
        drops.update(g.drops)
    # late members of already emitted groups are counted, except those after the last group
    assert drops["redundant"] <= num_groups * redundancy


@settings(max_examples=60, deadline=None)
@given(group_streams(), st.data())
def test_errors_beyond_redundancy_drop_the_group(stream, data):
    num_groups, group_size, redundancy, order = stream
    members = group_size + redundancy
    errors = set(
        data.draw(
            st.lists(
                st.tuples(st.integers(0, num_groups - 1), st.integers(0, members - 1)),
                unique=True,
            )
        )
    )
    trajs = arrivals(num_groups, members, order, errors=errors)
    signals = PipelineSignals()
    node = GroupAssembler(
        IterableWrapper(trajs), group_size, redundancy=redundancy, signals=signals
    )
    groups = list(node)

    for g in groups:
        assert all(t.end_reason != "error" for t in g.trajectories)
        assert len(g.trajectories) == group_size
    emitted = {g.group_id for g in groups}
    for gid in range(num_groups):
        assert (gid in emitted) == _succeeded_first(trajs, gid, group_size, redundancy)
    dropped = sum(1 for gid in range(num_groups) if gid not in emitted)
    # every dropped group asked for a replacement and is counted as errored
    counted = sum(g.drops.get("errored", 0) for g in groups) + node.pending_drops.get("errored", 0)
    assert counted == dropped == signals.replacements_pending


def _succeeded_first(trajs, gid, group_size, redundancy):
    good = bad = 0
    for t in trajs:
        if t.group_id != gid:
            continue
        if t.end_reason == "error":
            bad += 1
            if bad > redundancy:
                return False
        else:
            good += 1
            if good == group_size:
                return True
    return False


def generated(trajectories) -> int:
    """Tokens the engine generated for ``trajectories``: wasted when they are dropped."""
    return sum(t.num_generated_tokens for t in trajectories)


def test_zero_variance_drop_rule_drops_and_requests_replacements():
    scores = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]
    trajs = arrivals(3, 2, list(range(6)), scores=scores, tags=["a", "b", "c"])
    signals = PipelineSignals()
    node = GroupAssembler(IterableWrapper(trajs), 2, drop_group="zero_variance", signals=signals)
    groups = list(node)
    assert [g.group_id for g in groups] == [1]
    dropped_a = {"filtered": 1, "wasted_tokens": generated(trajs[:2])}
    dropped_c = {"filtered": 1, "wasted_tokens": generated(trajs[4:])}
    assert groups[0].drops == dropped_a
    assert groups[0].tag_drops == {"a": dropped_a}
    assert node.pending_drops == dropped_c  # group 2, after the last emitted group
    assert node.pending_tag_drops == {"c": dropped_c}
    assert node.total_tag_drops == {"a": dropped_a, "c": dropped_c}
    assert signals.replacements_pending == 2
    equal = Group(group_id=0, trajectories=trajs[:2])
    assert zero_variance(equal) and not scores_differ(equal)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=2, max_size=2), max_size=6))
def test_keep_and_drop_rules_have_the_polarity_their_names_say(scores):
    """keep_group=scores_differ and drop_group='zero_variance' keep the same groups:
    exactly those whose scores differ."""
    trajs = arrivals(len(scores), 2, list(range(2 * len(scores))), scores=scores)
    expected = [g for g, pair in enumerate(scores) if pair[0] != pair[1]]

    def kept(**rule):
        node = GroupAssembler(IterableWrapper(trajs), 2, max_drops_in_a_row=100, **rule)
        return [g.group_id for g in node]

    assert kept(keep_group="scores_differ") == expected
    assert kept(keep_group=scores_differ) == expected
    assert kept(drop_group="zero_variance") == expected
    assert kept(drop_group=zero_variance) == expected
    assert kept(keep_group="scores_differ", drop_group="operator:not_") == expected
    everything = list(range(len(scores)))
    assert kept(keep_group="operator:truth") == everything  # a non-empty Group is truthy
    assert kept(drop_group="operator.not_") == everything  # ROLL's dotted path form
    assert kept(drop_group=lambda g: True) == []


def test_rule_errors_name_the_field_and_the_value():
    with pytest.raises(ValueError, match=r"keep_group='zero_variance': .* is a drop_group rule"):
        GroupAssembler(IterableWrapper([]), 2, keep_group="zero_variance")
    with pytest.raises(ValueError, match=r"drop_group='scores_differ': .* is a keep_group rule"):
        GroupAssembler(IterableWrapper([]), 2, drop_group="scores_differ")
    cases = {
        "nope": r"GroupAssembler.drop_group: unknown name 'nope'; give a registered name "
        r"\(\['zero_variance'\]\), a callable Group -> bool, or an import path",
        "no_such_module_x:fn": r"GroupAssembler.drop_group: cannot import 'no_such_module_x:fn' "
        r"\(ModuleNotFoundError",
        "operator:nope": r"cannot import 'operator:nope' \(AttributeError",
        "math:pi": r"GroupAssembler.drop_group: 'math:pi' is not callable",
        "collections:Counter": r"'collections:Counter' is a class; give a function",
        "operator:add": r"'operator:add' must take one argument, the Group",
    }
    for value, message in cases.items():
        with pytest.raises(ValueError, match=message):
            GroupAssembler(IterableWrapper([]), 2, drop_group=value)
    with pytest.raises(ValueError, match=r"keep_group: 3 is not callable"):
        GroupAssembler(IterableWrapper([]), 2, keep_group=3)  # type: ignore[arg-type]


def test_config_validator_names_the_config_field():
    @attrs.frozen
    class Config:
        drop_group: str | None = attrs.field(default=None, validator=check_group_rule)

    assert Config("zero_variance").drop_group == "zero_variance"
    assert Config("operator:not_").drop_group == "operator:not_"
    with pytest.raises(ValueError, match=r"Config.drop_group: cannot import 'nowhere_x:f'"):
        Config("nowhere_x:f")
    assert resolve_group_rule(None, "keep_group") is None
    with pytest.raises(ValueError, match="field must end in 'keep_group' or 'drop_group'"):
        resolve_group_rule("zero_variance", "filter")


@settings(max_examples=60, deadline=None)
@given(group_streams(), st.data())
def test_drops_per_tag_add_up_to_the_drops(stream, data):
    """Whatever is dropped (errored, empty of signal, redundant, incomplete), the per-tag
    counts sum to the global ones, on every group, pending and in total, and each drop
    is counted under the tag of the group it came from."""
    num_groups, group_size, redundancy, order = stream
    members = group_size + redundancy
    tags = data.draw(
        st.lists(st.sampled_from(["a", "b", "c/d"]), min_size=num_groups, max_size=num_groups)
    )
    errors = set(
        data.draw(
            st.lists(
                st.tuples(st.integers(0, num_groups - 1), st.integers(0, members - 1)), unique=True
            )
        )
    )
    scores = [
        [data.draw(st.sampled_from([0.0, 1.0])) for _ in range(members)] for _ in range(num_groups)
    ]
    trajs = arrivals(num_groups, members, order, scores=scores, errors=errors, tags=tags)
    cut = data.draw(st.integers(0, len(trajs)))  # an unfinished stream leaves groups incomplete
    node = GroupAssembler(
        IterableWrapper(trajs[:cut]),
        group_size,
        redundancy=redundancy,
        drop_group="zero_variance",
        signals=PipelineSignals(),
        max_drops_in_a_row=1000,
    )
    groups = list(node)
    for g in [*groups, None]:
        drops = node.pending_drops if g is None else g.drops
        tag_drops = node.pending_tag_drops if g is None else g.tag_drops
        assert summed_over_tags(tag_drops) == +Counter(drops)
    assert summed_over_tags(node.total_tag_drops) == +node.total_drops
    # groups are assembled independently, so a tag's counts are what its groups alone give
    for tag in set(tags):
        alone = GroupAssembler(
            IterableWrapper([t for t in trajs[:cut] if t.tag == tag]),
            group_size,
            redundancy=redundancy,
            drop_group="zero_variance",
            max_drops_in_a_row=1000,
        )
        list(alone)
        assert +node.total_tag_drops.get(tag, Counter()) == +alone.total_drops


@given(cap=st.integers(1, 6), kept_after=st.integers(0, 8))
def test_a_filter_that_rejects_everything_gives_up_after_max_drops_in_a_row(cap, kept_after):
    """Groups with all-equal scores are dropped; a kept group resets the count, and
    ``cap`` drops in a row raise an error naming the reason, not spin forever."""
    n_groups = kept_after + cap + 1
    scores = [[1.0, 1.0]] * n_groups
    scores[kept_after] = [0.0, 1.0]  # the one group with a signal
    trajs = arrivals(n_groups, 2, list(range(2 * n_groups)), scores=scores)
    node = GroupAssembler(
        IterableWrapper(trajs), 2, drop_group="zero_variance", max_drops_in_a_row=cap
    )
    if kept_after >= cap:  # the cap is hit before the kept group arrives
        with pytest.raises(RuntimeError, match=rf"{cap} groups in a row .*'filtered': {cap}"):
            next(node)
        return
    assert next(node).group_id == kept_after
    with pytest.raises(RuntimeError, match=f"{cap} groups in a row were dropped"):
        next(node)


def test_stale_groups_are_dropped():
    version = {"now": 5}
    old = [make_trajectory(0, i, version=1) for i in range(2)]
    fresh = [make_trajectory(1, 2 + i, version=4) for i in range(2)]
    node = GroupAssembler(
        IterableWrapper(old + fresh), 2, max_staleness=2, current_version=lambda: version["now"]
    )
    groups = list(node)
    assert [g.group_id for g in groups] == [1]
    stale = {"stale": 1, "wasted_tokens": generated(old)}
    assert groups[0].drops == stale
    assert groups[0].tag_drops == {"frozenlake": stale}  # no tag: the env name


def test_redundant_members_are_cancelled_through_control():
    trajs = arrivals(1, 3, [2, 0, 1])
    signals = PipelineSignals()
    node = GroupAssembler(IterableWrapper(trajs), 2, redundancy=1, signals=signals)
    group = next(node)
    assert [t.episode_id for t in group.trajectories] == [2, 0]
    assert signals.is_cancelled(0)


def test_checkpoint_mid_stream_resumes_exactly():
    order = [0, 3, 1, 4, 6, 2, 7, 5, 8]
    trajs = arrivals(3, 3, order)
    full = [g.group_id for g in Loader(GroupAssembler(IterableWrapper(trajs), 3))]

    loader = Loader(GroupAssembler(IterableWrapper(trajs), 3))
    it = iter(loader)
    first = next(it)
    state = loader.state_dict()
    resumed = Loader(GroupAssembler(IterableWrapper(trajs), 3))
    resumed.load_state_dict(state)
    rest = [g.group_id for g in resumed]
    assert [first.group_id, *rest] == full


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        GroupAssembler(IterableWrapper([]), 0)
    with pytest.raises(ValueError, match="max_staleness needs current_version"):
        GroupAssembler(IterableWrapper([]), 2, max_staleness=1)
    with pytest.raises(ValueError, match="keep_group: unknown name 'nope'"):
        GroupAssembler(IterableWrapper([]), 2, keep_group="nope")
    with pytest.raises(ValueError, match="max_drops_in_a_row must be an int >= 1, got 0"):
        GroupAssembler(IterableWrapper([]), 2, max_drops_in_a_row=0)


def test_trajectories_without_turns_fail_their_group():
    from rollpipe.agent.records import Trajectory

    empty = Trajectory(
        spec=make_trajectory(0, 1).spec,
        env_id=0,
        turns=(),
        score=0.0,
        success=False,
        end_reason="max_length",
    )
    trajs = [make_trajectory(0, 0), empty, make_trajectory(1, 2), make_trajectory(1, 3)]
    signals = PipelineSignals()
    groups = list(GroupAssembler(IterableWrapper(trajs), 2, signals=signals))
    assert [g.group_id for g in groups] == [1]
    assert groups[0].drops == {
        "empty_trajectories": 1,
        "empty": 1,
        "wasted_tokens": generated(trajs[:1]),  # the good member of the failed group
    }
    assert signals.replacements_pending == 1


def env_error(traj, env="nan_lake", call="NanLake.step"):
    """``traj`` as run_episode records an env error: the exception's repr, then where."""
    s = traj.spec
    where = f"{call}: env {env!r}, seed {s.seed}, episode {s.episode_id}, turn 0"
    return attrs.evolve(
        traj,
        spec=attrs.evolve(s, env_name=env),
        error=f"EnvReturnError('{call}: reward is nan; a reward must be a finite number') "
        f"(in {where})",
        error_type="EnvReturnError",
        error_call=call,
    )


@settings(max_examples=40, deadline=None)
@given(cap=st.integers(1, 7), group_size=st.integers(1, 3))
def test_groups_dropped_in_a_row_for_errors_quote_the_last_errors(cap, group_size):
    """Issue 22: the error said ``{'errored': 20}`` and named ``max_staleness`` (no
    longer a PipelineConfig field) but not why the episodes errored. It now quotes the
    last ``ERRORS_QUOTED`` errors (env, call, seed, field and value, as the env's
    exception said) and names only the settings that dropped the groups."""
    from rollpipe.nodes.starved import ERRORS_QUOTED

    trajs = [
        env_error(make_trajectory(g, g * group_size + m, end_reason="error"))
        for g in range(cap)
        for m in range(group_size)
    ]
    node = GroupAssembler(IterableWrapper(trajs), group_size, max_drops_in_a_row=cap)
    with pytest.raises(RuntimeError) as info:
        next(node)
    message = str(info.value)
    assert message.startswith(
        f"GroupAssembler: {cap} groups in a row were dropped and none kept ({{'errored': {cap}}})"
    )
    # the cap is hit at the first error of the last group: errors up to it are quoted
    seen = trajs[: (cap - 1) * group_size + 1]
    quoted = seen[-ERRORS_QUOTED:]
    for t in quoted:
        assert f"* {t.error}" in message
        assert f"env 'nan_lake', seed {t.seed}, episode {t.episode_id}," in message
    for t in seen[:-ERRORS_QUOTED]:
        assert f"episode {t.episode_id}," not in message
    assert f"the last {len(quoted)} errors:" in message
    assert "NanLake.step: reward is nan" in message and "redundancy=0" in message
    assert "max_staleness" not in message and "keep_group" not in message
    assert "max_drops_in_a_row=" in message


def test_groups_dropped_in_a_row_name_todays_settings():
    """Stale and filtered drops name the settings a pipeline user sets
    (``async_generation_ratio``, ``keep_group`` / ``drop_group``), not ``max_staleness``."""
    old = [make_trajectory(g, g, version=0) for g in range(3)]
    node = GroupAssembler(
        IterableWrapper(old), 1, max_staleness=1, current_version=lambda: 4, max_drops_in_a_row=3
    )
    with pytest.raises(RuntimeError) as info:
        next(node)
    message = str(info.value)
    assert "({'stale': 3})" in message and "more than 1 policy versions behind" in message
    assert "PipelineConfig.async_generation_ratio" in message
    assert "max_staleness" not in message and "errors:" not in message
    same = arrivals(2, 2, [0, 1, 2, 3], scores=[[1.0, 1.0], [0.0, 0.0]])
    node = GroupAssembler(
        IterableWrapper(same), 2, drop_group="zero_variance", max_drops_in_a_row=2
    )
    with pytest.raises(RuntimeError) as info:
        next(node)
    message = str(info.value)
    assert "({'filtered': 2})" in message
    assert "keep_group=None / drop_group='zero_variance' rejected every complete group" in message
    assert "async_generation_ratio" not in message
