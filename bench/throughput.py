"""Offline throughput of Resin: N prompts submitted at once, every one generating the same number of tokens.

    python bench/throughput.py --num-prompts 32 --output-len 64 --dtype auto
    python bench/throughput.py --input-len 128 --output-len 128 --num-prompts 64 --model path/to/model

Reports requests/s, input and output tokens/s, total time and the peak number of KV blocks in use. With
--ignore-eos (the default) every engine generates exactly --output-len tokens, so runs are comparable.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from prompts import make_prompts  # noqa: E402

from resin import LLM, SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or .gguf (default: the built-in model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=None, help="fixed prompt length (default: 22-200, seeded)")
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also write the result as JSON here")
    args = ap.parse_args()

    llm = LLM(args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs)
    prompts = make_prompts(llm.get_tokenizer(), args.num_prompts, seed=args.seed, fixed_len=args.input_len)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=args.ignore_eos)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up

    pool = llm.engine.kv.pool
    peak = 0
    step = llm.engine.step

    def tracked_step():
        nonlocal peak
        out = step()
        peak = max(peak, pool.num_blocks - pool.num_free)
        return out

    llm.engine.step = tracked_step
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_in = sum(len(p) for p in prompts)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"engine": "resin", "dtype": str(llm.dtype).removeprefix("torch."), "num_prompts": len(prompts),
              "seconds": elapsed, "requests_per_s": len(prompts) / elapsed, "input_tokens_per_s": n_in / elapsed,
              "output_tokens_per_s": n_out / elapsed, "peak_kv_blocks": peak, "kv_blocks": pool.num_blocks}
    print(f"{len(prompts)} prompts ({n_in} input tokens, {n_out} output tokens) in {elapsed:.2f}s: "
          f"{result['requests_per_s']:.2f} req/s, {result['input_tokens_per_s']:.0f} input tok/s, "
          f"{result['output_tokens_per_s']:.1f} output tok/s; peak KV blocks {peak}/{pool.num_blocks} "
          f"({result['dtype']})")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
