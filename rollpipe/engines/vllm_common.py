"""What both vLLM backends share: request conversion, output reading, weight loading.

``VLLMBackendBase`` turns a checked prompt and rollpipe ``SamplingParams`` into a vLLM
request (id, budget check, vLLM sampling params); the functions read vLLM's outputs
(sampled logprobs, finish reasons) and load weights inside a vLLM worker.
"""

from __future__ import annotations

import io
import itertools
import json
from typing import Any

import torch

from rollpipe.engines.backend import EngineLink
from rollpipe.engines.images import VisionTokens
from rollpipe.engines.records import EngineError, SamplingParams

__all__ = [
    "VLLMBackendBase",
    "finish_reason",
    "reload_weights_on_worker",
    "sampled_logprobs",
    "top_logprobs",
]

_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def reload_weights_on_worker(
    worker: Any,
    weights: list[tuple[str, torch.Tensor]] | None = None,
    blob: bytes | None = None,
) -> bool:
    """Runs inside a vLLM worker: load HF-named weights into the live model in place.

    In-process the tensors arrive as they are; across processes they come as one
    ``torch.save`` blob (vLLM's RPC encoder cannot type tensors nested in kwargs).
    """
    if blob is not None:
        weights = torch.load(io.BytesIO(blob), weights_only=True)
    if weights is None:
        raise ValueError("reload_weights_on_worker needs weights or blob")
    worker.model_runner.reload_weights(weights_iterator=iter(weights))
    return True


def sampled_logprobs(token_ids: list[int], logprobs: Any) -> list[float]:
    """The logprob of each sampled token, from vLLM's per-position logprob dicts."""
    if logprobs is None:
        raise EngineError("vLLM returned no logprobs although the request asked for them")
    return [float(pos[tok].logprob) for tok, pos in zip(token_ids, logprobs, strict=True)]


def top_logprobs(logprobs: Any, k: int) -> list[tuple[tuple[int, float], ...]]:
    """The ``k`` most likely ``(token_id, logprob)`` pairs of each position, most likely
    first, from vLLM's per-position dicts (which also hold the sampled token, whatever
    its rank)."""
    if logprobs is None:
        raise EngineError("vLLM returned no logprobs although the request asked for top_logprobs")
    out = []
    for pos in logprobs:
        ranked = sorted((lp.rank, tok, lp.logprob) for tok, lp in pos.items() if lp.rank <= k)
        out.append(tuple((int(tok), float(lp)) for _, tok, lp in ranked))
    return out


def finish_reason(reason: Any) -> str:
    """vLLM's finish reason as one of ``FINISH_REASONS``."""
    mapped = _REASONS.get(str(reason))
    if mapped is None:
        raise EngineError(f"vLLM finished the request with reason {reason!r}")
    return mapped


class VLLMBackendBase:
    """A vLLM engine (``LLMEngine`` or ``AsyncLLM``) and the link to the engine it serves.

    Both backends report tokens through ``EngineLink.produced`` as vLLM streams them.
    On a vision-language model (``vision``: its special tokens) they also take images
    (``prompt``) and never sample a vision token (a ``-inf`` logit bias; vLLM reports
    raw log-probs, so the logprobs are the model's own).
    """

    reports_tokens = True
    features = frozenset({"top_logprobs", "structured_outputs", "on_tokens"})

    def __init__(self, llm: Any, link: EngineLink, vision: VisionTokens | None = None) -> None:
        self.llm = llm
        self.link = link
        self.vocab_size: int | None = int(llm.model_config.get_vocab_size())
        self.max_model_len = int(llm.model_config.max_model_len)
        self._ids = itertools.count()
        self.vision = vision
        self.banned = vision.banned if vision is not None else ()
        if vision is not None:
            self.features = VLLMBackendBase.features | {"images"}
        self.no_images = (
            f"the model {llm.model_config.model!r} reads text only (its config.json has no "
            "vision_config with an image token id); load a vision-language model"
        )

    def request(self, prompt: list[int], params: SamplingParams) -> tuple[str, Any]:
        """A new request id and vLLM's sampling params; rejects a prompt too long."""
        if len(prompt) >= self.max_model_len:
            raise EngineError(
                f"prompt has {len(prompt)} tokens but max_model_len is {self.max_model_len}; "
                "shorten the prompt or build the engine with a larger max_model_len"
            )
        return f"rollpipe-{next(self._ids)}", self.sampling_params(params, self.banned)

    @staticmethod
    def prompt(prompt: list[int], images: tuple[Any, ...] | None) -> dict[str, Any]:
        """vLLM's prompt: the ids, and the images (all of the conversation's) if any."""
        if not images:
            return {"prompt_token_ids": prompt}
        return {"prompt_token_ids": prompt, "multi_modal_data": {"image": list(images)}}

    @staticmethod
    def sampling_params(params: SamplingParams, banned: tuple[int, ...] = ()) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        structured = None
        if params.structured_outputs is not None:
            structured = StructuredOutputsParams(**json.loads(params.structured_outputs))
        wanted = params.logprobs or params.top_logprobs > 0
        return VSamplingParams(
            n=1,
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            stop_token_ids=list(params.stop_token_ids),
            seed=params.seed,
            logprobs=params.top_logprobs if wanted else None,
            ignore_eos=params.ignore_eos,
            logit_bias={t: float("-inf") for t in banned} if banned else None,
            structured_outputs=structured,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.DELTA,
        )
