"""Benchmark 3: collating trajectories into one padded ``DataProto``.

Input: ``n`` real ``rollpipe.agent.records.Trajectory`` records of random total length
16..4096 tokens (uniform), each cut into 1..4 turns of (prompt, response) segments at
random points, with logprobs and versions on response tokens. Three ways to the same
padded ``[B, L]`` rows, run side by side in every repeat:

* **collate** — ``rollpipe.data.rows.trajectory_rows`` (what the ``Collate`` node runs).
* **per-row concat** (the verl/ROLL way) — for each trajectory, build its tensors
  (per turn segment, from the same packed arrays collate reads; ``torch.cat``),
  right-pad every field to the batch's longest row ``L`` (ROLL pads to its configured
  ``sequence_length``, which is at least ``L``: padding to ``L`` is the cheapest
  version), wrap them in a one-row
  ``DataProto.from_dict`` (same 12 tensor fields and 5 object columns), then one
  ``DataProto.concat`` of all rows. Its tensors are checked equal to collate's.
* **memcpy bound** — the bytes of collate's output tensors (all 12 fields), written
  by one ``torch.cat`` of ``n`` contiguous per-row byte pieces that already exist,
  into a fresh output (as collate's outputs are fresh: page faults included); the
  fastest of 3 such copies, since first-touch page faults on this kind of VM vary by
  10x from one copy to the next. The same copy into the already-touched output is
  reported as ``collate_memcpy_warm_ms``
  (pure copy bandwidth; on this kind of VM first-touching memory costs more than the
  copy and varies a lot from run to run).

Figures: ``collate_vs_memcpy`` = collate time / memcpy time; ``collate_speedup_vs_concat``
= per-row concat time / collate time (medians of per-repeat ratios).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from bench.common import BenchContext, Figures, median, rounded, timed
from rollpipe.agent.records import EpisodeSpec, Trajectory, Turn
from rollpipe.data.proto import DataProto
from rollpipe.data.proto.columns import object_array
from rollpipe.data.rows import trajectory_rows

PAD_ID = 0


def synthetic_trajectories(
    n: int, min_len: int = 16, max_len: int = 4096, seed: int = 0, vocab: int = 300
) -> list[Trajectory]:
    """``n`` trajectories of uniform random total length in ``[min_len, max_len]``."""
    if min_len < 2 or max_len < min_len:
        raise ValueError(f"need 2 <= min_len <= max_len, got {min_len}..{max_len}")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        total = int(rng.integers(min_len, max_len + 1))
        n_turns = int(rng.integers(1, min(4, total // 2) + 1))
        # 2 * n_turns positive segments: prompt, response, prompt, response, ...
        cuts = np.sort(rng.choice(np.arange(1, total), size=2 * n_turns - 1, replace=False))
        bounds = [0, *cuts.tolist(), total]
        ids = rng.integers(3, vocab, size=total).tolist()
        logprobs = (-rng.random(total)).tolist()
        turns = []
        for t in range(n_turns):
            a, b, c = bounds[2 * t], bounds[2 * t + 1], bounds[2 * t + 2]
            turns.append(
                Turn(
                    prompt_ids=ids[a:b],
                    response_ids=ids[b:c],
                    logprobs=logprobs[b:c],
                    versions=[t % 3] * (c - b),
                    reward=float(t == n_turns - 1),
                    finish_reason="stop",
                    action_valid=True,
                    action_text="",
                    observation="",
                )
            )
        out.append(
            Trajectory(
                spec=EpisodeSpec(group_id=i // 8, episode_id=i, seed=i // 8),
                env_id=i % 64,
                turns=tuple(turns),
                score=float(i % 2),
                success=bool(i % 2),
                end_reason="terminated",
            )
        )
    return out


def per_row_proto(traj: Trajectory, length: int) -> DataProto:
    """One trajectory as a one-row DataProto padded to ``length`` (the verl/ROLL way)."""
    ids, resp, lp, ver, grammar = [], [], [], [], []
    for u in traj.turns:
        # the turn's packed arrays, as collate gets them: no Python-int conversion either
        both = torch.from_numpy(u.token_array.copy())
        p, r = both[: len(u.prompt_ids)], both[len(u.prompt_ids) :]
        ids += [p, r]
        resp += [torch.zeros(len(p), dtype=torch.bool), torch.ones(len(r), dtype=torch.bool)]
        lp += [torch.zeros(len(p)), torch.from_numpy(u.logprob_array.copy())]
        ver += [torch.full((len(p),), -1), torch.tensor(u.versions)]
        grammar += [torch.zeros(len(p), dtype=torch.bool), torch.full((len(r),), u.constrained)]
    input_ids = torch.cat(ids)
    response_mask = torch.cat(resp)
    n, pad = len(input_ids), length - len(input_ids)
    first = int(torch.nonzero(response_mask)[0])
    prompt_mask = torch.arange(n) < first
    attention_mask = torch.ones(n, dtype=torch.int64)
    scores = torch.zeros(n)
    scores[-1] = traj.score

    def row(x: torch.Tensor, value: float) -> torch.Tensor:
        return F.pad(x, (0, pad), value=value)[None]

    am = row(attention_mask, 0)
    tensors = {
        "input_ids": row(input_ids, PAD_ID),
        "attention_mask": am,
        "position_ids": torch.clip(torch.cumsum(am, dim=-1) - 1, min=0),
        "response_mask": row(response_mask, 0),
        "prompt_mask": row(prompt_mask, 0),
        "scores": row(scores, 0.0),
        "infer_logprobs": row(torch.cat(lp), 0.0),
        "policy_versions": row(torch.cat(ver), -1),
        "constrained_mask": row(torch.cat(grammar), 0),
        "traj_group_id": torch.tensor([traj.group_id]),
        "traj_id": torch.tensor([traj.episode_id]),
        "env_ids": torch.tensor([traj.env_id]),
        "episode_scores": torch.tensor([traj.score], dtype=torch.float32),
    }
    non_tensors = {
        "step_scores": object_array([traj.step_scores]),
        "tags": object_array([traj.tag]),
        "end_reasons": object_array([traj.end_reason]),
        "uid": object_array([traj.group_uid]),
        "traj_uid": object_array([traj.traj_id]),
    }
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def concat_way(trajs: Sequence[Trajectory]) -> DataProto:
    """Per-row DataProto, each padded to the batch's longest row, then one concat."""
    length = max(sum(len(u.prompt_ids) + len(u.response_ids) for u in t.turns) for t in trajs)
    return DataProto.concat([per_row_proto(t, length) for t in trajs])


