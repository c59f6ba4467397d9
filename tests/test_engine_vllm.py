"""VLLMEngine on the tiny model: the protocol, pause/resume, weight sync, close.

All tests but two share the session engine (``vllm_engine``); tests that change its
weights restore them before returning.
"""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from waiting import holds_for_async, wait_until, wait_until_async

from rollpipe.engines import EngineClosedError, EngineError, Generation, SamplingParams
from rollpipe.engines.vllm import VLLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    grids = ["P_O\n_OG", "#####\n#PX_#\n#__O#\n#####", "P___\n_O_O\n___G", "Hello"]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": g}], tokenize=True, add_generation_prompt=True
        )["input_ids"]
        for g in grids
    ]


@pytest.fixture(scope="module")
def hf_model(tiny_model_path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_path)).eval()
    model.generation_config.eos_token_id = None  # greedy to max_new_tokens, like ignore_eos
    return model


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture
def restore_weights(vllm_engine: VLLMEngine, hf_model: Any) -> Iterator[None]:
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    yield
    hf_model.load_state_dict(original)
    vllm_engine.update_weights(original)


def perturb(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)


def check_generation(g: Generation, max_tokens: int, version: int) -> None:
    assert 1 <= len(g.token_ids) <= max_tokens
    assert g.finish_reason in ("stop", "length")
    if g.finish_reason == "length":
        assert len(g.token_ids) == max_tokens
    assert len(g.logprobs) == len(g.token_ids)
    assert all(math.isfinite(lp) and lp <= 0 for lp in g.logprobs)
    assert g.versions == (version,) * len(g.token_ids)


def test_greedy_generation_tokens_logprobs_max_tokens(
    vllm_engine: VLLMEngine, prompts: list[list[int]]
) -> None:
    before = vllm_engine.tokens_generated
    gens = vllm_engine.generate_batch(prompts, GREEDY)
    assert vllm_engine.tokens_generated - before == sum(len(g.token_ids) for g in gens)
    for g in gens:
        check_generation(g, 12, vllm_engine.version)
    full = vllm_engine.generate_batch(prompts, GREEDY.replace(ignore_eos=True, max_tokens=7))
    assert [len(g.token_ids) for g in full] == [7] * len(prompts)
    assert all(g.finish_reason == "length" for g in full)
    no_lp = vllm_engine.generate_batch(prompts[:1], GREEDY.replace(logprobs=False))[0]
    assert no_lp.logprobs == () and no_lp.token_ids == gens[0].token_ids


def test_stop_token_ends_generation_with_stop(
    vllm_engine: VLLMEngine, prompts: list[list[int]]
) -> None:
    params = GREEDY.replace(ignore_eos=True)
    ref = vllm_engine.generate_batch(prompts[:1], params)[0].token_ids
    stop = ref[5]
    k = ref.index(stop)
    got = vllm_engine.generate_batch(prompts[:1], params.replace(stop_token_ids=(stop,)))[0]
    assert got.finish_reason == "stop"
    assert got.token_ids == ref[: k + 1]


def test_seeds_make_sampling_reproducible(
    vllm_engine: VLLMEngine, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    a = vllm_engine.generate_batch([prompts[0]], params)[0]
    b = asyncio.run(vllm_engine.generate(prompts[0], params))
    c = vllm_engine.generate_batch([prompts[0]], params.replace(seed=8))[0]
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs)
    assert a.token_ids != c.token_ids


def test_generate_from_many_threads_and_loops(
    vllm_engine: VLLMEngine, prompts: list[list[int]]
) -> None:
    ref = [g.token_ids for g in vllm_engine.generate_batch(prompts, GREEDY)]
    results: dict[int, list[tuple[int, ...]]] = {}

    def worker(i: int) -> None:
        async def main() -> list[Generation]:
            return list(await asyncio.gather(*(vllm_engine.generate(p, GREEDY) for p in prompts)))

        results[i] = [g.token_ids for g in asyncio.run(main())]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert results == {i: ref for i in range(3)}


