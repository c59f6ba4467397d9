"""Benchmark: rollpipe's CPU per image turn against a text turn, and images per second.

**(a) CPU per turn** (the method of ``turn_cost.py`` and ``tool_turn.py``): a zero-latency
engine answers every request at once with a fixed response, so the CPU spent is
rollpipe's; figures are process CPU time (``time.process_time``) over one ``get_batch``
of ``EPISODES`` episodes, divided by the turns taken. Both arms use the tiny VLM's
tokenizer and chat template (``rollpipe.training.tiny_vlm.default_vlm_path``); episodes
never end before ``T`` turns (8, 16, 32, 64), and every observation is one user message
with the same text:

* **image turn** (``LookAgain``): the message also holds one 64x64 RGB image (a part
  ``{"type": "image"}``), so the episode runs the image conversation
  (``rollpipe.vision.conversation.ImageConversation``): the template's render diff, the
  image processor on the new image, all images so far sent with one pad each, the
  engine's reported prompt checked against the local expansion, the turn recorded with
  its expanded ids and features, and rows with ``multi_modal_inputs``. The engine is
  ``ImageEngine`` (below, bench-only, on rollpipe's ``BaseEngine``): it takes images and
  reports the prompt expanded as vLLM does (``rollpipe.engines.images.expand_image_pads``,
  each pad the 64x64 image's 4 tokens), so every check of a real VLM engine runs. Its own
  work (the expansion and the reported prompt's record) is measured on its thread
  (``time.thread_time``) and subtracted: ``image_turn_engine_us_{T}turns``;
* **text turn** (``ReadAgain``): the same message without the image, a text chat turn on a
  ``ScriptedEngine``.

Figures: ``image_turn_cpu_us_{T}turns``, ``chat_turn_cpu_us_{T}turns`` (µs per turn),
``image_turn_overhead_us_{T}turns`` (their difference), ``image_turn_engine_us_{T}turns``
(the bench engine's share, already left out) and ``image_turn_cpu_64_over_8`` /
``chat_turn_cpu_64_over_8`` (64 turns ÷ 8: issue 37's target is flat, a per-turn cost
that does not grow with the images so far).

**(b) Images per second through the pipeline**: ``RolloutPipeline`` with
``frozenlake_visual`` on the real in-process ``VLLMEngine`` on the tiny VLM, ``get_batch``
of ``PIPELINE_GROUPS`` groups of 4 (up to 4 turns, 8 sampled tokens a turn, all episodes
in flight): ``pipeline_images_per_s`` (images the engine took in, each counted in the
turn that added it), ``pipeline_image_turns_per_s``, ``pipeline_image_trajectories_per_s``,
wall time over ``get_batch`` after one warm-up batch.

Both parts need torchvision (transformers' Qwen2-VL image processor and vLLM's VLMs import
it): the ``vision`` extra, as ``nox -s bench`` installs it. Without it the benchmark
reports ``image_turn_skipped`` and measures nothing. The run holds torch to one intra-op
thread (restored after), as ``turn_cost.py`` does.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.common import BenchContext, Figures, median, one_torch_thread, rounded
from rollpipe.engines.backend import EngineLink
from rollpipe.engines.base import BaseEngine
from rollpipe.engines.images import VisionTokens, expand_image_pads, vision_tokens_of
from rollpipe.engines.protocol import OnTokens, PauseMode
from rollpipe.engines.records import Generation, SamplingParams
from rollpipe.engines.scripted import ScriptedEngine
from rollpipe.pipeline import PipelineConfig, RolloutPipeline

EPISODES = 16
IMAGE_SIDE = 64
TEXT = " ".join(f"w{i % 50}" for i in range(48)) + "\nThe grid:"
RESPONSE = "Action: Up. I move up one square now."
PIPELINE_GROUPS = 8
PIPELINE_GROUP_SIZE = 4

_IMAGES: list[Any] = []


def _images() -> list[Any]:
    """Eight distinct 64x64 RGB PIL images (built once; the episodes take turns)."""
    if not _IMAGES:
        from PIL import Image

        rng = np.random.default_rng(0)
        for _ in range(8):
            pixels = rng.integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
            _IMAGES.append(Image.fromarray(pixels, "RGB"))
    return _IMAGES


class LookAgain:
    """A chat env that never ends: every observation is the same text and a new image."""

    blocking = False  # microseconds per call: runs inline

    def __init__(self) -> None:
        self.images, self.turn = _images(), 0

    def _observation(self) -> list[dict[str, Any]]:
        image = self.images[self.turn % len(self.images)]
        self.turn += 1
        parts = [{"type": "text", "text": TEXT}, {"type": "image", "image": image}]
        return [{"role": "user", "content": parts}]

    def reset(self, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.turn = seed
        return self._observation(), {}

    def step(self, action_text: str) -> tuple[list[dict[str, Any]], float, bool, bool, dict]:
        return self._observation(), 0.0, False, False, {"action_valid": True}

    def close(self) -> None:
        return None


class ReadAgain:
    """``LookAgain`` without its image: the same text, a text chat turn."""

    blocking = False

    def _observation(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": TEXT}]

    def reset(self, seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return self._observation(), {}

    def step(self, action_text: str) -> tuple[list[dict[str, Any]], float, bool, bool, dict]:
        return self._observation(), 0.0, False, False, {"action_valid": True}

    def close(self) -> None:
        return None


class _ImageBackend:
    """Answers at once with ``response``; with images, reports the prompt expanded (each
    pad ``tokens_per_image`` pads, as vLLM does for a 64x64 image). ``cpu_s``: this
    backend's own CPU (its thread), which the benchmark subtracts."""

    vocab_size = None
    takes_views = True
    features = ("images",)

    def __init__(
        self, link: EngineLink, response: list[int], vision: VisionTokens, grid: list[int]
    ) -> None:
        self.link, self.response, self.vision, self.grid = link, response, vision, grid
        self.cpu_s = 0.0

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        on_tokens: OnTokens = None,
        *,
        images: tuple[Any, ...] | None = None,
    ) -> Generation:
        start = time.thread_time()
        ids = self.response[: params.max_tokens]
        n, version = len(ids), self.link.version()
        expanded = None
        if images:
            grids = [self.grid] * len(images)
            expanded = expand_image_pads(prompt, grids, 2, self.vision.image_pad)
        gen = Generation(ids, [0.0] * n, "stop", [version] * n, prompt_token_ids=expanded)
        self.cpu_s += time.thread_time() - start
        return gen

    async def pause(self, mode: PauseMode) -> None:
        return None

    async def resume(self) -> None:
        return None

    async def load_weights(self, named: list[Any], version: int) -> None:
        return None

    async def shutdown(self, error: BaseException) -> None:
        return None

    def release(self) -> None:
        return None


