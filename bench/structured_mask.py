"""What a JSON-schema grammar costs per decode step: filling the batch's token bitmask (xgrammar) and applying it,
as a fraction of the whole step, at a steady batch of constrained sequences.

    python bench/structured_mask.py --batch 32 --steps 40 --repeats 3 [--model PATH] [--out results.json]

The mask's cost is timed by wrapping the two functions the sampler calls (grammar_mask, GrammarMask.apply), and
advancing the matchers by wrapping Grammar.accept; the step is timed around engine.step(). The same batch also runs without a grammar (interleaved, medians of
--repeats runs) for the step time it would have had. Target (issue #17): mask <= 10% of the step at batch 32. Default model: the built-in one.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import resin.core.sampler as sampler_module
from resin import LLM, SamplingParams, StructuredOutputsParams
from resin.core.structured_output import Grammar, GrammarMask
from timers import Stopwatch

# Nested objects, arrays, enums, bounded strings and numbers: a sampled output moves through many grammar states.
SCHEMA = {"type": "object", "properties": {
    "orders": {"type": "array", "minItems": 1, "maxItems": 64, "items": {"type": "object", "properties": {
        "item": {"type": "string", "maxLength": 24},
        "qty": {"type": "integer", "minimum": 1, "maximum": 999},
        "price": {"type": "number"},
        "tags": {"type": "array", "maxItems": 4, "items": {"enum": ["hot", "cold", "vegan", "spicy"]}},
        "gift": {"type": "boolean"}},
        "required": ["item", "qty", "price", "tags", "gift"]}},
    "customer": {"type": "string", "maxLength": 40}},
    "required": ["orders", "customer"]}


def run(llm: LLM, batch: int, steps: int, constrained: bool) -> dict:
    engine = llm.engine
    mask_time, advance_time = Stopwatch(), Stopwatch()
    fill, apply, accept = sampler_module.grammar_mask, GrammarMask.apply, Grammar.accept
    sampler_module.grammar_mask, GrammarMask.apply = mask_time.wrap(fill), mask_time.wrap(apply)
    Grammar.accept = advance_time.wrap(accept)
    try:
        spec = StructuredOutputsParams(json=SCHEMA) if constrained else None
        prompt = llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "Write a long list of cafe orders as JSON."}], tokenize=False,
            add_generation_prompt=True)
        ids = llm.get_tokenizer()(prompt, add_special_tokens=False)["input_ids"]
        for i in range(batch):
            engine.add_request(f"{constrained}-{i}", ids, SamplingParams(
                temperature=1.0, seed=i, max_tokens=steps + 4, ignore_eos=not constrained, structured_outputs=spec))
        while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                              for r in engine.scheduler.running):
            engine.step()
        mask_time.seconds = advance_time.seconds = 0.0
        step_time, timed_steps, full = 0.0, 0, 0
        for _ in range(steps):
            running = engine.num_running
            start = time.perf_counter()
            engine.step()
            step_time += time.perf_counter() - start
            timed_steps += 1
            full += running == batch
        engine.abort_all()
    finally:
        sampler_module.grammar_mask, GrammarMask.apply, Grammar.accept = fill, apply, accept
    return {"constrained": constrained, "steps": timed_steps, "steps_at_full_batch": full,
            "step_ms": 1e3 * step_time / timed_steps, "mask_ms": 1e3 * mask_time.seconds / timed_steps,
            "mask_fraction": mask_time.seconds / step_time, "advance_ms": 1e3 * advance_time.seconds / timed_steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the built-in model")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3, help="interleaved runs of each; medians are reported")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch, kv_cache_memory="512MiB")
    run(llm, args.batch, 4, True)  # warm-up: compile the grammar, build kernels
    runs = {True: [], False: []}
    for _ in range(args.repeats):  # interleaved, medians: a 2-core machine's step time drifts between runs
        for constrained in (True, False):
            runs[constrained].append(run(llm, args.batch, args.steps, constrained))
    with_grammar, without = (sorted(runs[c], key=lambda r: r["step_ms"])[args.repeats // 2] for c in (True, False))
    result = {"model": args.model or "built-in", "batch": args.batch, "repeats": args.repeats,
              "machine": platform.processor() or platform.machine(), "with_grammar": with_grammar,
              "without_grammar": without, "step_time_ratio": with_grammar["step_ms"] / without["step_ms"],
              "runs": runs}
    print(f"batch {args.batch}: step {with_grammar['step_ms']:.1f} ms with a JSON-schema grammar "
          f"({with_grammar['steps_at_full_batch']}/{with_grammar['steps']} steps at full batch), "
          f"of which mask {with_grammar['mask_ms']:.2f} ms = {100 * with_grammar['mask_fraction']:.1f}% and "
          f"advancing the matchers {with_grammar['advance_ms']:.2f} ms; "
          f"without a grammar {without['step_ms']:.1f} ms (ratio {result['step_time_ratio']:.2f})")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
