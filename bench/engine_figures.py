"""Engine figures for issue 3 on the tiny model: throughput, pause latency, weight sync.

    python bench/engine_figures.py                      # in-process vLLM
    python bench/engine_figures.py --engine hf
    python bench/engine_figures.py --engine vllm --multiprocess

Prints: tokens/s for N requests run one at a time vs all at once (and the ratio), the
latency of pause("keep") / pause("abort") / resume with N requests in flight, and the
time of update_weights with the full model state dict.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from rollpipe.engines import Engine, HFEngine, SamplingParams, VLLMEngine
from rollpipe.training.tiny_model import default_model_path


def _prompts(tokenizer: Any, n: int) -> list[list[int]]:
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Turn {i}. Current state:\nP_{'_' * (i % 4)}O\n_O_G"}]
        out.append(
            tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)[
                "input_ids"
            ]
        )
    return out


async def _throughput(engine: Engine, prompts: list[list[int]], p: SamplingParams) -> None:
    await asyncio.gather(*(engine.generate(q, p) for q in prompts[:4]))  # warm-up
    t0 = time.perf_counter()
    seq_tokens = 0
    for q in prompts:
        seq_tokens += (await engine.generate(q, p)).num_tokens
    seq_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    gens = await asyncio.gather(*(engine.generate(q, p) for q in prompts))
    conc_s = time.perf_counter() - t0
    conc_tokens = sum(g.num_tokens for g in gens)
    print(
        f"sequential : {len(prompts)} requests, {seq_tokens} tokens in {seq_s:7.2f} s "
        f"= {seq_tokens / seq_s:8.0f} tok/s"
    )
    print(
        f"concurrent : {len(prompts)} requests, {conc_tokens} tokens in {conc_s:7.2f} s "
        f"= {conc_tokens / conc_s:8.0f} tok/s"
    )
    print(
        f"ratio      : concurrent / sequential throughput = "
        f"{(conc_tokens / conc_s) / (seq_tokens / seq_s):.1f}x"
    )


async def _pause_latency(engine: Engine, prompts: list[list[int]], repeats: int) -> None:
    long = SamplingParams(max_tokens=512, temperature=1.0, seed=0, ignore_eos=True)
    lat: dict[str, list[float]] = {"keep": [], "abort": [], "resume": []}
    for _ in range(repeats):
        for mode in ("keep", "abort"):
            tasks = [asyncio.ensure_future(engine.generate(q, long)) for q in prompts]
            await asyncio.sleep(0.5)
            t0 = time.perf_counter()
            await asyncio.to_thread(engine.pause, mode)  # type: ignore[arg-type]
            lat[mode].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            await asyncio.to_thread(engine.resume)
            lat["resume"].append(time.perf_counter() - t0)
            if mode == "keep":  # end them quickly for the next round
                await asyncio.to_thread(engine.pause, "abort")
                await asyncio.to_thread(engine.resume)
            await asyncio.gather(*tasks)
    for name, xs in lat.items():
        print(
            f"{name:7s} latency with {len(prompts)} in flight: median "
            f"{1000 * statistics.median(xs):7.1f} ms, max {1000 * max(xs):7.1f} ms"
        )


def _weight_sync(engine: Engine, path: str, repeats: int) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    state = model.state_dict()
    mib = sum(t.numel() * t.element_size() for t in state.values()) / 2**20
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.update_weights(state)
        times.append(time.perf_counter() - t0)
    print(
        f"weight sync: {mib:.2f} MiB state dict, median {1000 * statistics.median(times):.1f} "
        f"ms, max {1000 * max(times):.1f} ms (version now {engine.version})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=["vllm", "hf"], default="vllm")
    ap.add_argument("--multiprocess", action="store_true", help="vLLM AsyncLLM layout")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from transformers import AutoTokenizer

    path = str(default_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = _prompts(tokenizer, args.requests)
    t0 = time.perf_counter()
    engine: Any = (
        VLLMEngine(path, multiprocess=args.multiprocess)
        if args.engine == "vllm"
        else HFEngine(path)
    )
    print(
        f"engine     : {args.engine}{' (multiprocess)' if args.multiprocess else ''}, "
        f"started in {time.perf_counter() - t0:.1f} s; model {path}"
    )
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=0, ignore_eos=True)
    with engine:
        asyncio.run(_throughput(engine, prompts, params))
        asyncio.run(_pause_latency(engine, prompts, args.repeats))
        _weight_sync(engine, path, args.repeats + 2)


if __name__ == "__main__":
    main()