class ImageEngine(BaseEngine):
    """A zero-latency engine on a vision-language model's tokens (bench only): every
    request is answered with ``response`` at once; a request with images gets its prompt
    back expanded (``Generation.prompt_token_ids``), each image ``grid`` (``[t, h, w]``,
    merge 2). The engine's checks on a VLM (one pad per image, the reported expansion, no
    vision token in a response) all run, as on ``VLLMEngine``."""

    def __init__(self, response: list[int], vision: VisionTokens, grid: list[int]) -> None:
        super().__init__(name="bench-image-engine")

        async def start(link: EngineLink) -> _ImageBackend:
            return _ImageBackend(link, response, vision, grid)

        self._attach(start, "a fixed response")

    @property
    def cpu_s(self) -> float:
        return float(self._backend.cpu_s)  # type: ignore[attr-defined]


def _torchvision_error() -> str | None:
    """None where torchvision imports (behind rollpipe's guard), else why not."""
    try:
        importlib.import_module("rollpipe.vision")  # the guard, before torchvision
        importlib.import_module("torchvision")
    except Exception as e:  # absent, or a wheel whose import fails
        return f"{type(e).__name__}: {e}"
    return None


def _one_run(tokenizer: Any, vision: VisionTokens, grid: list[int], image: bool, turns: int):
    """(CPU µs per turn, the bench engine's µs per turn) of one batch."""
    response = tokenizer(RESPONSE + "<|im_end|>", add_special_tokens=False)["input_ids"]
    config = PipelineConfig(
        envs="bench.image_turn:LookAgain" if image else "bench.image_turn:ReadAgain",
        group_size=1,
        num_groups=EPISODES,
        batch_size=EPISODES,
        concurrency=EPISODES,
        max_turns=turns,
        max_length=2**16,
        sampling=SamplingParams(max_tokens=len(response)),
    )
    engine: Any = (
        ImageEngine(response, vision, grid)
        if image
        else ScriptedEngine(lambda prompt, params: response)
    )
    with engine, RolloutPipeline(config, engine, tokenizer) as pipe:
        cpu = time.process_time()
        batch = pipe.get_batch()
        cpu = time.process_time() - cpu
        engine_s = engine.cpu_s if image else 0.0
    assert batch is not None and len(batch) == EPISODES
    taken = int(batch.batch["response_mask"].sum()) // len(response)
    if taken != EPISODES * turns:
        raise RuntimeError(f"image_turn: {taken} turns taken, expected {EPISODES * turns}")
    if image:
        pads = int((batch.batch["input_ids"] == vision.image_pad).sum())
        per_image = grid[0] * grid[1] * grid[2] // 4
        if pads != taken * per_image:
            raise RuntimeError(f"image_turn: {pads} image pads in the rows for {taken} images")
    return 1e6 * (cpu - engine_s) / taken, 1e6 * engine_s / taken


