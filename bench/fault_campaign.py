"""Fault campaign: random fault points over text, tool and agent episodes; nothing may be
lost, duplicated or hang.

``python -m bench.fault_campaign --points 10000`` (``--smoke``: 18 points, no cluster or
driver run; ``python -m bench.run --only fault_campaign``). A *run* is one pipeline on one
episode kind — ``text`` (FrozenLake), ``tool`` (the calculator ``ToolEnv``, hermes calls)
or ``agent`` (an ``AgentEnv`` whose ``openai`` client makes two calls through the front
door) — and one engine: ``scripted`` (a two-rank ``EnginePool`` of :class:`SteppedEngine`:
a scripted answer, one token every :data:`STEP_S`, so points find requests in flight;
cheap, most points) or ``vllm`` (the tiny tools model on the in-process ``VLLMEngine``;
``--vllm-share`` of the runs) or ``workers`` (the scripted pool, the episodes run in two
episode workers, ``rollout={"episode_workers": 2}``, Ray actors; ``--workers-share`` of the
runs, compared with the *in-process* scripted reference: same ids) or ``cluster`` (a Ray
cluster of several nodes on this machine, :mod:`bench.ray_nodes`: each rank of a two-rank
pool of ``RayEngine`` actors, hosting the stepped scripted engine, on a node of its own,
its two episode workers on a third; ``--cluster-share``; the in-process scripted reference;
``node_kill`` points only) or ``driver`` (the checkpointing driver process
``bench/driver_run.py``, FrozenLake on a scripted engine; ``--driver-share``; ``sigkill``
points only). Each of its ``--batches`` batches is one *point*: a fault kind drawn from
:data:`FAULTS` is injected at a random place in it. The run's trajectory ids (group id,
episode id) are compared with an uninterrupted reference run of the same config and seed:
**lost** (in the reference, never yielded), **duplicated** (yielded more than once),
**unexpected** (yielded, not in the reference) are counted against the point whose batch
showed them, with the kind's own check (:attr:`FaultKind.check`). A ``driver`` run is its
own: its ``--batches`` points are SIGKILLs of the driver at random places over twice as
many batches, each restart resuming from its newest complete checkpoint
(:mod:`bench.driver_kill`), and its finished batches' digests are compared with an
uninterrupted driver's: there lost, duplicated and unexpected count *batches*. A **hang**
is a point that does not finish within ``--watchdog-s`` (generous: points take milliseconds
to seconds): the watchdog records the point, dumps every thread's stack to stderr and
closes the pipeline, which wakes a blocked ``get_batch``; no wait in a point is timed (each
waits for an event: the n-th engine request, the batch's return).

The report (``bench/results/fault_campaign.json``; ``--out`` elsewhere) gives points,
lost, duplicated, unexpected, hangs and failed checks per fault kind, per episode kind,
per engine and per (kind, episode kind), with the command and wall time, and per engine
the requests, the aborted answers (regenerated) and the requests a shrink re-sent (the
cluster: nodes killed, requests re-sent after a node's loss; the driver: kills, restarts
and where each kill landed). Exit status 1 if any count is not 0.

Adding a fault kind
-------------------
A fault kind is a name in :data:`FAULTS` mapped to a :class:`FaultKind`: ``inject(run,
rng)`` collects one batch with the fault injected at a random point and returns it
(``run.during_batch(rng, action)`` runs ``action`` on this thread at a random engine
request while another thread is in ``get_batch``; ``run.replace_pipeline()`` swaps in a
fresh pipeline; a point that needs more of the run's batches, up to ``run.batches_left``,
returns the list of them, as ``node_kill`` does), ``expected`` says the outcome in
words, ``check(run)`` returns what went wrong beyond loss and duplication (empty: fine),
``engines`` where it applies. Register
it with ``@fault_kind("my_kind", expected=..., engines=("scripted",))`` on the inject
function; the loop, the reference comparison, the watchdog and the report pick it up
with no other change (``worker_kill`` and ``node_kill`` were added this way). A kind
whose points are a whole run outside this process (``sigkill``) is a :class:`FaultKind`
with ``whole_run(setup, tally, rng, watchdog_s)``, which makes and counts its points.

Cluster and driver runs cost seconds a point (a node's death and a new node with a new
actor; a process start per restart), so they are a small share of the runs (0.002 each,
plus one run of each: about 30 points of each in 10,000) and not in ``--smoke``
(tests/distributed/test_fault_campaign_nodes.py runs two points of each).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import functools
import io
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from bench.driver_kill import DriverSilent, forks, kill_and_resume, kill_live, random_plan
from bench.driver_kill import reference as driver_reference
from bench.driver_run import PRELOAD_SCRIPTED
from bench.ray_nodes import ray_cluster
from rollpipe.data.proto import DataProto
from rollpipe.engines.backend import EngineLink
from rollpipe.engines.base import BaseEngine
from rollpipe.engines.protocol import PauseMode
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

RESULTS = Path(__file__).resolve().parent / "results"
REPORT_NAME = "fault_campaign.json"
EPISODE_KINDS = ("text", "tool", "agent")
ENGINES = ("scripted", "vllm", "workers")
"""The engines of a fault kind that names none (``cluster`` and ``driver`` run only their own)."""
ALL_ENGINES = (*ENGINES, "cluster", "driver")
COUNTS = ("points", "lost", "duplicated", "unexpected", "hangs", "failed_checks")

STEP_S = 0.0005
"""The scripted ranks' time per token: a 16-token answer is in flight for about 8 ms."""

NODE_STEP_S = 0.01
"""A ``cluster`` rank's time per token: an answer is in flight for about 0.2 s, longer than
SIGKILLing a node takes, so a node kill finds requests in flight (at 8 ms, 14 of 15 engine
node kills of a 10,000-point campaign found none: they had finished meanwhile)."""

