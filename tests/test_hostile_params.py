"""Hostile inputs: prefix-cache keys a tenant cannot forge, and sampling settings or logits at the edges of fp32."""
from __future__ import annotations

import hashlib
import os
import struct

import pydantic
import pytest
import torch

from resin.core.prefix_cache import block_hashes
from resin.core.request import Request
from resin.core.sampler import Sampler
from resin.core.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from resin.server.protocol import ChatCompletionRequest, CompletionRequest

pytestmark = pytest.mark.unit

FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


# ---- prefix-cache keys ----

def sha256_chain(tokens: list[int], block_size: int) -> list[bytes]:
    """The documented key, computed independently: sha256(parent + int64 little-endian ids), from a fixed root."""
    prev = hashlib.sha256(b"resin-prefix-root").digest()
    keys = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        prev = hashlib.sha256(prev + struct.pack(f"<{block_size}q", *tokens[start:start + block_size])).digest()
        keys.append(prev)
    return keys


def test_block_keys_are_a_sha256_chain():
    tokens = torch.randint(0, 200_000, (70,)).tolist() + [-1, 2**63 - 1]  # extremes of int64 pack as themselves
    keys = block_hashes(tokens, 8)
    assert len(keys) == 9 and all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    assert keys == sha256_chain(tokens, 8)
    assert block_hashes(tokens, 8, parents=keys[:4]) == keys  # extending known parents gives the same chain


def test_every_token_and_every_earlier_block_changes_the_key():
    tokens = torch.randint(0, 1000, (32,)).tolist()
    keys = block_hashes(tokens, 4)
    for pos in range(len(tokens)):
        changed = list(tokens)
        changed[pos] += 1
        other = block_hashes(changed, 4)
        block = pos // 4
        assert other[:block] == keys[:block]  # blocks before the change keep their keys
        assert all(a != b for a, b in zip(other[block:], keys[block:])), pos  # it and every later block change


# ---- non-finite settings are refused ----

@pytest.mark.parametrize("name", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_sampling_params_reject_non_finite(name, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{name}=.*finite"):
        SamplingParams(**{name: value})


@pytest.mark.parametrize("name", FLOAT_FIELDS)
def test_request_models_reject_json_infinity_and_nan(name):
    with pytest.raises(pydantic.ValidationError):
        CompletionRequest(prompt="x", **{name: float("inf")})
    for literal in ("Infinity", "-Infinity", "NaN"):  # what Python's json module reads from a request body
        with pytest.raises(pydantic.ValidationError):
            ChatCompletionRequest.model_validate_json(f'{{"messages": [], "{name}": {literal}}}')


def test_tiny_temperatures_are_greedy():
    assert SamplingParams(temperature=1e-40).greedy and SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy


# ---- the sampler at the edges ----

VOCAB = 64
EOS, STOP = VOCAB - 1, 5  # forbidden while min_tokens is not reached
EXTREMES = {
    "temperature": [0.0, 1e-40, 1e-6, GREEDY_TEMPERATURE, 1e-3, 1.0, 1e5, 1e38, 1e300],
    "top_p": [1e-300, 1e-38, 0.5, 1.0],
    "min_p": [0.0, 1e-38, 0.5, 1.0],
    "repetition_penalty": [1e-300, 1e-38, 1e-5, 1.0, 1e5, 1e38, 1e300],
    "presence_penalty": [-2.0, 2.0],
    "frequency_penalty": [-2.0, 2.0],
}


def hostile_logits(gen: torch.Generator) -> torch.Tensor:
    """Random rows, then rows a broken model or an overflow could produce."""
    rows = [torch.randn(VOCAB, generator=gen) * 10 for _ in range(4)]
    some_nan = torch.randn(VOCAB, generator=gen)
    some_nan[torch.randperm(VOCAB, generator=gen)[:VOCAB // 2]] = float("nan")
    rows.append(some_nan)
    rows.append(torch.full((VOCAB,), float("nan")))
    posinf = torch.randn(VOCAB, generator=gen)
    posinf[[3, 9, EOS]] = float("inf")
    rows.append(posinf)
    only_stops = torch.full((VOCAB,), float("-inf"))
    only_stops[[EOS, STOP]] = float("inf")  # the model wants to stop; min_tokens says no
    rows.append(only_stops)
    rows.append(torch.randn(VOCAB, generator=gen).sign() * 3e38)
    return torch.stack(rows)


def greedy_reference(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax, max) per row with NaN never chosen and the stop tokens masked; argmax takes the first of ties."""
    ref = logits.masked_fill(logits.isnan(), float("-inf"))
    ref[:, [EOS, STOP]] = float("-inf")
    return ref.argmax(dim=-1), ref.amax(dim=-1)


def hostile_batch(params: SamplingParams, n: int, gen: torch.Generator) -> list[Request]:
    reqs = []
    for i in range(n):
        r = Request(f"r{i}", torch.randint(0, VOCAB, (20,), generator=gen).tolist(), params, max_tokens=8,
                    eos_token_ids=frozenset({EOS}))
        r.token_ids.extend(torch.randint(0, VOCAB, (2,), generator=gen).tolist())  # 2 outputs < min_tokens
        reqs.append(r)
    return reqs


def sweep() -> list[SamplingParams]:
    out = []
    for name, values in EXTREMES.items():
        for value in values:
            for temperature in ([None] if name == "temperature" else [0.0, 1.0]):
                kw = {name: value} if temperature is None else {name: value, "temperature": temperature}
                out.append(SamplingParams(max_tokens=8, min_tokens=4, stop_token_ids=[STOP], **kw))
    return out


def test_sampler_survives_extreme_settings_and_non_finite_logits():
    seed = int.from_bytes(os.urandom(4), "little")  # fresh each run; printed on failure to reproduce
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.ones(VOCAB, dtype=torch.bool)
    allowed[[EOS, STOP]] = False
    for params in sweep():
        logits = hostile_logits(gen)
        reqs = hostile_batch(params, len(logits), gen)
        tokens = Sampler(VOCAB, torch.Generator().manual_seed(seed))(logits.clone(), reqs).token_ids
        where = f"seed={seed} {params}"
        for row, token in enumerate(tokens):
            assert 0 <= token < VOCAB, where
            assert token not in (EOS, STOP), f"row {row} chose a stop token min_tokens forbids: {where}"
            if (allowed & (logits[row] > float("-inf"))).any():  # NaN compares False: not counted
                assert not logits[row, token].isnan(), f"row {row} chose a NaN logit: {where}"
        unpenalised = params.repetition_penalty == 1.0 and params.presence_penalty == params.frequency_penalty == 0.0
        if params.greedy and unpenalised:
            ref, best = greedy_reference(logits)
            live = best > float("-inf")  # rows with no usable logit left are covered by the checks above
            assert torch.tensor(tokens)[live].tolist() == ref[live].tolist(), where
        if params.repetition_penalty == 1.0:
            assert tokens[6] in (3, 9), f"a +inf logit must win at any temperature: {where}"


def test_repetition_penalty_cannot_unmask_a_stop_token():
    """1e-300 is 0 in fp32, and -inf * 0 is NaN: the masked stop token must stay masked, not win the argmax."""
    logits = torch.randn(1, VOCAB)
    logits[0, EOS] = 50.0
    params = SamplingParams(temperature=0, min_tokens=4, max_tokens=8, repetition_penalty=1e-300)
    r = Request("r", [EOS, 1, 2], params, max_tokens=8, eos_token_ids=frozenset({EOS}))
    assert Sampler(VOCAB)(logits, [r]).token_ids[0] != EOS