def output_nbytes(rows: DataProto) -> int:
    assert rows.batch is not None
    tensors = [rows.batch[k] for k in rows.batch.keys()]  # noqa: SIM118 - TensorDict rows
    return sum(int(t.numel()) * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def memcpy_pieces(total_bytes: int, n_rows: int) -> list[torch.Tensor]:
    """``n_rows`` contiguous byte pieces (already touched) summing to ``total_bytes``."""
    source = torch.randint(0, 255, (total_bytes,), dtype=torch.uint8)
    base, extra = divmod(total_bytes, n_rows)
    sizes = [base + (i < extra) for i in range(n_rows)]
    return list(torch.split(source, sizes))


def time_memcpy(nbytes: int, n_rows: int, tries: int = 3) -> tuple[float, float]:
    """Seconds of one ``torch.cat`` of ``n_rows`` pieces into a fresh output (the fastest
    of ``tries``: a bound, and first-touch page faults here vary by 10x between
    tries), then into the same (now touched) output again."""
    pieces = memcpy_pieces(nbytes, n_rows)
    times = []
    for _ in range(tries):
        out = None
        gc.collect()
        dt, out = timed(lambda: torch.cat(pieces))
        times.append(dt)
    warm, _ = timed(lambda: torch.cat(pieces, out=out))
    return min(times), warm


def same_tensors(a: DataProto, b: DataProto) -> bool:
    assert a.batch is not None and b.batch is not None
    return sorted(a.batch.keys()) == sorted(b.batch.keys()) and all(
        torch.equal(a.batch[k], b.batch[k])
        for k in a.batch.keys()  # noqa: SIM118 - iterating a TensorDict yields rows
    )


def run(ctx: BenchContext, n: int | None = None, max_len: int = 4096) -> Figures:
    """Collate ``n`` random-length trajectories three ways (default 4096; 2048 with
    ``--quick``, same length distribution); see the module doc."""
    n = n or ctx.size(smoke=256, quick=2048, full=4096)
    trajs = synthetic_trajectories(n, max_len=max_len)
    tokens = sum(len(u.prompt_ids) + len(u.response_ids) for t in trajs for u in t.turns)
    t_collate, t_concat, t_memcpy, t_warm = [], [], [], []
    equal = True
    nbytes = 0
    for rep in range(ctx.repeats_for()):
        gc.collect()
        dt, rows = timed(lambda: trajectory_rows(trajs, PAD_ID))
        t_collate.append(dt)
        nbytes = output_nbytes(rows)
        gc.collect()
        dt, other = timed(lambda: concat_way(trajs))
        t_concat.append(dt)
        if rep == 0:
            equal = same_tensors(rows, other)
        del rows, other
        gc.collect()
        fresh, warm = time_memcpy(nbytes, n)
        t_memcpy.append(fresh)
        t_warm.append(warm)
        ctx.log(
            f"  collate rep {rep}: collate {t_collate[-1]:.3f}s, per-row concat "
            f"{t_concat[-1]:.3f}s, memcpy {t_memcpy[-1]:.3f}s"
        )
    vs_memcpy = median([c / m for c, m in zip(t_collate, t_memcpy, strict=True)])
    vs_concat = median([c / k for c, k in zip(t_concat, t_collate, strict=True)])
    return {
        "collate_vs_memcpy": rounded(vs_memcpy),
        "collate_speedup_vs_concat": rounded(vs_concat),
        "collate_rows_per_s": rounded(n / median(t_collate)),
        "collate_concat_rows_per_s": rounded(n / median(t_concat)),
        "collate_ms": rounded(1e3 * median(t_collate)),
        "collate_concat_ms": rounded(1e3 * median(t_concat)),
        "collate_memcpy_ms": rounded(1e3 * median(t_memcpy)),
        "collate_memcpy_warm_ms": rounded(1e3 * median(t_warm)),
        "collate_trajectories": n,
        "collate_tokens": tokens,
        "collate_output_mb": rounded(nbytes / 2**20),
        "collate_outputs_equal": equal,
    }