Ids = list[tuple[int, int]]
Batches = DataProto | list[DataProto]
"""What a point gives: its batch, or the batches of a point that takes more than one."""
Policy = Callable[[Sequence[int], SamplingParams], Sequence[int]]


# -- the registry ------------------------------------------------------------------------
@attrs.frozen
class FaultKind:
    """One fault kind: how it is injected into a batch, and what must follow."""

    name: str
    inject: Callable[[Run, random.Random], Batches]
    expected: str
    check: Callable[[Run], list[str]] = lambda run: []
    engines: tuple[str, ...] = ENGINES
    whole_run: Callable[[Setup, Tally, random.Random, float], None] | None = None
    """For a kind whose points are a whole run outside this process (``sigkill``):
    ``whole_run(setup, tally, rng, watchdog_s)`` makes and counts a run's points itself."""


FAULTS: dict[str, FaultKind] = {}
"""Fault kind name -> :class:`FaultKind` (see "Adding a fault kind" above)."""


def fault_kind(
    name: str,
    *,
    expected: str,
    check: Callable[[Run], list[str]] | None = None,
    engines: tuple[str, ...] = ENGINES,
) -> Callable[[Callable[[Run, random.Random], Batches]], Callable[..., Batches]]:
    """Register the decorated ``inject(run, rng) -> batch`` as fault kind ``name``."""

    def register(inject: Callable[[Run, random.Random], Batches]) -> Callable[..., Batches]:
        if name in FAULTS:
            raise ValueError(f"fault kind {name!r} is registered already")
        FAULTS[name] = FaultKind(name, inject, expected, check or (lambda run: []), engines)
        return inject

    return register


# -- one run: a pipeline, the point trigger, the watchdog ----------------------------------
class Tap:
    """Counts engine requests; :meth:`arm` sets ``point`` at the n-th request from now.
    Called on the engine's loop (``tick``) and from the campaign thread (``arm``)."""

    def __init__(self) -> None:
        self.requests = 0
        self.aborted = 0  # answers with finish_reason "abort" (regenerated by the episode)
        self._at: int | None = None
        self._event: threading.Event | None = None
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            self.requests += 1
            if self._at is not None and self.requests >= self._at and self._event is not None:
                self._event.set()
                self._at = None

    def arm(self, n: int, event: threading.Event) -> None:
        with self._lock:
            self._at, self._event = self.requests + n, event
        if n == 0:
            event.set()  # before the batch's first request


class Run:
    """One pipeline on one episode kind and engine, with what fault kinds need."""

    def __init__(self, setup: Setup, episode_kind: str, engine_kind: str, seed: int) -> None:
        self.setup, self.episode_kind, self.engine_kind = setup, episode_kind, engine_kind
        self.tap = setup.taps[engine_kind]
        self.hung = threading.Event()  # set by the watchdog: waits in a point end
        self.batch_done = threading.Event()  # during_batch's get_batch returned
        self.batches_left = 0  # the batches the run still takes, this point's first
        self._cluster: contextlib.ExitStack | None = None
        if engine_kind == "cluster":  # a cluster of its own: a run kills its nodes
            self._cluster = contextlib.ExitStack()
            nodes = ray_cluster(CLUSTER_ROLES, {WORKERS_ROLE: WORKERS_NODE_CPUS})
            self.nodes = self._cluster.enter_context(nodes)
            self.node_kills = kill_turns(seed)  # engine node or workers node, in turn
            self.engine = self._cluster.enter_context(setup.cluster_pool())
        else:
            self.engine = setup.engine(engine_kind)
        self.config = setup.config(episode_kind, seed, engine_kind)
        self.weights = setup.weights(engine_kind)
        self.pipe = self.new_pipeline()
        self.notes: list[str] = []  # what a kind's check found

    def on_hang(self) -> None:
        """The watchdog's: end the point's waits and close the pipeline."""
        self.hung.set()
        self.pipe.close()

    def close(self) -> None:
        """Close the pipeline, and the run's cluster if it has one (its pool first)."""
        try:
            self.close_pipeline()
        finally:
            if self._cluster is not None:
                self.setup.cluster_counts.update(rerouted_by_node_loss=self.engine.rerouted)
                self._cluster.close()

    def new_pipeline(self) -> RolloutPipeline:
        self.kills = 0  # episode workers killed in this pipeline
        if self.engine_kind not in ("workers", "cluster"):
            return RolloutPipeline(self.config, self.engine, self.setup.tokenizer)
        _start_ray()  # the workers build their envs themselves: the agent env by factory
        return RolloutPipeline(
            self.config, self.engine, self.setup.tokenizer, env_factory=campaign_env
        )

    def close_pipeline(self) -> None:
        """Close the pipeline, counting what its episode workers did first."""
        workers = self.pipe.nodes.rollout.workers
        if workers is not None and self.engine_kind == "workers":
            self.setup.worker_counts.update(replaced=workers.replaced, reruns=workers.reruns)
        elif workers is not None:  # on the cluster: replaced after their node's death
            counts = {"workers_replaced": workers.replaced, "workers_reruns": workers.reruns}
            self.setup.cluster_counts.update(counts)
        self.pipe.close()

    def replace_pipeline(self, state: dict[str, Any] | None = None) -> None:
        """Close the pipeline; a fresh one takes its place (loading ``state`` if given)."""
        self.close_pipeline()
        self.pipe = self.new_pipeline()
        if state is not None:
            self.pipe.load_state_dict(state)

    def during_batch(
        self, rng: random.Random, action: Callable[[], None], within: int | None = None
    ) -> DataProto:
        """``get_batch`` on another thread; ``action()`` here at a random engine request
        of it, among its first ``within`` (default twice the batch size; or when it
        returns, if it needs fewer); then the batch. ``batch_done`` is set once
        ``get_batch`` returned (an action may wait for a state until then)."""
        out: dict[str, Any] = {}
        point = threading.Event()
        self.batch_done = done = threading.Event()

        def collect() -> None:
            try:
                out["batch"] = self.pipe.get_batch()
            except BaseException as e:  # raised below
                out["error"] = e
            finally:
                done.set()
                point.set()

        last = 2 * self.config.batch_size if within is None else within
        self.tap.arm(rng.randint(0, last), point)
        worker = threading.Thread(target=collect, name="campaign-collect")
        worker.start()
        point.wait()  # bounded by the watchdog, which closes the pipeline
        action()
        worker.join()
        if "error" in out:
            raise out["error"]
        return out["batch"]


