"""Sampler: the whole batch in tensor ops, each row with its own parameters.

Order: grammar and min_tokens masking, repetition/presence/frequency penalties, greedy argmax, temperature, top-k,
top-p, min-p, then a draw. The draw inverts each row's CDF at one uniform (the random_sample op), which samples from
probs exactly; a seeded request draws its uniform from its own torch.Generator, so its tokens do not depend on the
rest of the batch.
Logprobs are those of the model's raw distribution (before penalties and temperature), as vLLM reports them.

Non-finite scores never reach the argmax or the softmax (see _usable): a NaN logit (a broken model) is never chosen,
a +inf one (from the model or an extreme repetition_penalty) wins outright, and a row with nothing left falls back
to the model's own logits, then to any token the grammar and min_tokens allow. A token outside a row's grammar is
never chosen, not even by that last fallback (where the grammar and min_tokens disagree, the grammar wins); one
masked by min_tokens is chosen only when nothing else is left.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from resin.core.request import Request
from resin.core.structured_output import GrammarMask, grammar_mask
from resin.hal.ops import ARGMAX, RANDOM_SAMPLE

_NEG_INF = float("-inf")


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
        stops = self._early_stops(reqs, device)
        grammar = grammar_mask([r.grammar for r in reqs], self.vocab_size, device)
        masked = logits if grammar is None else grammar.apply(logits)
        masked = masked if stops is None else masked.index_put(stops, torch.tensor(_NEG_INF, device=device))
        scores = _usable(self._penalise(masked, reqs), masked, stops, grammar)

        greedy = [p.greedy for p in params]  # one rule for "greedy" (SamplingParams.greedy), here and everywhere
        tokens = ARGMAX(scores)
        if not all(greedy):
            temps = torch.tensor([1.0 if g else p.temperature for g, p in zip(greedy, params)], device=device)
            drawn = self._draw(scores, temps, reqs)
            tokens = torch.where(torch.tensor(greedy, device=device), tokens, drawn)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, self._logprobs(raw_logprobs, tokens, params))

    def _early_stops(self, reqs: list[Request], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, cols) of the stop tokens min_tokens forbids for now, or None."""
        rows, cols = [], []
        for i, r in enumerate(reqs):
            if r.num_output_tokens < r.params.min_tokens:
                stops = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else set(r.eos_token_ids))
                stops = [t for t in stops if t < self.vocab_size]
                rows += [i] * len(stops)
                cols += stops
        if not rows:
            return None
        return torch.tensor(rows, device=device), torch.tensor(cols, device=device)

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

    def _draw(self, scores: torch.Tensor, temps: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """A draw from each row's distribution; scores come from _usable, so every row has a finite maximum."""
        params = [r.params for r in reqs]
        # Shifted so each row's best token sits at 0 (softmax is shift-invariant): dividing by a small temperature
        # then cannot overflow to +inf or push a whole row to -inf, and the clamp keeps a temperature beyond fp32
        # (which would read as inf) from turning -inf / inf into NaN.
        shifted = scores - scores.amax(dim=-1, keepdim=True)
        logits = shifted / temps.clamp(max=torch.finfo(temps.dtype).max).unsqueeze(1)
        logits = apply_top_k_top_p_min_p(
            logits,
            [p.top_k for p in params], [p.top_p for p in params], [p.min_p for p in params])
        uniforms = _uniforms(len(reqs), self.generator)
        for i, r in enumerate(reqs):  # seeded rows draw from their own stream (a loop over seeded rows only)
            if r.generator is not None:
                uniforms[i] = _uniforms(1, r.generator).to(uniforms.device)
        return RANDOM_SAMPLE(logits.contiguous(), uniforms.to(logits.device))

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


def _uniforms(n: int, generator: torch.Generator) -> torch.Tensor:
    return torch.rand(n, dtype=torch.float64, generator=generator, device=generator.device)


def _usable(scores: torch.Tensor, masked: torch.Tensor, stops: tuple[torch.Tensor, torch.Tensor] | None,
            grammar: GrammarMask | None) -> torch.Tensor:
    """Scores argmax and softmax can take: every row finite or -inf, with at least one finite entry.

    NaN (a score the model failed to give, or an overflow like -inf * 0) becomes -inf: never chosen. In a row
    holding +inf, those tokens become 0 and the rest -inf, since +inf outweighs any finite score and softmax would
    turn inf - inf into NaN. A row with nothing left takes the model's own logits (`masked`: min_tokens applied,
    penalties not; repetition_penalty 1e38 can send every seen logit to -inf), and where those are dead too (a
    model that gave only NaN / -inf), 0 for every token the grammar and min_tokens allow; then for every token
    the grammar allows (a grammar that can only end while min_tokens forbids ending); then every token: some
    token must be emitted.
    """
    if bool(torch.isfinite(scores.amax(dim=-1)).all()):  # one pass: a row's max is NaN if it holds one, else +-inf
        return scores
    scores = _tame(scores)
    scores = torch.where(_dead(scores), _tame(masked), scores)
    allowed = torch.zeros_like(scores)
    if grammar is not None:
        allowed = grammar.apply(allowed)
    if stops is not None:
        by_grammar = allowed
        allowed = allowed.index_put(stops, torch.tensor(_NEG_INF, device=scores.device))
        allowed = torch.where(_dead(allowed), by_grammar, allowed)
    allowed = allowed.masked_fill(_dead(allowed), 0.0)
    return torch.where(_dead(scores), allowed, scores)


def _tame(scores: torch.Tensor) -> torch.Tensor:
    """NaN -> -inf; in rows holding +inf, those tokens -> 0 and the rest -> -inf."""
    scores = scores.masked_fill(scores.isnan(), _NEG_INF)
    posinf = scores.isposinf()
    only_posinf = torch.zeros_like(scores).masked_fill(~posinf, _NEG_INF)
    return torch.where(posinf.any(dim=-1, keepdim=True), only_posinf, scores)


def _dead(scores: torch.Tensor) -> torch.Tensor:
    """(N, 1): rows that are all -inf."""
    return scores.amax(dim=-1, keepdim=True) == _NEG_INF


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
