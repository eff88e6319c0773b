"""The porting gate as a library call: Resin against Hugging Face transformers on the same weights and prompts.

Resin runs each prompt greedily (batched together, through the paged cache) while recording the logits of every
sampled step; transformers computes teacher-forced logits over prompt + Resin's tokens, and its own greedy
generate. In fp32 the gate is the design's: max |logit diff| <= 1e-3 at prefill and every decode step, and the
same greedy tokens. In bf16/fp16 rounding makes long greedy runs drift, so the gate there is top-1 agreement
>= 95% under teacher forcing; the logit differences are reported.
"""
from __future__ import annotations

import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from resin.core.sampling_params import SamplingParams
from resin.models import MODEL_REGISTRY

FP32_LOGIT_TOL = 1e-3
LOW_PRECISION_TOP1 = 0.95
DEFAULT_TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):",
                        "Once upon a time, in a small village,", "Water boils at a temperature of"]


@dataclass
class Scorecard:
    model: str
    architecture: str
    backend: str
    dtype: str
    prompts: int
    decode_steps: int
    prefill_max_diff: float = 0.0
    decode_max_diff: float = 0.0
    top1_agreement: float = 0.0
    greedy_matches: int = 0
    mismatches: list[str] = field(default_factory=list)
    self_check: str = ""  # the startup check of each chosen provider against native on this model's shapes

    @property
    def fp32(self) -> bool:
        return self.dtype == "float32"

    @property
    def passed(self) -> bool:
        if self.fp32:
            return (max(self.prefill_max_diff, self.decode_max_diff) <= FP32_LOGIT_TOL
                    and self.greedy_matches == self.prompts)
        return self.top1_agreement >= LOW_PRECISION_TOP1

    def format(self) -> str:
        def ok(flag: bool) -> str:
            return "ok" if flag else "FAIL"

        gate = f"<= {FP32_LOGIT_TOL:g}" if self.fp32 else "(reported)"
        lines = [
            f"parity: {self.model} ({self.architecture}) on {self.backend}, {self.dtype}, "
            f"{self.prompts} prompts x {self.decode_steps} greedy steps, reference: transformers fp32",
            f"  prefill  max |logit diff|  {self.prefill_max_diff:.3e}  {gate}"
            + (f"  {ok(self.prefill_max_diff <= FP32_LOGIT_TOL)}" if self.fp32 else ""),
            f"  decode   max |logit diff|  {self.decode_max_diff:.3e}  {gate}"
            + (f"  {ok(self.decode_max_diff <= FP32_LOGIT_TOL)}" if self.fp32 else ""),
            f"  top-1 agreement            {self.top1_agreement:.1%}"
            + ("" if self.fp32 else f"  >= {LOW_PRECISION_TOP1:.0%}  {ok(self.top1_agreement >= LOW_PRECISION_TOP1)}"),
            f"  greedy tokens match        {self.greedy_matches}/{self.prompts}"
            + (f"  {ok(self.greedy_matches == self.prompts)}" if self.fp32 else "  (reported)"),
        ]
        lines += [f"    {m}" for m in self.mismatches]
        lines += [f"  {line}" for line in self.self_check.splitlines()]
        lines.append(f"RESULT: {'PASS' if self.passed else 'FAIL'}")
        return "\n".join(lines)


def _hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    if path.is_file():  # a .gguf: transformers dequantises it the same way
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, trust_remote_code=False).eval()


def _prompt_ids(llm, prompts: list[str] | None, vocab: int) -> list[list[int]]:
    tok = llm.get_tokenizer()
    if tok is not None:
        return [tok(p)["input_ids"] for p in (prompts or DEFAULT_TEXT_PROMPTS)]
    if prompts:  # without a tokenizer, prompt lines are space-separated token ids
        return [[int(x) for x in p.split()] for p in prompts]
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (5, 17, 33, 64)]


def run_parity(model_or_arch: str, backend: str = "auto", dtype: str | None = "float32",
               prompts: list[str] | None = None, decode_steps: int = 16) -> Scorecard:
    from resin.llm import LLM

    with tempfile.TemporaryDirectory(prefix="resin-parity-") as tmp:
        if model_or_arch in MODEL_REGISTRY:
            from resin.tiny import save_tiny_model

            path = Path(tmp)
            save_tiny_model(path, model_or_arch, seed=0)
        else:
            path = Path(model_or_arch).expanduser()
        steps: dict[str, list[torch.Tensor]] = {}

        def record(reqs, logits):
            for r, row in zip(reqs, logits):
                steps.setdefault(r.parent_id, []).append(row.float().cpu())

        llm = LLM(str(path), backend=backend, dtype=dtype, kv_cache_memory="256MiB", logits_observer=record)
        hf = _hf_model(path)
        vocab = hf.config.vocab_size
        ids = _prompt_ids(llm, prompts, vocab)
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=decode_steps, ignore_eos=True),
                            use_tqdm=False)
        card = Scorecard(model_or_arch, llm.architecture, llm.selection.backend.name,
                         str(llm.dtype).removeprefix("torch."), len(ids), decode_steps,
                         self_check=llm.self_check.summary() if llm.self_check else "self-check: off")
        agree = total = 0
        for i, (prompt, out) in enumerate(zip(ids, outs)):
            if out.error:
                raise ValueError(f"prompt of {len(prompt)} tokens could not run: {out.error}")
            tokens = out.outputs[0].token_ids
            mine = torch.stack(steps[out.request_id])[:, :vocab]
            with torch.no_grad():
                full = torch.tensor([prompt + tokens])
                ref = hf(full).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)].float()
                want = hf.generate(full[:, :len(prompt)], attention_mask=torch.ones_like(full[:, :len(prompt)]),
                                   max_new_tokens=decode_steps, min_new_tokens=decode_steps, do_sample=False,
                                   pad_token_id=0, eos_token_id=None)[0, len(prompt):].tolist()
            diff = (mine - ref).abs().amax(dim=-1)
            card.prefill_max_diff = max(card.prefill_max_diff, diff[0].item())
            if len(diff) > 1:
                card.decode_max_diff = max(card.decode_max_diff, diff[1:].max().item())
            agree += int((mine.argmax(-1) == ref.argmax(-1)).sum())
            total += len(tokens)
            if tokens == want:
                card.greedy_matches += 1
            else:
                first = next(i for i, (a, b) in enumerate(zip(tokens, want)) if a != b)
                card.mismatches.append(f"prompt {i}: greedy tokens "
                                       f"diverge at step {first} (resin {tokens[first]}, transformers {want[first]})")
        card.top1_agreement = agree / max(total, 1)
        return card