class Watchdog:
    """Fires when a point outlives ``seconds``: records it, dumps the stacks, closes the
    pipeline (waking ``get_batch``); a second period later it ends the process."""

    def __init__(self, seconds: float, on_hang: Callable[[], None]) -> None:
        self.seconds, self.on_hang = seconds, on_hang
        self.fired = False
        self._timer: threading.Timer | None = None

    def __enter__(self) -> Watchdog:
        self.fired = False
        self._timer = threading.Timer(self.seconds, self._fire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def _fire(self) -> None:
        self.fired = True
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        last = threading.Timer(self.seconds, lambda: os._exit(3))  # truly stuck
        last.daemon = True
        last.start()
        self.on_hang()
        last.cancel()

    def __exit__(self, *exc: object) -> None:
        assert self._timer is not None
        self._timer.cancel()


# -- the fault kinds ---------------------------------------------------------------------
def _suspend(mode: str) -> Callable[[Run, random.Random], DataProto]:
    def inject(run: Run, rng: random.Random) -> DataProto:
        update = rng.random() < 0.5

        def act() -> None:
            run.pipe.suspend(mode)  # type: ignore[arg-type]
            if update:
                before = run.pipe.version
                if run.pipe.update_weights(run.weights) != before + 1:
                    run.notes.append(f"update_weights did not move the version from {before}")
            run.pipe.resume()

        return run.during_batch(rng, act)

    return inject


for _mode, _what in (
    ("keep", "in-flight requests freeze and go on after resume"),
    ("abort", "in-flight requests are aborted and their turns regenerated"),
    ("wait", "in-flight requests finish before the pause"),
):
    fault_kind(f"suspend_{_mode}", expected=f"{_what}; the batch is the reference's")(
        _suspend(_mode)
    )


@fault_kind(
    "checkpoint",
    expected="state_dict (through torch.save / torch.load, weights_only) restored into a "
    "fresh pipeline yields the reference's batches",
)
def checkpoint(run: Run, rng: random.Random) -> DataProto:
    buffer = io.BytesIO()
    torch.save(run.pipe.state_dict(), buffer)
    buffer.seek(0)
    run.replace_pipeline(torch.load(buffer, weights_only=True))
    batch = run.pipe.get_batch()
    assert batch is not None
    return batch


def _all_ranks_back(run: Run) -> list[str]:
    ranks = run.engine.active_ranks
    return [] if ranks == [0, 1] else [f"pool ranks after expand: {ranks}, not [0, 1]"]


@fault_kind(
    "shrink_expand",
    expected="rank 1 leaves mid-batch (its requests re-sent to rank 0) and comes back "
    "before the next point; the batch is the reference's",
    check=_all_ranks_back,
    engines=("scripted", "workers"),
)
def shrink_expand(run: Run, rng: random.Random) -> DataProto:
    def leave() -> None:
        run.pipe.shrink_sampler([1])

    batch = run.during_batch(rng, leave)
    fresh = run.engine.version == 0  # a rebuilt rank starts at 0: skip_load fits only then
    run.pipe.expand_sampler([1], skip_load=fresh and rng.random() < 0.5)
    return batch


def _replaced_no_more_than_killed(run: Run) -> list[str]:
    replaced = run.pipe.nodes.rollout.workers.replaced
    return [f"{replaced} workers replaced after {run.kills} kills"] if replaced > run.kills else []


@fault_kind(
    "worker_kill",
    expected="an episode worker (a Ray actor) killed mid-batch is replaced in its slot and "
    "the episodes it ran run again from their specs; the batch is the in-process reference's",
    check=_replaced_no_more_than_killed,
    engines=("workers",),
)
def worker_kill(run: Run, rng: random.Random) -> DataProto:
    import ray

    workers = run.pipe.nodes.rollout.workers

    def kill() -> None:
        live = [link for link in workers._links if link is not None and link.lost is None]
        busy = [link for link in live if link.running] or live  # one running episodes, if any
        ray.kill(rng.choice(busy).actor, no_restart=True)
        run.kills += 1
        run.setup.worker_counts.update(kills=1)

    return run.during_batch(rng, kill)


WORKERS_ROLE, WORKERS_NODE_CPUS = "workers", 2
CLUSTER_ROLES = ("engine_0", "engine_1", WORKERS_ROLE)
"""The worker nodes of a ``cluster`` run: rank ``r`` of its pool on ``engine_r``, its two
episode workers on ``workers``."""
WORKER_OPTIONS = {"resources": {WORKERS_ROLE: 0.01}, "num_cpus": 0.5}


def kill_turns(seed: int) -> Iterator[bool]:
    """Whether each node kill of a run takes the workers' node (else an engine rank's):
    in turn, starting at random, so any two points of a run kill one of each."""
    first = random.Random(seed).random() < 0.5
    while True:
        yield first
        first = not first


def _cluster_whole(run: Run) -> list[str]:
    ranks, failures = run.engine.active_ranks, run.engine.failures()
    if ranks == [0, 1] and not failures:
        return []
    return [f"pool ranks after the new node: {ranks}, failures {sorted(failures)}"]


def _until(run: Run, done: Callable[[], bool], what: str) -> None:
    """Wait for ``done()`` (checked every 5 ms: the latency of noticing it), or until the
    watchdog fires for this point."""
    while not done():
        if run.hung.wait(0.005):
            raise RuntimeError(f"the watchdog fired waiting for {what}")


@fault_kind(
    "node_kill",
    expected="the Ray node of an engine rank with requests in flight is SIGKILLed "
    "mid-batch (the point takes the run's next batches until one has requests in flight): "
    "the pool takes the rank out and re-sends its requests; a new node "
    "and expand_sampler bring it back before the next point; or (every other point) the "
    "episode workers' node: a new node at once, its workers replaced, their episodes run "
    "again; the batch is the in-process reference's",
    check=_cluster_whole,
    engines=("cluster",),
)
def node_kill(run: Run, rng: random.Random) -> Batches:
    if next(run.node_kills):
        return _workers_node_kill(run, rng)
    pool, lost = run.engine, {}
    batches: list[DataProto] = []

    def busy() -> list[int]:
        return [load.rank for load in pool.loads() if load.requests]

    def kill(rank: int, with_requests: bool) -> None:
        run.nodes.kill(f"engine_{rank}")
        lost["rank"] = rank
        run.setup.cluster_counts.update(engine_node_kills=1, killed_with_requests=with_requests)

    def kill_if_busy() -> None:
        # a rank with requests in flight, if one comes before the batch returns or, after
        # it, while episodes run (the refill's: each makes a request a turn)
        runner = run.pipe.nodes.rollout
        _until(
            run,
            lambda: bool(busy()) or (run.batch_done.is_set() and not runner.num_in_flight),
            "requests in flight",
        )
        if ranks := busy():
            kill(rng.choice(ranks), True)

    # The pipeline collects ahead (its buffer, then the batches made from it), so a
    # batch is often made before get_batch is called and no request comes meanwhile: the
    # point then takes the run's next batch too, until one finds requests in flight (the
    # refill runs between and during them); with no batch left, a rank with none dies.
    while "rank" not in lost and len(batches) < run.batches_left:
        batches.append(run.during_batch(rng, kill_if_busy, within=run.config.batch_size - 1))
    if "rank" not in lost:
        kill(rng.choice(pool.active_ranks), False)
    rank = lost["rank"]
    # the pool notices a death when a request to the rank fails: wait for that if some
    # are in flight there; a death no request saw yet is taken out as a shrink would
    _until(
        run,
        lambda: (
            rank in pool.failures()
            or not any(load.rank == rank and load.requests for load in pool.loads())
        ),
        f"the pool to take out rank {rank}",
    )
    if rank not in pool.failures():
        run.setup.cluster_counts.update(unseen_deaths_shrunk=1)
        run.pipe.shrink_sampler([rank])
    run.nodes.add(f"engine_{rank}")
    run.pipe.expand_sampler([rank])
    run.setup.cluster_counts.update(engine_node_kill_batches=len(batches))
    return batches


def _workers_node_kill(run: Run, rng: random.Random) -> DataProto:
    """The episode workers' node SIGKILLed mid-batch and a new one added at once (the
    slots' new workers start there); the episodes they ran run again from their specs."""

    def kill() -> None:
        run.nodes.kill(WORKERS_ROLE)
        run.nodes.add(WORKERS_ROLE, WORKERS_NODE_CPUS)
        run.setup.cluster_counts.update(workers_node_kills=1)

    return run.during_batch(rng, kill)


def _no_batch(run: Run, rng: random.Random) -> DataProto:
    raise TypeError("sigkill points are whole runs (FaultKind.whole_run), not one batch")


LANDINGS = {
    "mid-write": "landed_mid_checkpoint_write",
    "between result": "landed_between_batch_and_checkpoint",
    "after checkpoint": "landed_after_checkpoint",
    "making the first": "landed_making_first_batch_after_resume",
    "held at the end": "landed_after_last_batch",
}


def _landing(where: str) -> str:
    """A kill's landing (``bench.driver_kill.landing``) as a report key."""
    return next((key for text, key in LANDINGS.items() if text in where), "landed_elsewhere")


def sigkill_run(setup: Setup, tally: Tally, rng: random.Random, watchdog_s: float) -> None:
    """``setup.batches`` SIGKILLs of the checkpointing driver (``bench/driver_run.py``,
    scripted engine, FrozenLake) at random places over ``2 * setup.batches`` batches, each
    restart resuming from its newest complete checkpoint; the finished results file
    compared with an uninterrupted run's by digest: a batch missing is lost, one twice is
    duplicated, one whose digest differs is unexpected (batches, not trajectories); a batch
    made before a kill that differs from the reference, or a broken resume rule, fails the
    kind's check; a driver silent for ``watchdog_s`` is a hang."""
    kills, batches = setup.batches, 2 * setup.batches
    ref = setup.driver_reference(batches)
    plan = random_plan(rng, kills)
    cell = ("sigkill", "text", "driver")
    tally.add(cell, points=kills)
    workdir = Path(tempfile.mkdtemp(prefix="killed-", dir=setup.scratch()))
    try:
        out = kill_and_resume(
            workdir, batches, "scripted", plan, forked=True, deadline_s=watchdog_s
        )
    except DriverSilent as exc:
        kill_live()
        tally.add(cell, hangs=1)
        tally.hung.append({"point": f"sigkill plan {plan}", "error": str(exc)[:300]})
        return
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    made = Counter(k for k, _ in out.final)
    tally.add(cell, lost=sum(k not in made for k in range(batches)))
    tally.add(cell, duplicated=sum(n - 1 for n in made.values()))
    tally.add(cell, unexpected=sum(not (0 <= k < batches and d == ref[k]) for k, d in out.final))
    notes = out.notes + [
        f"batch {k} made before a kill differs from the reference"
        for k, d in out.printed
        if 0 <= k < batches and d != ref[k]
    ]
    tally.add(cell, failed_checks=len(notes))
    tally.failed += [f"sigkill plan {plan}: {n}" for n in notes]
    setup.driver_counts.update(
        kills=kills, restarts=kills + 1, batches_made=len(out.printed), batches=batches
    )
    setup.driver_counts.update(_landing(where) for where in out.landed)


FAULTS["sigkill"] = FaultKind(
    "sigkill",
    _no_batch,
    expected="the driver process SIGKILLed (mid-batch, between a batch and its checkpoint, "
    "mid-checkpoint-write) and restarted resumes from its newest complete checkpoint; its "
    "batches equal the uninterrupted run's bitwise (digests), none missing, none twice",
    engines=("driver",),
    whole_run=sigkill_run,
)


def _start_ray() -> None:
    import ray

    if not ray.is_initialized():
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # campaign_env
        ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)


