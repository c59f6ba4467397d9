"""HFEngine on the tiny model: the protocol, micro-batching, pause/resume, weights, close."""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from waiting import holds_for_async, wait_until_async

from rollpipe.engines import EngineClosedError, EngineError, Generation, HFEngine, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    texts = ["P_O\n_OG", "#####\n#PX_#\n#__O#\n#####", "Left", "Hello there, Sokoban player"]
    return [tokenizer(t)["input_ids"] for t in texts]  # different lengths: left padding


@pytest.fixture(scope="module")
def hf_model(tiny_model_path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


def perturb(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


@pytest.fixture
def four(tiny_model_path: Path) -> Iterator[HFEngine]:
    """An engine whose micro-batch is exactly four requests: it starts once four wait (the
    10 s window is never reached), so a test knows which requests share the batch."""
    with HFEngine(tiny_model_path, batch_window_s=10, max_batch_size=4) as engine:
        yield engine


class HeldDecode:
    """Holds an HFEngine's decode thread: it runs one job at a time, in order, so every
    decode step waits behind this one until ``release()``. A test that submits requests,
    sees their batch start (``num_batches``) and calls pause / update / close meanwhile
    knows exactly where the call lands: after the batch's first step."""

    def __init__(self, engine: HFEngine) -> None:
        self.released = threading.Event()
        engine._backend.worker.submit(self.released.wait, 120)

    def release(self) -> None:
        self.released.set()


async def started(engine: HFEngine, batches_before: int) -> None:
    """Wait until the engine's next micro-batch has started (its first step is submitted
    to the decode thread, holding the model)."""
    await wait_until_async(
        lambda: engine.num_batches > batches_before, 60, "the micro-batch to start"
    )


async def held_call(engine: HFEngine, hold: HeldDecode, fn: Any, *args: Any) -> Any:
    """Call the blocking ``fn(*args)`` (pause, update_weights, close) while the decode
    thread is held; release it once the call has begun on the engine (it then waits for
    the step in flight), and return the call's result."""
    marks = (engine.interruptions, engine.closed)
    call = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    await wait_until_async(
        lambda: (engine.interruptions, engine.closed) != marks or call.done(),
        60,
        f"{getattr(fn, '__name__', fn)} to begin",
    )
    hold.release()
    return await asyncio.wait_for(call, 120)


@pytest.fixture
def restore_weights(hf_engine: HFEngine, hf_model: Any) -> Iterator[None]:
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    yield
    hf_model.load_state_dict(original)
    hf_engine.update_weights(original)


def test_greedy_batch_equals_unbatched_transformers(
    hf_engine: HFEngine, hf_model: Any, prompts: list[list[int]]
) -> None:
    params = GREEDY.replace(ignore_eos=True)
    before = hf_engine.tokens_generated
    gens = hf_engine.generate_batch(prompts, params)
    assert hf_engine.tokens_generated - before == 12 * len(prompts)  # counted as produced
    assert [list(g.token_ids) for g in gens] == [hf_greedy(hf_model, p, 12) for p in prompts]
    for g in gens:
        assert g.finish_reason == "length" and len(g.token_ids) == 12
        assert len(g.logprobs) == 12 and all(math.isfinite(x) and x <= 0 for x in g.logprobs)
        assert g.versions == (hf_engine.version,) * 12
    with torch.no_grad():  # logprobs are the model's own log-softmax of the sampled token
        p, g = prompts[0], gens[0]
        logits = hf_model(torch.tensor([p + list(g.token_ids)])).logits[0, len(p) - 1 : -1]
        want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None])
    assert list(g.logprobs) == pytest.approx(want[:, 0].tolist(), abs=1e-4)
    short = hf_engine.generate_batch(prompts[:1], GREEDY.replace(logprobs=False))[0]
    assert short.logprobs == () and 1 <= len(short.token_ids) <= 12


