"""One HFEngine micro-batch being decoded, one forward pass at a time.

``DecodeBatch`` holds the rows' KV cache, attention mask and positions; ``step`` feeds
the model one token per row (the whole left-padded prompts on the first step) and picks
the next token of each row with the row's own sampling parameters and seeded
generator. Finished or abandoned rows are dropped from the cache before the next step.
``step`` runs on the engine's worker thread; the engine's loop touches a batch only
between two steps.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import torch

from rollpipe.engines.records import Generation, SamplingParams

__all__ = ["DecodeBatch", "Row", "logits_kwargs", "sample_row"]


class Row:
    """One request: its prompt and parameters, what it produced, and its future."""

    def __init__(
        self, prompt: list[int], params: SamplingParams, eos: frozenset[int], arrived: float
    ) -> None:
        self.prompt = prompt
        self.params = params
        self.arrived = arrived  # loop time of submission (the micro-batch window)
        self.fut: asyncio.Future[Generation] = asyncio.get_running_loop().create_future()
        self.stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else eos)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[tuple[tuple[int, float], ...]] = []
        self.versions: list[int] = []
        self.reason: str | None = None  # set by the step that ends the row

    def finish(self, reason: str) -> None:
        """Deliver what the row produced (on the loop)."""
        if not self.fut.done():
            gen = Generation(
                self.tokens, self.logprobs, reason, self.versions, top_logprobs=self.top
            )
            self.fut.set_result(gen)

    def fail(self, error: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_exception(error)


def sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """One token from ``logits`` [V] with temperature / top-k / top-p and ``gen``."""
    logits = logits / p.temperature
    if p.top_k > 0 and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, -1) >= p.top_p  # keep the first crossing
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    probs = torch.softmax(logits, -1)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def logits_kwargs(model: Any) -> dict[str, int]:
    """Ask the model for the last position's logits only, if its forward can."""
    params = inspect.signature(model.forward).parameters
    for name in ("logits_to_keep", "num_logits_to_keep"):  # transformers >= 4.50, older
        if name in params:
            return {name: 1}
    return {}


def _new_cache(model: Any) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)  # sliding-window layers where the model has them
    except TypeError:  # older transformers
        return DynamicCache()


class DecodeBatch:
    """Rows decoded together: left-padded prompts, then one token per row per step.

    ``banned`` token ids (a vision-language model's vision tokens) are never chosen;
    the log-probs stay the model's own (as vLLM's raw log-probs)."""

    def __init__(
        self,
        model: Any,
        rows: list[Row],
        pad: int,
        device: torch.device,
        extra: dict[str, int],
        *,
        banned: torch.Tensor | None = None,
    ) -> None:
        self.model = model
        self.banned = banned
        self.rows = rows  # the rows in the cache, in batch order
        self.pad = pad
        self.device = device
        self.extra = extra
        self.cache: Any = None
        self.mask = torch.empty(0)  # [B, T] attention mask over the cached tokens
        self.position = torch.empty(0)  # [B, 1] position of each row's last token
        self.last = torch.empty(0)  # [B, 1] each row's last sampled token
        self.gens: dict[int, torch.Generator] = {}
        for row in rows:
            if not row.params.greedy:
                gen = torch.Generator()
                if row.params.seed is None:
                    gen.seed()
                else:
                    gen.manual_seed(row.params.seed)
                self.gens[id(row)] = gen

    def step(self, rows: list[Row], version: int) -> list[Row]:
        """One forward pass for ``rows`` (this batch's rows still wanted, in order):
        one new token each, labelled ``version``. Returns the rows it finished."""
        with torch.inference_mode():
            if self.cache is None:
                self.rows = rows
                inputs = self._prefill()
            else:
                self._keep(rows)
                self.mask = torch.cat([self.mask, self.mask.new_ones((len(rows), 1))], 1)
                self.position = self.position + 1
                inputs = {"input_ids": self.last, "position_ids": self.position}
            out = self.model(
                **inputs,
                attention_mask=self.mask,
                past_key_values=self.cache,
                use_cache=True,
                **self.extra,
            )
            self.cache = out.past_key_values
            logits = out.logits[:, -1, :].float()
            pick = logits if self.banned is None else logits.index_fill(1, self.banned, -torch.inf)
            chosen = pick.argmax(-1)
            for i, row in enumerate(self.rows):
                gen = self.gens.get(id(row))
                if gen is not None:
                    chosen[i] = sample_row(pick[i], row.params, gen)
            self.last = chosen[:, None]
            tokens: list[int] = chosen.tolist()
            logprobs: list[float] = []
            tops: list[list[tuple[int, float]]] = []
            k = max(row.params.top_logprobs for row in self.rows)
            if k or any(row.params.logprobs for row in self.rows):
                every = torch.log_softmax(logits, -1)
                logprobs = every.gather(-1, self.last)[:, 0].tolist()
                if k:  # the k most likely of each row, most likely first
                    best = every.topk(k, -1)
                    tops = [
                        list(zip(ids, lps, strict=True))
                        for ids, lps in zip(
                            best.indices.tolist(), best.values.tolist(), strict=True
                        )
                    ]
        finished = []
        for i, row in enumerate(self.rows):
            row.tokens.append(tokens[i])
            row.versions.append(version)
            if row.params.logprobs:
                row.logprobs.append(logprobs[i])
            if row.params.top_logprobs:
                row.top.append(tuple(tops[i][: row.params.top_logprobs]))
            if tokens[i] in row.stop:
                row.reason = "stop"
            elif len(row.tokens) >= row.params.max_tokens:
                row.reason = "length"
            if row.reason is not None:
                finished.append(row)
        return finished

    def _prefill(self) -> dict[str, torch.Tensor]:
        width = max(len(r.prompt) for r in self.rows)
        ids = [[self.pad] * (width - len(r.prompt)) + r.prompt for r in self.rows]
        mask = [[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in self.rows]
        self.mask = torch.tensor(mask, dtype=torch.long, device=self.device)
        positions = (self.mask.cumsum(-1) - 1).clamp(min=0)  # padding sits at position 0
        self.position = positions[:, -1:]
        self.cache = _new_cache(self.model)
        return {
            "input_ids": torch.tensor(ids, dtype=torch.long, device=self.device),
            "position_ids": positions,
        }

    def _keep(self, rows: list[Row]) -> None:
        """Drop every row not in ``rows`` from the cache, mask and positions."""
        if len(rows) == len(self.rows):
            return
        index = {id(row): i for i, row in enumerate(self.rows)}
        keep = torch.tensor([index[id(row)] for row in rows], device=self.device)
        self.cache.batch_select_indices(keep)
        self.mask, self.position, self.last = self.mask[keep], self.position[keep], self.last[keep]
        self.rows = rows