def campaign_env(spec: Any) -> Any:
    """The env of a spec in an episode worker (the campaign's agent is registered only in
    the driver's registry)."""
    from rollpipe.envs import make
    from rollpipe.frontdoor import AgentEnv

    if spec.env_name == "campaign_agent":
        return AgentEnv(two_call_agent, task=lambda seed: f"What is {seed % 50} + 3?")
    return make(spec.env_name, **dict(spec.env_config))


# -- engines, episode kinds, references ---------------------------------------------------
class _SteppedBackend:
    """A scripted answer produced one token per ``step_s`` (bench only), so requests are
    in flight when a point lands: ``keep`` freezes them between tokens, ``abort`` ends
    them (and queued ones) with "abort" and what they had, ``wait`` lets them finish;
    new requests queue while paused."""

    vocab_size = None
    takes_views = True

    def __init__(self, link: EngineLink, policy: Policy, step_s: float, tap: Tap) -> None:
        self.link, self.policy, self.step_s, self.tap = link, policy, step_s, tap
        self.changed = asyncio.Condition()
        self.in_flight = 0
        self.aborts = 0  # pause("abort") calls so far: a request that saw another ends
        self.closed: BaseException | None = None

    def _ended(self, epoch: int) -> bool:
        if self.closed is not None:
            raise self.closed
        return self.aborts != epoch

    async def generate(self, prompt: Sequence[int], params: SamplingParams) -> Generation:
        ids = list(self.policy(prompt, params))[: params.max_tokens]
        cut = min((ids.index(t) + 1 for t in params.stop_token_ids if t in ids), default=None)
        ids = ids if cut is None else ids[:cut]
        epoch, versions = self.aborts, list[int]()
        async with self.changed:  # queued while paused
            await self.changed.wait_for(lambda: self._ended(epoch) or not self.link.pause_mode())
        self.in_flight += 1
        try:
            for _ in ids:
                async with self.changed:  # frozen between tokens under keep
                    await self.changed.wait_for(
                        lambda: self._ended(epoch) or self.link.pause_mode() != "keep"
                    )
                if self._ended(epoch):
                    self.tap.aborted += 1
                    n = len(versions)
                    return Generation(ids[:n], [0.0] * n, "abort", versions)
                await asyncio.sleep(self.step_s)  # the token's compute time
                versions.append(self.link.version())
        finally:
            self.in_flight -= 1
            async with self.changed:
                self.changed.notify_all()
        reason = "stop" if cut is not None else "length"
        return Generation(ids, [0.0] * len(ids), reason, versions)

    async def pause(self, mode: PauseMode) -> None:
        async with self.changed:
            if mode == "abort":
                self.aborts += 1
            self.changed.notify_all()
            if mode != "keep":
                await self.changed.wait_for(lambda: self.in_flight == 0)

    async def resume(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def load_weights(self, named: list[tuple[str, torch.Tensor]], version: int) -> None:
        return None

    async def shutdown(self, error: BaseException) -> None:
        self.closed = error
        async with self.changed:
            self.changed.notify_all()

    def release(self) -> None:
        return None


class SteppedEngine(BaseEngine):
    """A ``BaseEngine`` whose answer is ``policy(prompt_ids, params)``, one token every
    ``step_s`` (bench only: ``ScriptedEngine`` answers at once, so no request would be in
    flight for a suspend or a shrink to act on)."""

    def __init__(self, policy: Policy, tap: Tap, step_s: float, name: str) -> None:
        super().__init__(name=name)

        async def start(link: EngineLink) -> _SteppedBackend:
            return _SteppedBackend(link, policy, step_s, tap)

        self._attach(start, "a policy function")


def _tapped(engine: Any, tap: Tap) -> Any:
    """``engine`` with each request counted by ``tap`` (and its aborted answers), on the
    loop that awaits it: one thread."""
    generate = engine.generate

    async def tapped(prompt_ids: Any, params: Any, **kw: Any) -> Any:
        tap.tick()
        gen = await generate(prompt_ids, params, **kw)
        tap.aborted += gen.finish_reason == "abort"
        return gen

    engine.generate = tapped
    return engine


def _node_engine(call: list[int], answer: list[int]) -> SteppedEngine:
    """A ``cluster`` rank's engine, built in its Ray actor: the scripted answers."""

    def policy(prompt_ids: Sequence[int], params: Any) -> list[int]:
        return call if len(prompt_ids) % 3 else answer  # as the in-process ranks answer

    return SteppedEngine(policy, Tap(), NODE_STEP_S, "campaign-node")


def _calculate_call(tokenizer: Any) -> list[int]:
    text = (
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
    )
    return [*tokenizer(text, add_special_tokens=False)["input_ids"], _eos(tokenizer)]


def _eos(tokenizer: Any) -> int:
    return int(tokenizer.convert_tokens_to_ids("<|im_end|>"))


async def two_call_agent(client: Any, task: str) -> float:
    """Two chat calls through the front door, the second answering the first."""
    messages: list[Any] = [{"role": "user", "content": task}]
    for _ in range(2):
        reply = await client.chat.completions.create(model="m", messages=messages, max_tokens=8)
        messages += [reply.choices[0].message, {"role": "user", "content": "And then?"}]
    return float(len(reply.choices[0].message.content or "") % 2)


class Setup:
    """Engines, tokenizer and configs shared by every run (engines built on first use)."""

    def __init__(self, batches: int) -> None:
        from transformers import AutoTokenizer

        from rollpipe.envs import register
        from rollpipe.frontdoor import AgentEnv
        from rollpipe.training.tiny_model import default_model_path

        self.batches = batches
        self.path = default_model_path(tools=True)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.taps = {kind: Tap() for kind in ALL_ENGINES}
        self._engines: dict[str, Any] = {}
        self._weights: dict[str, Any] = {}
        self.references: dict[tuple[str, str, int], list[Ids]] = {}
        self.worker_counts = Counter[str]()  # kills, replacements, episodes run again
        self.cluster_counts = Counter[str]()  # node kills, re-sent requests
        self.driver_counts = Counter[str]()  # SIGKILLs, restarts, where they landed
        self._driver_refs: dict[int, list[str]] = {}
        self._scratch: str | None = None
        register(
            "campaign_agent",
            lambda: AgentEnv(two_call_agent, task=lambda seed: f"What is {seed % 50} + 3?"),
            overwrite=True,
        )

    def _answers(self) -> tuple[list[int], list[int]]:
        """The scripted ranks' two answers: a calculator call, and a final answer."""
        answer = [*self.tokenizer("It is 408.")["input_ids"], _eos(self.tokenizer)]
        return _calculate_call(self.tokenizer), answer

    @contextlib.contextmanager
    def cluster_pool(self) -> Iterator[Any]:
        """A two-rank ``EnginePool`` of ``RayEngine`` actors, rank ``r`` on the node with
        resource ``engine_r``, each hosting a :class:`SteppedEngine` (the scripted
        answers); requests counted on the driver by ``taps["cluster"]``."""
        import ray

        from rollpipe.engines.pool import EnginePool
        from rollpipe.engines.ray_engine import RayEngine, WeightStore

        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # SteppedEngine
        tap, store = self.taps["cluster"], WeightStore()
        make = functools.partial(_node_engine, *self._answers())

        def rank_engine(rank: int) -> RayEngine:
            placed = {"resources": {f"engine_{rank}": 1}}
            return _tapped(RayEngine(make, num_cpus=1, weights=store, actor_options=placed), tap)

        with EnginePool(rank_engine, 2) as pool:
            yield pool

    def driver_reference(self, batches: int) -> list[str]:
        """The uninterrupted driver's digests for ``batches`` batches (made once)."""
        if batches not in self._driver_refs:
            forks(PRELOAD_SCRIPTED)  # drivers forked from a server with rollpipe imported
            workdir = Path(tempfile.mkdtemp(prefix="reference-", dir=self.scratch()))
            self._driver_refs[batches] = driver_reference(workdir, batches, "scripted", True)
        return self._driver_refs[batches]

    def scratch(self) -> str:
        """A directory for the drivers' files, removed by :meth:`close`."""
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="fault-campaign-")
        return self._scratch

    def engine(self, kind: str) -> Any:
        if kind not in self._engines:
            self._engines[kind] = self._build(kind)
        return self._engines[kind]

    def _build(self, kind: str) -> Any:
        tap = self.taps[kind]
        if kind in ("scripted", "workers"):  # workers: a pool of its own (its own counts)
            from rollpipe.engines.pool import EnginePool

            call, answer = self._answers()

            def policy(prompt_ids: Sequence[int], params: Any) -> list[int]:
                tap.tick()
                return call if len(prompt_ids) % 3 else answer  # tool turns end either way

            return EnginePool(
                lambda rank: SteppedEngine(policy, tap, STEP_S, f"campaign-{rank}"), 2
            )
        from rollpipe.engines.vllm import VLLMEngine

        return _tapped(
            VLLMEngine(self.path, kv_cache_space_gib=0.5, max_model_len=1024, seed=0), tap
        )

    def weights(self, kind: str) -> Any:
        if kind not in self._weights:
            if kind in ("scripted", "workers", "cluster"):
                self._weights[kind] = {"w": torch.zeros(1)}  # a ScriptedEngine ignores them
            else:
                from transformers import AutoModelForCausalLM

                model = AutoModelForCausalLM.from_pretrained(str(self.path))
                self._weights[kind] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return self._weights[kind]

    def config(self, episode_kind: str, seed: int, engine_kind: str = "") -> PipelineConfig:
        envs = {"text": "frozenlake", "tool": "calculator", "agent": "campaign_agent"}
        workers = 2 if engine_kind in ("workers", "cluster") else 0
        options = WORKER_OPTIONS if engine_kind == "cluster" else {}
        return PipelineConfig(
            rollout={"concurrency": 8, "episode_workers": workers, "worker_options": dict(options)},
            envs=envs[episode_kind],
            group_size=2,
            batch_size=4,
            max_turns=3,
            max_length=1024,
            sampling={"max_tokens": 16},
            tool_parser="hermes",
            async_generation_ratio=None,
            seed=seed,
        )

    def reference(self, episode_kind: str, engine_kind: str, seed: int) -> list[Ids]:
        if engine_kind in ("workers", "cluster"):  # the in-process run is what they must give
            engine_kind = "scripted"
        key = (episode_kind, engine_kind, seed)
        if key not in self.references:
            config = self.config(episode_kind, seed)
            with RolloutPipeline(config, self.engine(engine_kind), self.tokenizer) as pipe:
                self.references[key] = [identities(pipe.get_batch()) for _ in range(self.batches)]
        return self.references[key]

    def engine_counts(self) -> dict[str, dict[str, int]]:
        """Per engine: requests, aborted answers, requests the pool re-sent on a shrink."""
        out = {}
        for kind, engine in self._engines.items():
            out[kind] = {"requests": self.taps[kind].requests, "aborted": self.taps[kind].aborted}
            if kind in ("scripted", "workers"):
                out[kind]["rerouted_by_shrink"] = engine.rerouted
            if kind == "workers":
                out[kind] |= self.worker_counts
        if self.cluster_counts:
            tap = self.taps["cluster"]
            out["cluster"] = {"requests": tap.requests, "aborted": tap.aborted}
            out["cluster"] |= self.cluster_counts
        if self.driver_counts:
            out["driver"] = dict(self.driver_counts)
        return out

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)


