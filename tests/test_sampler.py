"""Sampler: greedy, masks, penalties, the draw's distribution, seeds independent of the batch, logprobs."""
from __future__ import annotations

import pytest

import torch

from resin.core.request import Request
from resin.core.sampler import Sampler, apply_top_k_top_p_min_p
from resin.core.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def req(params, prompt=(1, 2, 3), outputs=(), eos=frozenset(), rid="r"):
    r = Request(rid, list(prompt), params, max_tokens=params.max_tokens or 16, eos_token_ids=eos, seed=params.seed)
    r.token_ids.extend(outputs)
    if params.seed is not None:
        r.generator = torch.Generator().manual_seed(params.seed)
    return r


def test_greedy_is_argmax():
    logits = torch.randn(6, 50)
    out = Sampler(50)(logits, [req(SamplingParams(temperature=0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_top_k_top_p_min_p_masks():
    logits = torch.randn(3, 40)
    masked = apply_top_k_top_p_min_p(logits.clone(), [5, 0, 0], [1.0, 0.7, 1.0], [0.0, 0.0, 0.2])
    kept0 = torch.isfinite(masked[0]).nonzero().flatten()
    assert set(kept0.tolist()) == set(logits[0].topk(5).indices.tolist())
    probs = torch.softmax(logits[1].double(), 0)
    order = probs.argsort(descending=True)
    cum = probs[order].cumsum(0)
    n_keep = int((cum < 0.7).sum()) + 1  # the smallest prefix whose mass reaches top_p
    assert set(torch.isfinite(masked[1]).nonzero().flatten().tolist()) == set(order[:n_keep].tolist())
    probs2 = torch.softmax(logits[2], 0)
    assert set(torch.isfinite(masked[2]).nonzero().flatten().tolist()) == \
        set((probs2 >= 0.2 * probs2.max()).nonzero().flatten().tolist())


def test_penalties():
    vocab = 10
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0, 1.0, -2.0, 0.3, 0.1, 0.2]])
    sampler = Sampler(vocab)
    r = req(SamplingParams(temperature=0, repetition_penalty=2.0), prompt=[0, 1], outputs=[3])
    got = sampler._penalise(logits.clone(), [r])
    want = logits.clone()
    want[0, 0], want[0, 1], want[0, 3] = 1.0, -2.0, 1.5
    assert torch.allclose(got, want)
    r = req(SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25), prompt=[0],
            outputs=[3, 3, 5])
    got = sampler._penalise(logits.clone(), [r])
    want = logits.clone()
    want[0, 3] -= 0.5 + 0.25 * 2
    want[0, 5] -= 0.5 + 0.25
    assert torch.allclose(got, want)  # prompt token 0 untouched by presence/frequency


def test_repetition_penalty_applies_before_presence():
    logits = torch.tensor([[0.3, 1.0, -1.0]])
    r = req(SamplingParams(temperature=0, repetition_penalty=1.2, presence_penalty=0.5), prompt=[2], outputs=[0])
    got = Sampler(3)._penalise(logits.clone(), [r])
    assert torch.allclose(got, torch.tensor([[0.3 / 1.2 - 0.5, 1.0, -1.2]]))


def test_top_p_one_leaves_row_untouched_in_mixed_batch():
    logits = torch.randn(2, 5000) * 8
    masked = apply_top_k_top_p_min_p(logits.clone(), [0, 0], [1.0, 0.5], [0.0, 0.0])
    assert torch.isfinite(masked[0]).all() and not torch.isfinite(masked[1]).all()


def test_min_tokens_masks_stop_tokens():
    logits = torch.zeros(1, 8)
    logits[0, 7] = 10.0
    r = req(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[6]), eos=frozenset({7}))
    assert Sampler(8)(logits, [r]).token_ids[0] != 7
    r.token_ids.extend([1, 1])
    assert Sampler(8)(logits, [r]).token_ids[0] == 7


def test_draw_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.tensor([1.0, 0.0, -1.0, 2.0, 0.5])
    n = 20000
    reqs = [req(SamplingParams(temperature=0.8)) for _ in range(n)]
    out = Sampler(5, torch.Generator().manual_seed(1))(logits.expand(n, 5), reqs)
    freq = torch.bincount(torch.tensor(out.token_ids), minlength=5).double() / n
    assert (freq - torch.softmax(logits.double() / 0.8, 0)).abs().max() < 0.015


def test_seed_reproducible_regardless_of_batch():
    vocab = 30
    target = torch.randn(vocab)
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234)
    runs = []
    for batch_size, position in ((1, 0), (4, 2), (7, 6)):
        r = req(params)
        others = [req(SamplingParams(temperature=1.0)) for _ in range(batch_size - 1)]
        reqs = others[:position] + [r] + others[position:]
        tokens = []
        for _ in range(8):
            logits = torch.randn(batch_size, vocab)
            logits[position] = target
            tokens.append(Sampler(vocab)(logits, reqs).token_ids[position])
        runs.append(tokens)
    assert runs[0] == runs[1] == runs[2]
    assert len(set(runs[0])) > 1  # it really sampled


def test_logprobs_include_chosen_token_with_rank():
    logits = torch.randn(2, 20)
    reqs = [req(SamplingParams(temperature=0, logprobs=3)), req(SamplingParams(temperature=0))]
    out = Sampler(20)(logits, reqs)
    chosen_lp, rank, ids, vals = out.logprobs[0]
    ref = torch.log_softmax(logits[0], 0)
    assert rank == 1 and ids == ref.topk(3).indices.tolist()
    assert abs(chosen_lp - ref.max().item()) < 1e-6 and torch.allclose(torch.tensor(vals), ref.topk(3).values)
    assert out.logprobs[1] is None