def test_update_weights_matches_transformers_greedy(
    vllm_engine: VLLMEngine, hf_model: Any, prompts: list[list[int]], restore_weights: None
) -> None:
    params = GREEDY.replace(max_tokens=16, ignore_eos=True)
    before = [g.token_ids for g in vllm_engine.generate_batch(prompts, params)]
    assert [list(t) for t in before] == [hf_greedy(hf_model, p, 16) for p in prompts]
    perturb(hf_model, seed=1)
    v0 = vllm_engine.version
    t0 = time.perf_counter()
    assert vllm_engine.update_weights(hf_model) == v0 + 1 == vllm_engine.version
    sync_s = time.perf_counter() - t0
    after = vllm_engine.generate_batch(prompts, params)
    assert [list(g.token_ids) for g in after] == [hf_greedy(hf_model, p, 16) for p in prompts]
    assert [g.token_ids for g in after] != before
    assert all(g.versions == (v0 + 1,) * 16 for g in after)
    assert vllm_engine.update_weights(hf_model.state_dict().items(), version=v0 + 10) == v0 + 10
    assert sync_s < 30


async def _start_with_probe(
    engine: VLLMEngine, prompts: list[list[int]], params: SamplingParams
) -> list[asyncio.Task[Generation]]:
    """Submit ``prompts`` then a 2-token probe; return once the probe is done, so every
    request has been scheduled and produced tokens."""
    tasks = [asyncio.ensure_future(engine.generate(p, params)) for p in prompts]
    await asyncio.sleep(0)
    await engine.generate(prompts[0], params.replace(max_tokens=3))
    return tasks


def test_pause_keep_freezes_then_resumes_with_new_version(
    vllm_engine: VLLMEngine, hf_model: Any, tokenizer: Any, restore_weights: None
) -> None:
    prompts = [tokenizer(f"Turn {i}: P_O_G")["input_ids"] for i in range(8)]
    # near max_model_len (2048): far more steps than the pause takes to land on any CPU
    n = 1900
    params = SamplingParams(max_tokens=n, temperature=1.0, seed=3, ignore_eos=True)
    v0 = vllm_engine.version

    async def main() -> list[Generation]:
        tasks = await _start_with_probe(vllm_engine, prompts, params)
        await asyncio.to_thread(vllm_engine.pause, "keep")
        assert vllm_engine.is_paused
        assert not any(t.done() for t in tasks)
        paused_at = vllm_engine.tokens_generated

        def frozen() -> bool:
            return vllm_engine.tokens_generated == paused_at and not any(t.done() for t in tasks)

        await holds_for_async(frozen, 0.3, "a paused engine generates nothing")
        perturb(hf_model, seed=2)
        await asyncio.to_thread(vllm_engine.update_weights, hf_model)
        assert frozen(), "the weight update generated while paused"
        await asyncio.to_thread(vllm_engine.resume)
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 120))

    gens = asyncio.run(main())
    assert not vllm_engine.is_paused
    for g in gens:
        assert len(g.token_ids) == n and g.finish_reason == "length"
        n_old = g.versions.count(v0)
        assert g.versions == (v0,) * n_old + (v0 + 1,) * (n - n_old)
        assert 0 < n_old < n  # the request spans the update
        assert all(math.isfinite(x) and x <= 0 for x in g.logprobs)


def test_pause_abort_keeps_partial_tokens(
    vllm_engine: VLLMEngine, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)
    v = vllm_engine.version
    backend: Any = vllm_engine._backend

    async def main() -> tuple[list[Generation], Generation]:
        tasks = await _start_with_probe(vllm_engine, prompts * 4, params)
        await asyncio.to_thread(vllm_engine.pause, "abort")
        gens = list(await asyncio.wait_for(asyncio.gather(*tasks), 30))
        paused_at = vllm_engine.tokens_generated
        later = asyncio.ensure_future(vllm_engine.generate(prompts[0], GREEDY))
        await wait_until_async(lambda: backend.queued, 30, "the request to wait for resume")
        await holds_for_async(
            lambda: not later.done() and vllm_engine.tokens_generated == paused_at,
            0.2,
            "a request submitted while paused does not run",
        )
        await asyncio.to_thread(vllm_engine.resume)
        return gens, await asyncio.wait_for(later, 60)

    gens, later = asyncio.run(main())
    for g in gens:
        assert g.finish_reason == "abort"
        assert 0 < len(g.token_ids) < 1900
        assert len(g.logprobs) == len(g.versions) == len(g.token_ids)
        assert set(g.versions) == {v}
    check_generation(later, 12, v)