def identities(batch: DataProto | None) -> Ids:
    """(group id, episode id) of every row."""
    assert batch is not None and batch.batch is not None, "an endless source's pipeline ended"
    rows = batch.batch
    return list(zip(rows["traj_group_id"].tolist(), rows["traj_id"].tolist(), strict=True))


# -- the campaign loop --------------------------------------------------------------------
class Tally:
    """Counts by (fault kind, episode kind, engine), summed any way the report needs."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str, str], Counter[str]] = defaultdict(Counter)
        self.hung: list[dict[str, Any]] = []
        self.failed: list[str] = []

    def add(self, cell: tuple[str, str, str], **counts: int) -> None:
        self.cells[cell].update(counts)

    def by(self, *axes: int) -> dict[str, dict[str, int]]:
        out: dict[str, Counter[str]] = defaultdict(Counter)
        for cell, counts in self.cells.items():
            out["/".join(cell[a] for a in axes)].update(counts)
        return {k: {c: v[c] for c in COUNTS} for k, v in sorted(out.items())}

    def total(self) -> dict[str, int]:
        return {c: sum(v[c] for v in self.cells.values()) for c in COUNTS}


def one_run(
    setup: Setup,
    tally: Tally,
    rng: random.Random,
    episode_kind: str,
    engine_kind: str,
    watchdog_s: float,
) -> None:
    """One pipeline, ``setup.batches`` points, compared with its reference."""
    kinds = [k for k in FAULTS.values() if engine_kind in k.engines]
    whole = [k for k in kinds if k.whole_run is not None]
    if whole:  # points that are runs of their own (another process)
        whole_run = rng.choice(whole).whole_run
        assert whole_run is not None
        whole_run(setup, tally, rng, watchdog_s)
        return
    seed = rng.randrange(8)  # a few seeds per config: references are reused
    reference = setup.reference(episode_kind, engine_kind, seed)
    run = Run(setup, episode_kind, engine_kind, seed)
    got: list[Ids] = []
    owner: dict[tuple[int, int], str] = {}  # reference id -> the point of its batch
    index = 0  # the run's next batch
    try:
        while index < setup.batches:
            kind = rng.choice(kinds)
            cell = (kind.name, episode_kind, engine_kind)
            for ident in reference[index]:
                owner[ident] = kind.name
            tally.add(cell, points=1)
            where = f"{kind.name} on {episode_kind}/{engine_kind}, seed {seed}, batch {index}"
            run.batches_left = setup.batches - index
            with Watchdog(watchdog_s, run.on_hang) as dog:
                try:
                    batches = kind.inject(run, rng)
                except BaseException as exc:
                    if not dog.fired:
                        raise
                    tally.add(cell, hangs=1)
                    tally.hung.append({"point": where, "error": repr(exc)[:300]})
                    return
            if dog.fired:
                tally.add(cell, hangs=1)
                tally.hung.append({"point": where, "error": "finished after the watchdog"})
                return
            for batch in batches if isinstance(batches, list) else [batches]:
                for ident in reference[index]:
                    owner[ident] = kind.name
                index += 1
                got.append(identities(batch))
                earlier = {i for ids in got[:-1] for i in ids}
                tally.add(cell, duplicated=sum(i in earlier for i in got[-1]))
                tally.add(cell, duplicated=len(got[-1]) - len(set(got[-1])))
            notes = kind.check(run) + run.notes
            run.notes = []
            if notes:
                tally.add(cell, failed_checks=len(notes))
                tally.failed += [f"{where}: {n}" for n in notes]
    finally:
        run.close()
    yielded = {i for ids in got for i in ids}
    expected = set(owner)  # the reference's batches the run's points asked for
    for ident in expected - yielded:
        tally.add((owner[ident], episode_kind, engine_kind), lost=1)
    last = kinds[0].name if not owner else next(reversed(owner.values()))
    tally.add((last, episode_kind, engine_kind), unexpected=len(yielded - expected))


def campaign(
    points: int,
    *,
    vllm_share: float,
    batches: int,
    seed: int,
    watchdog_s: float,
    min_vllm_runs: int = 0,
    workers_share: float = 0.0,
    min_worker_runs: int = 0,
    cluster_share: float = 0.0,
    min_cluster_runs: int = 0,
    driver_share: float = 0.0,
    min_driver_runs: int = 0,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run runs until ``points`` points are done: first ``min_vllm_runs`` on vLLM, then
    ``min_worker_runs`` on episode workers, ``min_cluster_runs`` on a cluster (node
    kills), ``min_driver_runs`` of the SIGKILLed driver; then each run on one of those
    with probability ``vllm_share``, ``workers_share``, ``cluster_share``,
    ``driver_share``, else on the scripted pool. The report (see the module doc)."""
    start = time.monotonic()
    rng = random.Random(seed)
    setup, tally = Setup(batches), Tally()
    shares = {"vllm": vllm_share, "workers": workers_share}
    shares |= {"cluster": cluster_share, "driver": driver_share}
    first = ["vllm"] * min_vllm_runs + ["workers"] * min_worker_runs
    first += ["cluster"] * min_cluster_runs + ["driver"] * min_driver_runs
    if sum(shares.values()) > 1:
        raise ValueError(f"campaign: the shares {shares} add up to more than 1")

    def draw(runs: int) -> str:
        if runs < len(first):
            return first[runs]
        r = rng.random()
        for kind, share in shares.items():
            if r < share:
                return kind
            r -= share
        return "scripted"

    runs = 0
    try:
        while tally.total()["points"] < points:
            engine_kind = draw(runs)
            episode_kind = EPISODE_KINDS[runs % len(EPISODE_KINDS)]
            one_run(setup, tally, rng, episode_kind, engine_kind, watchdog_s)
            runs += 1
            if runs % 100 == 0:
                log(f"{tally.total()} after {runs} runs, {time.monotonic() - start:.0f} s")
        engines = setup.engine_counts()
    finally:
        setup.close()
    total = tally.total()
    return {
        "points": total["points"],
        "runs": runs,
        "batches_per_run": batches,
        "wall_s": round(time.monotonic() - start, 1),
        "totals": total,
        "by_fault_kind": tally.by(0),
        "by_episode_kind": tally.by(1),
        "by_engine": tally.by(2),
        "by_fault_and_episode_kind": tally.by(0, 1),
        "fault_kinds": {
            k.name: {"expected": k.expected, "engines": list(k.engines)} for k in FAULTS.values()
        },
        "engines": engines,
        "hung_points": tally.hung,
        "failed_checks": tally.failed[:50],
        "passed": all(total[c] == 0 for c in COUNTS if c != "points"),
    }


