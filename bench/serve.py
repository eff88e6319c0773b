"""Serving benchmark: N clients against a running `resin run` (or one it starts), at a request rate.

    python bench/serve.py --num-requests 64 --concurrency 16 --request-rate inf --input-len 128 --output-len 64
    python bench/serve.py --url http://127.0.0.1:8000 ...        # an already running server (any OpenAI one)

Prompts are random token ids (fixed seed) so every engine sees the same work; `ignore_eos` makes every request
generate exactly --output-len tokens. Prints TTFT / ITL / end-to-end p50 and p99 and output tokens/s, and
writes the numbers as JSON (--out). Absolute numbers depend on the machine: compare engines in one run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start = time.perf_counter()
    ttft, last, gaps, tokens = None, start, [], 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            else:
                gaps.append(now - last)
            last = now
            tokens += 1
    return {"ttft": ttft, "itl": gaps, "e2e": time.perf_counter() - start, "output_tokens": tokens}


async def run(args: argparse.Namespace, url: str, model: str) -> dict:
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.input_len)] for _ in range(args.num_requests)]
    sem = asyncio.Semaphore(args.concurrency)
    limits = httpx.Limits(max_connections=args.concurrency + 4)

    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        async def limited(p):
            async with sem:
                return await one_request(client, url, model, p, args.output_len)

        tasks = []
        start = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(limited(p)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(args.request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    itls = [g for r in results for g in r["itl"]]
    e2es = [r["e2e"] for r in results]
    out_tokens = sum(r["output_tokens"] for r in results)
    return {
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "duration_s": duration, "requests": len(results), "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / duration, "requests_per_s": len(results) / duration,
        "ttft_s": {"p50": percentile(ttfts, 50), "p99": percentile(ttfts, 99), "mean": statistics.fmean(ttfts)},
        "itl_s": {"p50": percentile(itls, 50), "p99": percentile(itls, 99)},
        "e2e_s": {"p50": percentile(e2es, 50), "p99": percentile(e2es, 99)},
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_resin(run_args: list[str], log=None) -> tuple[subprocess.Popen, str]:
    """`resin run *run_args` on a free port of 127.0.0.1; returns once /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "resin.cli", "-q", "run", *run_args, "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT if log else None)
    return proc, wait_healthy(proc, f"http://127.0.0.1:{port}")


def wait_healthy(proc: subprocess.Popen, url: str, seconds: float = 600) -> str:
    """url, once its /health answers 200; the server's exit or silence past `seconds` ends the benchmark."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise SystemExit("the server did not come up")


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    return launch_resin([*([args.model] if args.model else []), "--served-model-name", "bench",
                         "--max-num-seqs", str(max(args.concurrency, 1))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="an already running server (default: start `resin run`)")
    ap.add_argument("--model", default=None, help="model for the started server (default: the built-in one)")
    ap.add_argument("--served-model-name", default="bench", help="model name to send with --url")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16, help="most requests in flight at once")
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (Poisson); inf = at once")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/serve.json", help="where to write the JSON")
    args = ap.parse_args()
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(args)
    try:
        result = asyncio.run(run(args, url, args.served_model_name))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    print(f"{result['requests']} requests in {result['duration_s']:.2f}s: {result['output_tokens_per_s']:.1f} "
          f"output tok/s, {result['requests_per_s']:.2f} req/s")
    for key in ("ttft_s", "itl_s", "e2e_s"):
        print(f"  {key[:-2]:>4}  p50 {result[key]['p50'] * 1000:8.1f} ms   p99 {result[key]['p99'] * 1000:8.1f} ms")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