def test_pause_wait_drains_in_flight_requests(
    vllm_engine: VLLMEngine, prompts: list[list[int]]
) -> None:
    params = GREEDY.replace(max_tokens=300, ignore_eos=True)

    async def main() -> list[Generation]:
        tasks = await _start_with_probe(vllm_engine, prompts, params)  # all in flight
        await asyncio.to_thread(vllm_engine.pause, "wait")
        assert vllm_engine.is_paused
        # still paused: they can only finish because the pause waited for them
        gens = await asyncio.wait_for(asyncio.gather(*tasks), 30)
        await asyncio.to_thread(vllm_engine.resume)
        return list(gens)

    for g in asyncio.run(main()):
        check_generation(g, 300, vllm_engine.version)


def test_cancelled_request_is_aborted_others_continue(
    vllm_engine: VLLMEngine, prompts: list[list[int]]
) -> None:
    long = SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)
    backend: Any = vllm_engine._backend

    async def main() -> list[Generation]:
        start = vllm_engine.tokens_generated
        doomed = asyncio.ensure_future(vllm_engine.generate(prompts[0], long))
        others = [asyncio.ensure_future(vllm_engine.generate(p, GREEDY)) for p in prompts]
        await wait_until_async(  # doomed was added first: it is generating
            lambda: vllm_engine.tokens_generated > start and backend.active, 30, "tokens"
        )
        doomed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await doomed
        return list(await asyncio.wait_for(asyncio.gather(*others), 60))

    for g in asyncio.run(main()):
        check_generation(g, 12, vllm_engine.version)
    # cancellation reaches the engine loop asynchronously
    wait_until(lambda: not backend.active, 10, "the cancelled request to leave the engine")


def test_bad_requests_fail_clearly(vllm_engine: VLLMEngine) -> None:
    with pytest.raises(EngineError, match="max_model_len"):
        vllm_engine.generate_batch([[5] * vllm_engine.max_model_len], GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        vllm_engine.generate_batch([[10**6]], GREEDY)
    with pytest.raises(ValueError, match="pause mode"):
        vllm_engine.pause("freeze")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version"):
        vllm_engine.update_weights({"x": torch.zeros(1)}, version=-1)


def test_close_fails_waiting_and_later_requests(tiny_model_path: Path) -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    engine = VLLMEngine(tiny_model_path, kv_cache_space_gib=0.25, max_model_len=512)
    assert torch.equal(torch.rand(3), expected), "starting vLLM reseeded the global RNG"
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)  # of 512

    async def main() -> list[Any]:
        tasks = [asyncio.ensure_future(engine.generate([1, 2, 3], params)) for _ in range(4)]
        await wait_until_async(lambda: engine.tokens_generated >= 4, 60, "requests running")
        await asyncio.to_thread(engine.close)
        out = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 10)
        return list(out)

    with engine:
        results = asyncio.run(main())
    assert all(isinstance(r, EngineClosedError) for r in results), results  # none finished
    with pytest.raises(EngineClosedError):
        asyncio.run(engine.generate([1, 2], GREEDY))
    with pytest.raises(EngineClosedError):
        engine.generate_batch([[1, 2]], GREEDY)
    engine.close()  # idempotent
    assert engine.closed and not engine.runtime.thread.is_alive()