def _cpu_per_turn(ctx: BenchContext, vlm: Any) -> Figures:
    from transformers import AutoTokenizer

    import rollpipe.vision.conversation  # noqa: F401  (registers the image conversation)
    from rollpipe.vision.conversation import load_processor

    tokenizer = AutoTokenizer.from_pretrained(str(vlm))
    vision = vision_tokens_of(vlm)
    assert vision is not None, f"{vlm} names no vision tokens"
    features = load_processor(str(vlm)).image_processor(images=_images()[:1], return_tensors="pt")
    grid = [int(x) for x in features["image_grid_thw"][0]]
    repeats = ctx.repeats_for(3)
    out: Figures = {}
    for turns in ctx.size(smoke=(8,), quick=(8, 16, 32, 64), full=(8, 16, 32, 64)):
        image_runs = [_one_run(tokenizer, vision, grid, True, turns) for _ in range(repeats)]
        text_runs = [_one_run(tokenizer, vision, grid, False, turns)[0] for _ in range(repeats)]
        image = rounded(median([r[0] for r in image_runs]), 1)
        text = rounded(median(text_runs), 1)
        out[f"image_turn_cpu_us_{turns}turns"] = image
        out[f"chat_turn_cpu_us_{turns}turns"] = text
        out[f"image_turn_overhead_us_{turns}turns"] = rounded(image - text, 1)
        out[f"image_turn_engine_us_{turns}turns"] = rounded(median([r[1] for r in image_runs]), 1)
        ctx.log(f"  {turns} turns: image {image} µs/turn, text {text} µs/turn")
    if "image_turn_cpu_us_64turns" in out:
        for kind in ("image", "chat"):
            ratio = float(out[f"{kind}_turn_cpu_us_64turns"]) / float(
                out[f"{kind}_turn_cpu_us_8turns"]
            )
            out[f"{kind}_turn_cpu_64_over_8"] = rounded(ratio, 2)
    return out


def _pipeline(ctx: BenchContext, vlm: Any) -> Figures:
    from transformers import AutoTokenizer

    from rollpipe.engines.vllm import VLLMEngine

    tokenizer = AutoTokenizer.from_pretrained(str(vlm))
    groups = ctx.size(smoke=1, quick=PIPELINE_GROUPS, full=2 * PIPELINE_GROUPS)
    config = PipelineConfig(
        envs="frozenlake_visual",
        group_size=PIPELINE_GROUP_SIZE,
        num_groups=10**6,
        batch_size=groups * PIPELINE_GROUP_SIZE,
        concurrency=groups * PIPELINE_GROUP_SIZE,
        max_turns=4,
        max_length=2048,
        seed=3,
        sampling={"max_tokens": 8, "temperature": 1.0},
    )
    walls, images, turns, trajectories = [], [], [], []
    with (
        VLLMEngine(vlm, kv_cache_space_gib=0.5, max_model_len=2048, seed=0) as engine,
        RolloutPipeline(config, engine, tokenizer) as pipe,
    ):
        pipe.get_batch()  # warm-up: first-call costs stay out
        for _ in range(ctx.repeats_for(3)):
            wall = time.perf_counter()
            batch = pipe.get_batch()
            walls.append(time.perf_counter() - wall)
            assert batch is not None
            inputs = batch.non_tensor_batch["multi_modal_inputs"]
            # one row per trajectory here (a row's features: its turns' images so far)
            images.append(sum(int(mm["image_grid_thw"].shape[0]) for mm in inputs if mm))
            turns.append(sum(len(s) for s in batch.non_tensor_batch["step_scores"]))
            trajectories.append(len(batch))
    out: Figures = {
        "pipeline_images_per_s": rounded(
            median([i / w for i, w in zip(images, walls, strict=True)])
        ),
        "pipeline_image_turns_per_s": rounded(
            median([t / w for t, w in zip(turns, walls, strict=True)])
        ),
        "pipeline_image_trajectories_per_s": rounded(
            median([n / w for n, w in zip(trajectories, walls, strict=True)])
        ),
        "pipeline_image_trajectories": trajectories[0],
    }
    ctx.log(
        f"  pipeline: {out['pipeline_images_per_s']} images/s, "
        f"{out['pipeline_image_turns_per_s']} turns/s"
    )
    return out


def run(ctx: BenchContext) -> Figures:
    error = _torchvision_error()
    if error is not None:
        ctx.log(f"  skipped: torchvision does not import ({error}); install the vision extra")
        return {"image_turn_skipped": f"torchvision does not import: {error}"}
    from rollpipe.training.tiny_vlm import default_vlm_path

    vlm = default_vlm_path()
    with one_torch_thread():
        out = _cpu_per_turn(ctx, vlm)
    out.update(_pipeline(ctx, vlm))
    return out