def run(ctx: Any) -> dict[str, Any]:
    """bench.run's entry: a small campaign (smoke: 18 points, one run on vLLM; quick: 300;
    full: 2,000), its totals as figures; raises if any is not 0."""
    points, batches = (18, 3) if ctx.smoke else (300, 10) if ctx.quick else (2000, 10)
    report = campaign(
        points,
        vllm_share=0.03,
        batches=batches,
        seed=0,
        watchdog_s=300,
        min_vllm_runs=1,
        workers_share=0.02,
        min_worker_runs=1,
        # node kills and SIGKILLs cost seconds a point: not in the smoke (their test in
        # tests/distributed/test_fault_campaign_nodes.py covers them), a run each else
        cluster_share=0.0 if ctx.smoke else 0.002,
        min_cluster_runs=0 if ctx.smoke else 1,
        driver_share=0.0 if ctx.smoke else 0.002,
        min_driver_runs=0 if ctx.smoke else 1,
        log=ctx.log,
    )
    if ctx.results_dir is not None:
        (ctx.results_dir / REPORT_NAME).write_text(json.dumps(report, indent=2) + "\n")
    if not report["passed"]:
        raise RuntimeError(f"fault campaign: {report['totals']}; {report['hung_points'][:3]}")
    totals = report["totals"]
    failures = sum(v for k, v in totals.items() if k != "points")
    return {f"fault_campaign_{k}": v for k, v in totals.items()} | {
        "fault_campaign_failures": failures,
        "fault_campaign_wall_s": report["wall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--points", type=int, default=1000)
    parser.add_argument("--smoke", action="store_true", help="18 points, nothing written")
    parser.add_argument("--vllm-share", type=float, default=0.03, help="share of runs on vLLM")
    parser.add_argument("--batches", type=int, default=10, help="points per run")
    parser.add_argument(
        "--workers-share", type=float, default=0.02, help="share of runs on episode workers"
    )
    parser.add_argument(
        "--cluster-share",
        type=float,
        default=0.002,
        help="share of runs on a Ray cluster of several nodes (node_kill points)",
    )
    parser.add_argument(
        "--driver-share",
        type=float,
        default=0.002,
        help="share of runs of the SIGKILLed driver (sigkill points)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--watchdog-s", type=float, default=300.0, help="a point over this hangs")
    parser.add_argument("--out", type=Path, default=RESULTS / REPORT_NAME)
    args = parser.parse_args(argv)
    points = 18 if args.smoke else args.points
    report = campaign(
        points,
        vllm_share=args.vllm_share,
        batches=3 if args.smoke else args.batches,
        seed=args.seed,
        watchdog_s=args.watchdog_s,
        min_vllm_runs=1,
        workers_share=args.workers_share,
        min_worker_runs=1,
        cluster_share=0.0 if args.smoke else args.cluster_share,
        min_cluster_runs=0 if args.smoke else 1,
        driver_share=0.0 if args.smoke else args.driver_share,
        min_driver_runs=0 if args.smoke else 1,
    )
    report["command"] = "python -m bench.fault_campaign " + " ".join(argv or sys.argv[1:])
    text = json.dumps(report, indent=2) + "\n"
    print(text)
    if not args.smoke:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
