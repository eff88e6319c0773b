"""Greedy tokens after a long prompt: Resin's providers against the HAL's native ops, on the built-in model.

    python bench/greedy_native.py                          # 8,000 random prompt tokens, 32 greedy tokens, bf16 and fp32
    python bench/greedy_native.py --length 4096 --dtypes bfloat16

The parity check behind the CPU-speed work: the same prompt through the engine twice, once with the machine's
providers (C++ attention and linear) and once with `--ops attention=native,linear=native`, prefix caching off.
Prints whether the greedy tokens are equal and, at a first divergence, the native run's top log-probabilities
there (the margin that a difference in summation order flipped), and says so where the two tokens' native
log-probabilities are exactly equal: bf16 logits keep 8 significant bits, so the top tokens' logits tie
often, and at a tie either token is a greedy choice. --seed picks another random prompt.
"""
from __future__ import annotations

import argparse

import torch

from resin import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=8000, help="prompt tokens (random ids, seeded)")
    ap.add_argument("--tokens", type=int, default=32, help="greedy tokens to compare")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random prompt")
    args = ap.parse_args()
    prompt = torch.randint(100, 40000, (args.length,), generator=torch.Generator().manual_seed(args.seed)).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=5)
    for dtype in args.dtypes.split(","):
        outs = {}
        for name, ops in (("providers", None), ("native", "attention=native,linear=native")):
            llm = LLM(dtype=dtype, max_model_len=args.length + args.tokens + 16, enable_prefix_caching=False,
                      **({"ops": ops} if ops else {}))
            outs[name] = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
            del llm
        got, ref = outs["providers"].token_ids, outs["native"].token_ids
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        if first is None:
            print(f"{dtype}: {len(got)} greedy tokens equal after {args.length} prompt tokens")
        else:
            native_top = outs["native"].logprobs[first]
            top = {k: round(v.logprob, 4) for k, v in native_top.items()}
            tie = got[first] in native_top and native_top[got[first]].logprob == native_top[ref[first]].logprob
            print(f"{dtype}: first divergence at token {first} (providers {got[first]}, native {ref[first]}"
                  f"{': an exact tie in native' if tie else ''}); native's top log-probabilities there: {top}")


if __name__ == "__main__":
    main()
