"""Helpers for the parity gate: run Resin recording the logits of every sampled step, and the HF reference."""
from __future__ import annotations

import torch

from resin import LLM, SamplingParams


class LogitsRecorder:
    def __init__(self):
        self.steps: dict[str, list[torch.Tensor]] = {}

    def __call__(self, reqs, logits):
        for r, row in zip(reqs, logits):
            self.steps.setdefault(r.request_id, []).append(row.detach().float().clone())

    def of(self, request_id: str, seq: int = 0) -> torch.Tensor:
        return torch.stack(self.steps[f"{request_id}#{seq}"])


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt])  # explicit mask: prompts may contain the pad id
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def run_and_compare(llm: LLM, rec: LogitsRecorder, hf_model, prompts: list[list[int]], max_tokens: int,
                    tol: float = 1e-3):
    """Generate greedily; every step's logits must match HF's teacher-forced logits. Returns the outputs."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert out.error is None, out.error
        tokens = out.outputs[0].token_ids
        assert len(tokens) == max_tokens
        ref = hf_logits(hf_model, prompt + tokens)[len(prompt) - 1:len(prompt) - 1 + max_tokens]
        mine = rec.of(out.request_id)[-max_tokens:]
        diff = (mine - ref).abs().max().item()
        assert diff <= tol, f"prompt len {len(prompt)}: max |logit diff| {diff:.2e} > {tol}"
    return outs


def quantised_greedy_agreement(folder, hf_model, steps: int = 8) -> float:
    """Resin's greedy tokens on a quantised checkpoint vs the dequantised reference model's argmax at each of
    those steps (teacher-forced on Resin's tokens): the share of steps where they agree. Activation quantisation
    moves logits by a few percent of their spread, so w8a8 follows the reference on most steps, not all."""
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="8MiB")
    prompt = torch.randint(0, 211, (12,)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    ref_logits = hf_logits(hf_model, prompt + tokens)[len(prompt) - 1:-1]
    return (ref_logits.argmax(-1) == torch.tensor(tokens)).float().mean().item()