@pytest.mark.slow
def test_multiprocess_mode(
    tiny_model_path: Path, hf_model: Any, prompts: list[list[int]], tokenizer: Any
) -> None:
    """AsyncLLM with its engine core in a child process: same protocol (top logprobs,
    structured outputs and ids as produced included); a killed core fails waiting and
    later requests with EngineError instead of hanging."""
    params = GREEDY.replace(max_tokens=16, ignore_eos=True)
    engine = VLLMEngine(
        tiny_model_path, multiprocess=True, kv_cache_space_gib=0.25, max_model_len=512
    )
    try:
        children = multiprocessing.active_children()
        assert children, "AsyncLLM should run its engine core in a child process"
        gens = engine.generate_batch(prompts, params)
        assert [list(g.token_ids) for g in gens] == [hf_greedy(hf_model, p, 16) for p in prompts]
        (top,) = engine.generate_batch(prompts[:1], params.replace(top_logprobs=3))
        assert [t[0][0] for t in top.top_logprobs] == list(top.token_ids)  # greedy: the top
        assert all(len(t) == 3 for t in top.top_logprobs)
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        shaped = SamplingParams(max_tokens=60, structured_outputs={"json": schema}, seed=0)
        (js,) = engine.generate_batch(prompts[:1], shaped)
        if js.finish_reason == "stop":  # the integer may run past max_tokens
            assert set(
                json.loads(tokenizer.decode(list(js.token_ids), skip_special_tokens=True))
            ) == {"n"}
        pieces: list[list[int]] = []
        whole = asyncio.run(engine.generate(prompts[0], params, on_tokens=pieces.append))
        assert [t for p in pieces for t in p] == list(whole.token_ids) == list(gens[0].token_ids)
        model = type(hf_model).from_pretrained(str(tiny_model_path)).eval()
        model.generation_config.eos_token_id = None
        perturb(model, seed=4)
        assert engine.update_weights(model) == 1
        gens = engine.generate_batch(prompts, params)
        assert [list(g.token_ids) for g in gens] == [hf_greedy(model, p, 16) for p in prompts]
        assert all(g.versions == (1,) * 16 for g in gens)

        async def abort_and_kill() -> list[Any]:
            room = 512 - max(len(p) for p in prompts)  # max_model_len: far more than it takes
            long = SamplingParams(max_tokens=room, temperature=0.0, ignore_eos=True)
            tasks = await _start_with_probe(engine, prompts, long)
            await asyncio.to_thread(engine.pause, "abort")
            aborted = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert all(g.finish_reason == "abort" and g.token_ids for g in aborted)
            await asyncio.to_thread(engine.resume)
            start = engine.tokens_generated
            tasks = [asyncio.ensure_future(engine.generate(p, long)) for p in prompts]
            await wait_until_async(
                lambda: engine.tokens_generated >= start + len(prompts), 60, "requests running"
            )
            for child in children:
                os.kill(child.pid, signal.SIGKILL)
            return list(await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60))

        results = asyncio.run(abort_and_kill())
        assert all(isinstance(r, EngineError) for r in results), results
        with pytest.raises(EngineError):
            engine.generate_batch(prompts[:1], params)
    finally:
        engine.close()
    wait_until(lambda: not multiprocessing.active_children(), 10, "the engine core to end")


def test_closing_a_second_inprocess_engine_keeps_the_first_alive(
    vllm_engine: Any, tiny_model_path: Path
) -> None:
    """In-process engines share vLLM's distributed state; closing one must not kill others."""
    second = VLLMEngine(tiny_model_path, kv_cache_space_gib=0.25, max_model_len=512)
    assert len(second.generate_batch([[1, 2, 3]], GREEDY)[0].token_ids) > 0
    second.close()
    out = vllm_engine.generate_batch([[1, 2, 3]], GREEDY)
    assert len(out[0].token_ids) > 0


def test_a_failed_step_kills_the_engine(tiny_model_path: Path) -> None:
    """The in-process stepper reports a failed step: waiting and later requests fail fast."""
    engine = VLLMEngine(tiny_model_path, kv_cache_space_gib=0.25, max_model_len=512)
    try:

        def broken_step() -> Any:
            raise RuntimeError("the forward pass fell over")

        engine._backend.llm.step = broken_step  # type: ignore[attr-defined]
        with pytest.raises(EngineError, match=r"step failed.*fell over"):
            engine.generate_batch([[1, 2, 3]], GREEDY)
        with pytest.raises(EngineError, match="died"):
            asyncio.run(engine.generate([1, 2], GREEDY))
    finally:
        engine.close()
    assert engine.closed and not engine.runtime.thread.is_alive()


def test_generation_reports_prefix_cache_hits(vllm_engine: VLLMEngine) -> None:
    prompt = [(7 * i) % 250 + 3 for i in range(70)]  # 2 full 32-token blocks, then 6
    first, second = (vllm_engine.generate_batch([p], GREEDY)[0] for p in (prompt, prompt))
    assert first.cached_tokens is not None and second.cached_tokens is not None
    assert 64 <= second.cached_tokens < len(prompt)  # whole blocks only, never the last token
