"""Turning sampled logprobs and prompt logits into the Logprob dictionaries users receive."""
from __future__ import annotations

from typing import Callable

import torch

from resin.core.outputs import Logprob, PositionLogprobs

Decoder = Callable[[int], str] | None


def logprobs_dict(token: int, lp: tuple[float, int, list[int], list[float]], decode: Decoder) -> PositionLogprobs:
    """The top-N alternatives plus the chosen token, each with its logprob and rank."""
    chosen_lp, chosen_rank, top_ids, top_vals = lp
    out: PositionLogprobs = {}
    for rank, (tid, val) in enumerate(zip(top_ids, top_vals), start=1):
        out[tid] = Logprob(val, rank, decode(tid) if decode else None)
    if token not in out:
        out[token] = Logprob(chosen_lp, chosen_rank, decode(token) if decode else None)
    return out


def prompt_logprobs_chunk(logits: torch.Tensor, next_tokens: list[int], top_n: int,
                          decode: Decoder) -> list[PositionLogprobs]:
    """logits[i] predicts next_tokens[i]: the logprob and rank of each actual prompt token plus the top-N."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    targets = torch.tensor(next_tokens, device=logprobs.device).unsqueeze(1)
    chosen = logprobs.gather(1, targets)
    ranks = ((logprobs > chosen).sum(dim=1) + 1).tolist()
    top_vals, top_ids = logprobs.topk(top_n, dim=-1) if top_n else (logprobs[:, :0], targets[:, :0])
    rows = zip(next_tokens, chosen.squeeze(1).tolist(), ranks, top_ids.tolist(), top_vals.tolist())
    return [logprobs_dict(tok, (lp, rank, ids, vals), decode) for tok, lp, rank, ids, vals in rows]
