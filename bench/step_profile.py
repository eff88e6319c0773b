"""Where a decode step's time goes: the model forward vs everything else (scheduling, batch building, attention
planning, sampling, detokenising), for steady batches of decoding sequences.

    python bench/step_profile.py --batch-sizes 1,8,32,64 --steps 30

Each batch size gets its own engine: N requests with --prompt-len-token prompts (64 by default; 8000 for a
long-context step) are prefilled, then --steps decode steps are timed. The forward is timed by wrapping the
model's forward and compute_logits (the CPU runs them synchronously). Target (DESIGN.md): overhead <= 10% of the
step at batch 32.

--per-op also times every HAL op's provider calls (and the attention backend's per-layer forward and per-step
plan) during those steps: where the forward's time goes, op by op. The timers add a little to each call.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import time
from pathlib import Path

from resin import LLM, SamplingParams
from resin.hal import registry
from timers import Stopwatch


def profile(llm: LLM, batch: int, steps: int, per_op: bool = False, prompt_len: int = 64) -> dict:
    engine = llm.engine
    model = engine.runner.model
    spent = Stopwatch()
    op_time: collections.Counter[str] = collections.Counter()
    op_calls: collections.Counter[str] = collections.Counter()

    def op_timed(name, fn):
        def call(*a, **kw):
            start = time.perf_counter()
            out = fn(*a, **kw)
            op_time[name] += time.perf_counter() - start
            op_calls[name] += 1
            return out
        return call

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
        saved = registry.active_chains()
        attn = engine.runner.attn
        if per_op:
            registry.activate_chains({name: tuple(dataclasses.replace(p, fn=op_timed(name, p.fn)) for p in chain)
                                      for name, chain in saved.items()})
            attn.forward, attn.plan = op_timed("attention (per layer)", attn.forward), op_timed("attention plan",
                                                                                                attn.plan)
        spent.seconds = 0.0
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - start
    finally:
        model.forward, model.compute_logits = forward, logits
        if per_op:
            registry.activate_chains(saved)
            del attn.forward, attn.plan  # the instance attributes; the class methods show through again
        engine.abort_all()
    step_ms, fwd_ms = total / steps * 1e3, spent.seconds / steps * 1e3
    row = {"batch": batch, "step_ms": step_ms, "forward_ms": fwd_ms, "overhead_ms": step_ms - fwd_ms,
           "overhead_fraction": (step_ms - fwd_ms) / step_ms}
    if per_op:
        row["ops"] = {name: {"ms_per_step": t / steps * 1e3, "calls_per_step": op_calls[name] / steps}
                      for name, t in op_time.most_common()}
    return row


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
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory="1GiB", ops=args.ops,
              max_model_len=max(args.prompt_len + args.steps + 16, 2048))
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