def test_stop_token_and_max_tokens_per_row(hf_engine: HFEngine, prompts: list[list[int]]) -> None:
    params = GREEDY.replace(ignore_eos=True)
    ref = hf_engine.generate_batch(prompts[:1], params)[0].token_ids
    stop = ref[4]
    k = ref.index(stop)

    async def main() -> list[Generation]:  # different params in one micro-batch
        return list(
            await asyncio.gather(
                hf_engine.generate(prompts[0], params.replace(stop_token_ids=(stop,))),
                hf_engine.generate(prompts[1], params.replace(max_tokens=3)),
            )
        )

    stopped, short = asyncio.run(main())
    assert stopped.finish_reason == "stop" and stopped.token_ids == ref[: k + 1]
    assert short.finish_reason == "length" and len(short.token_ids) == 3


def test_seeded_sampling_is_reproducible_and_batch_invariant(
    hf_engine: HFEngine, prompts: list[list[int]]
) -> None:
    params = SamplingParams(
        max_tokens=16, temperature=1.0, top_p=0.95, top_k=50, seed=11, ignore_eos=True
    )
    alone = hf_engine.generate_batch([prompts[0]], params)[0]
    batched = hf_engine.generate_batch([prompts[1], prompts[0], prompts[0]], params)
    assert batched[1].token_ids == alone.token_ids == batched[2].token_ids
    other = hf_engine.generate_batch([prompts[0]], params.replace(seed=12))[0]
    assert other.token_ids != alone.token_ids


def test_concurrent_requests_share_one_generate_call(
    hf_engine: HFEngine, prompts: list[list[int]]
) -> None:
    before = hf_engine.num_batches
    gens = hf_engine.generate_batch(prompts * 4, GREEDY)
    assert len(gens) == 16
    assert hf_engine.num_batches - before <= 2
    assert [g.token_ids for g in gens[:4]] == [g.token_ids for g in gens[4:8]]


def test_pause_keep_parks_the_running_batch(
    four: HFEngine, hf_model: Any, prompts: list[list[int]], restore_weights: None
) -> None:
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    v0 = four.version
    start = four.tokens_generated

    async def main() -> list[Generation]:
        hold = HeldDecode(four)
        tasks = [asyncio.ensure_future(four.generate(p, params)) for p in prompts]
        await started(four, 0)
        await held_call(four, hold, four.pause, "keep")  # lands after the first step
        assert four.tokens_generated == start + len(prompts)  # one token per row, no more
        assert not any(t.done() for t in tasks), "completed while paused"
        perturb(hf_model, seed=5)
        await asyncio.to_thread(four.update_weights, hf_model)
        late = [asyncio.ensure_future(four.generate(p, GREEDY)) for p in prompts]
        await holds_for_async(
            lambda: (
                four.tokens_generated == start + len(prompts)
                and not any(t.done() for t in late + tasks)
            ),
            0.2,
            "a paused engine generates nothing",
        )
        await asyncio.to_thread(four.resume)
        return list(await asyncio.wait_for(asyncio.gather(*tasks, *late), 120))

    gens = asyncio.run(main())
    for g in gens[: len(prompts)]:
        assert len(g.token_ids) == 300 and g.finish_reason == "length"
        n_old = g.versions.count(v0)
        assert 0 < n_old < 300
        assert g.versions == (v0,) * n_old + (v0 + 1,) * (300 - n_old)
    assert all(set(late.versions) == {v0 + 1} for late in gens[len(prompts) :])


def test_update_weights_waits_for_the_step_in_flight_only(
    hf_engine: HFEngine, hf_model: Any, prompts: list[list[int]], restore_weights: None
) -> None:
    """Unpaused, an update lands between two decode steps of a running request."""
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    v0 = hf_engine.version

    async def main() -> Generation:
        hold = HeldDecode(hf_engine)
        batches = hf_engine.num_batches
        task = asyncio.ensure_future(hf_engine.generate(prompts[0], params))
        await started(hf_engine, batches)
        perturb(hf_model, seed=7)
        await held_call(hf_engine, hold, hf_engine.update_weights, hf_model)
        return await asyncio.wait_for(task, 120)

    g = asyncio.run(main())
    n_old = g.versions.count(v0)
    assert n_old < 300, "the update waited for the whole request"
    assert n_old > 0 and g.versions == (v0,) * n_old + (v0 + 1,) * (300 - n_old)


