"""Where a decode step's time goes: the model forward vs everything else (scheduling, batch building, attention
planning, sampling, detokenising), for steady batches of decoding sequences.

    python bench/step_profile.py --batch-sizes 1,8,32,64 --steps 30

Each batch size gets its own engine: N requests with --prompt-len-token prompts (64 by default; 8000 for a
long-context step) are prefilled, then --steps decode steps are timed. The forward is timed by wrapping the
model's forward and compute_logits (the CPU runs them synchronously). Target (DESIGN.md): overhead <= 10% of the
step at batch 32.

--per-op also times every HAL op's provider calls (and the attention backend's per-layer forward and per-step
plan) during those steps: where the forward's time goes, op by op. The timers add a little to each call.

--prefill N times a prefill instead: N fresh prompts of --prompt-len random tokens, one output token each, and the
same op-by-op split of one timed run (linear vs attention vs the rest):

    python bench/step_profile.py --prefill 32 --prompt-len 256 --dtype bfloat16 --quantization none
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import time
from pathlib import Path

import torch

from resin import LLM, SamplingParams
from resin.hal import registry
from timers import Stopwatch


@contextlib.contextmanager
def op_timers(engine, enabled: bool):
    """While active (and enabled), every HAL op's provider calls and the attention backend's per-layer forward and
    per-step plan add their wall time to the yielded (seconds, calls) counters; the originals return on exit."""
    op_time: collections.Counter[str] = collections.Counter()
    op_calls: collections.Counter[str] = collections.Counter()
    if not enabled:
        yield op_time, op_calls
        return

    def op_timed(name, fn):
        def call(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            op_time[name] += time.perf_counter() - start
            op_calls[name] += 1
            return out
        return call

    saved, attn = registry.active_chains(), engine.runner.attn
    registry.activate_chains({name: tuple(dataclasses.replace(p, fn=op_timed(name, p.fn)) for p in chain)
                              for name, chain in saved.items()})
    attn.forward, attn.plan = op_timed("attention (per layer)", attn.forward), op_timed("attention plan", attn.plan)
    try:
        yield op_time, op_calls
    finally:
        registry.activate_chains(saved)
        del attn.forward, attn.plan  # the instance attributes; the class methods show through again


def per_op_rows(op_time, op_calls, steps: int) -> dict:
    return {name: {"ms_per_step": t / steps * 1e3, "calls_per_step": op_calls[name] / steps}
            for name, t in op_time.most_common()}


def profile(llm: LLM, batch: int, steps: int, per_op: bool = False, prompt_len: int = 64) -> dict:
    engine = llm.engine
    model = engine.runner.model
    spent = Stopwatch()
    forward, logits = model.forward, model.compute_logits
    model.forward, model.compute_logits = spent.wrap(forward), spent.wrap(logits)
    try:
        for i in range(batch):
            engine.add_request(f"p{batch}-{i}", [100 + (i * 7 + j) % 5000 for j in range(prompt_len)],
                               SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
                or engine.scheduler.waiting:
            engine.step()
        engine.step()
        with op_timers(engine, per_op) as (op_time, op_calls):
            spent.seconds = 0.0
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            total = time.perf_counter() - start
    finally:
        model.forward, model.compute_logits = forward, logits
        engine.abort_all()
    step_ms, fwd_ms = total / steps * 1e3, spent.seconds / steps * 1e3
    row = {"batch": batch, "step_ms": step_ms, "forward_ms": fwd_ms, "overhead_ms": step_ms - fwd_ms,
           "overhead_fraction": (step_ms - fwd_ms) / step_ms}
    if per_op:
        row["ops"] = per_op_rows(op_time, op_calls, steps)
    return row


def profile_prefill(llm: LLM, prompts: int, prompt_len: int, reps: int = 2) -> dict:
    """Time to prefill `prompts` fresh prompts of random tokens (one output token each), best of reps after a
    warm-up, then once more with every op timed: where a prefill's time goes (linear vs attention vs the rest)."""
    engine, g = llm.engine, torch.Generator().manual_seed(0)

    def run(tag: str) -> float:
        for i in range(prompts):
            ids = torch.randint(min(100, engine.vocab_size // 2), min(40000, engine.vocab_size), (prompt_len,),
                                generator=g)
            engine.add_request(f"{tag}{i}", ids.tolist(),
                               SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    run("warm")
    seconds = min(run(f"r{i}-") for i in range(reps))
    with op_timers(engine, True) as (op_time, op_calls):
        run("timed")
    return {"prompts": prompts, "prompt_len": prompt_len, "seconds": seconds,
            "prefill_tok_s": prompts * prompt_len / seconds, "ops": per_op_rows(op_time, op_calls, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-sizes", default="1,8,32,64")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompt-len", type=int, default=64, help="tokens of context each sequence decodes after")
    ap.add_argument("--out", default="bench/results/step_profile.json")
    ap.add_argument("--per-op", action="store_true", help="also time each HAL op (provider calls) per step")
    ap.add_argument("--ops", default=None, help="provider overrides, as `resin run --ops` (e.g. linear=onednn)")
    ap.add_argument("--prefill", type=int, default=0, metavar="N",
                    help="instead of decode steps: prefill N fresh --prompt-len prompts, op by op")
    ap.add_argument("--quantization", default="auto", help="as `resin run --quantization` (none: dense weights)")
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory="2GiB", ops=args.ops, quantization=args.quantization,
              max_model_len=max(args.prompt_len + args.steps + 16, 2048))
    if args.prefill:
        r = profile_prefill(llm, args.prefill, args.prompt_len)
        print(f"{r['prompts']} prompts x {r['prompt_len']} tokens: {r['seconds']:.3f} s, "
              f"{r['prefill_tok_s']:.0f} tokens/s; op by op (one timed run):")
        for name, o in r["ops"].items():
            print(f"  {name:<28}{o['ms_per_step']:9.1f} ms{o['calls_per_step']:8.0f} calls")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"dtype": str(llm.dtype), "prefill": r}, indent=2))
        return
    rows = [profile(llm, int(b), args.steps, args.per_op, args.prompt_len) for b in args.batch_sizes.split(",")]
    print(f"{'batch':>6}{'step ms':>10}{'forward ms':>12}{'overhead ms':>13}{'overhead':>10}")
    for r in rows:
        print(f"{r['batch']:>6}{r['step_ms']:>10.2f}{r['forward_ms']:>12.2f}{r['overhead_ms']:>13.2f}"
              f"{r['overhead_fraction']:>10.1%}")
    for r in rows if args.per_op else []:
        print(f"\nbatch {r['batch']}: op{'':<22}ms/step  calls/step  us/call")
        for name, o in r["ops"].items():
            print(f"  {name:<28}{o['ms_per_step']:8.2f}{o['calls_per_step']:10.0f}"
                  f"{o['ms_per_step'] * 1e3 / max(o['calls_per_step'], 1):9.1f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"dtype": str(llm.dtype), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
