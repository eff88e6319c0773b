"""Sampler: the whole batch in tensor ops, each row with its own parameters.

Order: min_tokens masking, repetition/presence/frequency penalties, greedy argmax, temperature, top-k, top-p,
min-p, then a draw. The draw is argmax(probs / Exp(1) noise), which samples from probs exactly; a seeded request
draws its noise from its own torch.Generator, so its tokens do not depend on the rest of the batch.
Logprobs are those of the model's raw distribution (before penalties and temperature), as vLLM reports them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from resin.core.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # Per row: (chosen logprob, chosen rank, top ids, top logprobs), or None when the row asked for no logprobs.
    logprobs: list[tuple[float, int, list[int], list[float]] | None]


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.full((len(rows), max(width, 1)), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
    return out.to(device)


def token_counts(rows: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """(N, vocab) counts of each token id per row."""
    ids = _padded(rows, vocab, device)
    counts = torch.zeros(len(rows), vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]


class Sampler:
    def __init__(self, vocab_size: int, generator: torch.Generator | None = None):
        self.vocab_size = vocab_size
        self.generator = generator or torch.Generator().manual_seed(0)

    def __call__(self, logits: torch.Tensor, reqs: list[Request]) -> SamplerOutput:
        logits = logits.float()[:, :self.vocab_size]
        device = logits.device
        params = [r.params for r in reqs]
        raw_logprobs = None
        if any(p.logprobs is not None for p in params):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self._mask_early_stops(logits, reqs)
        logits = self._penalise(logits, reqs)

        temps = torch.tensor([p.temperature for p in params], device=device)
        greedy = temps == 0
        tokens = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            tokens = torch.where(greedy, tokens, self._draw(logits, temps, reqs))
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, tokens, params))

    def _mask_early_stops(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        rows, cols = [], []
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.params.min_tokens:
                stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids))
                stops = [t for t in stops if t < self.vocab_size]
                rows += [i] * len(stops)
                cols += stops
        if rows:
            logits = logits.index_put((torch.tensor(rows), torch.tensor(cols)),
                                      torch.tensor(float("-inf"), device=logits.device))
        return logits

    def _penalise(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        params = [r.params for r in reqs]
        rep = [p.repetition_penalty for p in params]
        freq = [p.frequency_penalty for p in params]
        pres = [p.presence_penalty for p in params]
        device = logits.device
        if any(x != 1.0 for x in rep):
            seen = token_counts([r.token_ids for r in reqs], self.vocab_size, device) > 0
            penalty = torch.tensor(rep, device=device).unsqueeze(1)
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, scaled, logits)
        if any(x != 0.0 for x in freq + pres):
            counts = token_counts([r.output_token_ids for r in reqs], self.vocab_size, device)
            logits = (logits - torch.tensor(freq, device=device).unsqueeze(1) * counts
                      - torch.tensor(pres, device=device).unsqueeze(1) * (counts > 0))
        return logits

    def _draw(self, logits: torch.Tensor, temps: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        params = [r.params for r in reqs]
        logits = logits / torch.where(temps == 0, torch.ones_like(temps), temps).unsqueeze(1)
        logits = apply_top_k_top_p_min_p(
            logits,
            [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params])
        probs = torch.softmax(logits, dim=-1)
        noise = torch.empty_like(probs)
        noise.exponential_(generator=self.generator)
        for i, r in enumerate(reqs):  # seeded rows draw from their own stream (a loop over seeded rows only)
            if r.generator is not None:
                noise[i].exponential_(generator=r.generator)
        return (probs / noise).argmax(dim=-1)

    def _logprobs(self, raw: torch.Tensor | None, tokens: torch.Tensor, params: list) -> list:
        if raw is None:
            return [None] * len(params)
        chosen = raw.gather(1, tokens.unsqueeze(1))
        ranks = ((raw > chosen).sum(dim=1) + 1).tolist()
        k = max(p.logprobs or 0 for p in params)
        top_vals, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
        chosen_list, top_vals, top_ids = chosen.squeeze(1).tolist(), top_vals.tolist(), top_ids.tolist()
        out = []
        for i, p in enumerate(params):
            if p.logprobs is None:
                out.append(None)
            else:
                out.append((chosen_list[i], ranks[i], top_ids[i][:p.logprobs], top_vals[i][:p.logprobs]))
        return out


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_k: list[int], top_p: list[float],
                            min_p: list[float]) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p (nucleus) and min-p exclude, per row. 0 / 1.0 / 0.0 disable them."""
    device = logits.device
    vocab = logits.shape[-1]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=device)
        drop = torch.arange(vocab, device=device).unsqueeze(0) >= ks.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        p = torch.tensor(top_p, device=device).unsqueeze(1)
        drop = (before >= p) & (p < 1.0)  # fp32 cumsum rounding must not trim rows that asked for no top-p
        drop[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if any(p > 0.0 for p in min_p):
        probs = torch.softmax(logits, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=device).unsqueeze(1)
        logits = logits.masked_fill(probs < floor, float("-inf"))
    return logits