def test_a_full_batch_starts_without_waiting_for_the_window(
    tiny_model_path: Path, prompts: list[list[int]]
) -> None:
    with HFEngine(tiny_model_path, batch_window_s=10, max_batch_size=2) as engine:

        async def main() -> tuple[float, list[Generation]]:
            t0 = time.monotonic()
            call = asyncio.to_thread(engine.generate_batch, prompts[:2], GREEDY)
            task = asyncio.ensure_future(call)
            await started(engine, 0)
            return time.monotonic() - t0, await asyncio.wait_for(task, 60)

        waited, gens = asyncio.run(main())
        # a batch that waited for the 10 s window would start only once it closed
        assert waited < 10 and len(gens) == 2
        assert engine.num_batches == 1


def test_update_weights_matches_transformers(
    hf_engine: HFEngine, hf_model: Any, prompts: list[list[int]], restore_weights: None
) -> None:
    params = GREEDY.replace(max_tokens=16, ignore_eos=True)
    before = [g.token_ids for g in hf_engine.generate_batch(prompts, params)]
    perturb(hf_model, seed=6)
    v0 = hf_engine.version
    assert hf_engine.update_weights(dict(hf_model.named_parameters())) == v0 + 1
    after = hf_engine.generate_batch(prompts, params)
    assert [list(g.token_ids) for g in after] == [hf_greedy(hf_model, p, 16) for p in prompts]
    assert [g.token_ids for g in after] != before
    with pytest.raises(EngineError, match="not parameters"):
        hf_engine.update_weights({"no.such.weight": torch.zeros(1)})
    assert hf_engine.version == v0 + 1


def test_pause_abort_ends_running_and_queued(four: HFEngine, prompts: list[list[int]]) -> None:
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)

    async def main() -> tuple[list[Generation], list[Generation]]:
        hold = HeldDecode(four)
        running = [asyncio.ensure_future(four.generate(p, params)) for p in prompts]
        await started(four, 0)
        queued = [asyncio.ensure_future(four.generate(p, GREEDY)) for p in prompts]
        await wait_until_async(
            lambda: len(four._backend.queue) == len(prompts), 60, "requests queued"
        )
        await held_call(four, hold, four.pause, "abort")
        return (
            list(await asyncio.wait_for(asyncio.gather(*running), 30)),
            list(await asyncio.wait_for(asyncio.gather(*queued), 30)),
        )

    running, queued = asyncio.run(main())
    assert all(g.finish_reason == "abort" and 0 < len(g.token_ids) < 300 for g in running)
    assert all(len(g.logprobs) == len(g.versions) == len(g.token_ids) for g in running)
    assert all(g.finish_reason == "abort" and g.token_ids == () for g in queued)
    four.resume()
    gens = four.generate_batch(prompts, GREEDY)
    assert all(g.finish_reason in ("stop", "length") for g in gens)


def test_pause_wait_lets_the_batch_finish(four: HFEngine, prompts: list[list[int]]) -> None:
    async def main() -> list[Generation]:
        hold = HeldDecode(four)
        tasks = [asyncio.ensure_future(four.generate(p, GREEDY)) for p in prompts]
        await started(four, 0)
        await held_call(four, hold, four.pause, "wait")  # the batch was running
        assert four.is_paused
        # still paused: they can only finish because the pause waited for them
        gens = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await asyncio.to_thread(four.resume)
        return list(gens)

    assert all(g.finish_reason != "abort" and g.token_ids for g in asyncio.run(main()))


def test_closed_engine_raises(tiny_model_path: Path, prompts: list[list[int]]) -> None:
    engine = HFEngine(tiny_model_path)
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)

    async def main() -> list[Any]:
        hold = HeldDecode(engine)
        tasks = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts]
        await started(engine, 0)  # a step is in flight
        await held_call(engine, hold, engine.close)
        out = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        return list(out)

    results = asyncio.run(main())
    assert all(isinstance(r, EngineClosedError) for r in results), results  # none finished
    assert engine.tokens_generated < 300, "close waited for more than the step in flight"
    with pytest.raises(EngineClosedError, match="closed"):
        engine.generate_batch(prompts[:1], GREEDY)
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.generate(prompts[0], GREEDY))
    owned = [engine.runtime.thread, *engine._backend.worker._threads]  # loop + decode worker
    assert owned and not any(t.is_alive() for t in owned)
