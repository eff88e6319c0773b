"""Soak: many mixed, partly hostile clients against one `resin run`, then checks that nothing was lost or leaked.

    python bench/soak.py --model PATH                      # starts `resin run PATH` with a small KV budget
    python bench/soak.py --url http://127.0.0.1:8000       # an already running Resin server

Clients (seeded, so a run can be repeated): token-id prompts of mixed lengths behind a few shared prefixes, n from
1 to 4, streaming or not, greedy / seeded / unseeded sampling; ~10% disconnect mid-stream, ~5% stop reading (a
tiny receive window, then silence: the server's stall timeout must abort them), ~2% send invalid requests.

Checks at the end: every greedy or seeded request that finished equals the same request sent again alone (a
divergence where the top two logprobs are within --tie of each other is a near-tie and reported, not failed);
the server's outcome counters add up to the requests sent; no sequence is running or waiting and every KV block
is free. Reports RSS growth of the server process and latency percentiles. Exit status 1 if a check fails.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from serve import launch_resin, percentile

OUTCOMES = ("success", "aborted", "failed", "rejected")


def make_requests(args: argparse.Namespace) -> list[dict]:
    rng = random.Random(args.seed)
    prefixes = [[rng.randrange(5, args.vocab) for _ in range(rng.choice((16, 48, 100, 200)))] for _ in range(4)]
    reqs = []
    for i in range(args.requests):
        body = {"prompt": rng.choice(prefixes) + [rng.randrange(5, args.vocab) for _ in range(rng.randrange(1, 80))],
                "n": rng.choice((1, 1, 1, 2, 3, 4)), "max_tokens": rng.randrange(4, args.max_tokens + 1),
                "ignore_eos": True, "stream": rng.random() < 0.5}
        kind = rng.choices(("greedy", "seeded", "random"), (5, 4, 1))[0]
        body["temperature"] = 0 if kind == "greedy" else 0.9
        if kind == "seeded":
            body["seed"] = rng.randrange(1 << 30)
        behaviour = rng.choices(("normal", "disconnect", "stall", "invalid"), (83, 10, 5, 2))[0]
        if behaviour in ("disconnect", "stall"):
            body["stream"] = True
        if behaviour == "stall":  # lots of output (4 choices with logprobs) to back up through the socket buffers
            body.update(max_tokens=args.stall_tokens, n=4, logprobs=5)
        if behaviour == "invalid":
            body.update(rng.choice(({"n": 0}, {"temperature": -1}, {"prompt": [1, -3]}, {"max_tokens": 10 ** 9},
                                    {"top_p": 7}, {"logprobs": 99})))
        reqs.append({"id": i, "body": body, "kind": kind, "behaviour": behaviour})
    return reqs


async def send(client: httpx.AsyncClient, url: str, req: dict, rng: random.Random) -> dict:
    body, start = req["body"], time.perf_counter()
    result = {"id": req["id"], "status": None, "choices": None, "ttft": None}
    if not body["stream"]:
        r = await client.post(url + "/v1/completions", json=body)
        result["status"] = r.status_code
        if r.status_code == 200:
            result["choices"] = {c["index"]: c for c in r.json()["choices"]}
        result["e2e"] = time.perf_counter() - start
        return result
    texts: dict[int, list[str]] = {}
    finish: dict[int, str] = {}
    cut_after = rng.randrange(1, 6) if req["behaviour"] == "disconnect" else None
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        result["status"] = r.status_code
        if r.status_code != 200:
            await r.aread()
            return result
        chunks = 0
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                result["error"] = chunk["error"]
                continue
            for c in chunk["choices"]:
                result["ttft"] = result["ttft"] or time.perf_counter() - start
                texts.setdefault(c["index"], []).append(c["text"])
                if c["finish_reason"]:
                    finish[c["index"]] = c["finish_reason"]
            chunks += 1
            if cut_after is not None and chunks >= cut_after:
                result["status"] = "disconnected"
                return result  # leaving the block closes the connection mid-stream
    result["choices"] = {i: {"text": "".join(t), "finish_reason": finish.get(i)} for i, t in texts.items()}
    result["e2e"] = time.perf_counter() - start
    return result


async def stall(host: str, port: int, req: dict, hold: float) -> dict:
    """A client that reads the response headers and a little, then never reads again (with a tiny receive
    window, so the server's writes back up), and hangs up after `hold` seconds."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, port))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    payload = json.dumps(req["body"]).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
    await writer.drain()
    status = (await reader.readline()).split()[1].decode()
    await asyncio.sleep(hold)
    writer.close()
    return {"id": req["id"], "status": "stalled" if status == "200" else int(status), "choices": None}


def server_state(url: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in family.samples:
            out[s.name] = s.value
    return out


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return None


async def soak(args: argparse.Namespace, url: str, reqs: list[dict]) -> list[dict]:
    sem = asyncio.Semaphore(args.concurrency)
    rng = random.Random(args.seed + 1)
    host, port = url.split("//")[1].split(":")
    async with httpx.AsyncClient(timeout=httpx.Timeout(300), limits=httpx.Limits(max_connections=None)) as client:
        async def one(req):
            async with sem:
                if req["behaviour"] == "stall":
                    return await stall(host, int(port), req, args.stall_hold)
                return await send(client, url, req, rng)
        return await asyncio.gather(*(one(r) for r in reqs))


async def replay_alone(url: str, reqs: list[dict]) -> list[dict]:
    """The same requests again, one at a time, not streamed, with logprobs to tell near-ties from bugs."""
    out = []
    async with httpx.AsyncClient(timeout=300) as client:
        for req in reqs:
            body = {**req["body"], "stream": False, "logprobs": 2}
            r = await client.post(url + "/v1/completions", json=body)
            r.raise_for_status()
            out.append({c["index"]: c for c in r.json()["choices"]})
    return out


def compare(req: dict, result: dict, alone: dict, tie: float) -> tuple[str, dict | None]:
    """('equal' | 'near-tie' | 'DIFFERENT', details of the first divergence). A greedy choice that diverges
    where the top two logprobs of the alone run are within `tie` is a near-tie: batch shape changes the last bits
    of the logits. Sampled choices have no such excuse here (a flip needs two tokens tied in probs / noise)."""
    verdict, detail = "equal", None
    for i, c in alone.items():
        got = result["choices"].get(i, {}).get("text") or ""
        if got == c["text"]:
            continue
        common = next((k for k, (a, b) in enumerate(zip(got, c["text"])) if a != b), min(len(got), len(c["text"])))
        lp = c["logprobs"]
        pos = next((k for k, o in enumerate(lp["text_offset"]) if o + len(lp["tokens"][k]) > common), None)
        tops = sorted(lp["top_logprobs"][pos].values(), reverse=True) if pos is not None else []
        gap = tops[0] - tops[1] if len(tops) >= 2 else None
        detail = {"id": req["id"], "kind": req["kind"], "n": req["body"]["n"], "stream": req["body"]["stream"],
                  "choice": i, "token": pos, "top2_gap": gap, "batched": got[common:common + 40],
                  "alone": c["text"][common:common + 40]}
        if req["kind"] == "greedy" and gap is not None and gap < tie:
            verdict = "near-tie"
        else:
            return "DIFFERENT", detail
    return verdict, detail


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    log = open(Path(args.out).with_suffix(".server.log"), "w")
    return launch_resin([*([args.model] if args.model else []), "--kv-cache-memory", args.kv_cache_memory,
                         "--stream-stall-timeout", str(args.stall_timeout), "--max-model-len", str(args.max_model_len),
                         "--max-num-seqs", str(args.max_num_seqs), *args.server_arg], log)


def wait_idle(url: str, timeout: float = 60) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server_state(url)
        if (m["resin:num_requests_running"] == 0 and m["resin:num_requests_waiting"] == 0) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="an already running Resin server (default: start one)")
    ap.add_argument("--model", default=None, help="model for the started server (default: the built-in one)")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens of a normal request")
    ap.add_argument("--vocab", type=int, default=256, help="prompt token ids are drawn below this")
    ap.add_argument("--kv-cache-memory", default="96MiB",
                    help="the started server's KV budget: small, to force preemption (96MiB: ~2k tokens of the "
                         "built-in model in fp32; 2MiB for the tests' tiny model)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="the started server's context length")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--stall-timeout", type=float, default=2.0, help="the started server's --stream-stall-timeout")
    ap.add_argument("--stall-tokens", type=int, default=1500, help="max_tokens of a client that stops reading")
    ap.add_argument("--stall-hold", type=float, default=15.0,
                    help="seconds a stalled client keeps its connection (long enough to fill the socket buffers)")
    ap.add_argument("--server-arg", action="append", default=[], help="extra `resin run` argument (repeatable)")
    ap.add_argument("--tie", type=float, default=1e-3, help="logprob gap below which a divergence is a near-tie")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="bench/results/soak.json")
    args = ap.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    proc, url = (None, args.url) if args.url else start_server(args)
    try:
        report = run(args, url, proc.pid if proc else None)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    if proc is not None:  # the server says when it aborts a client that stopped reading
        log = Path(args.out).with_suffix(".server.log").read_text()
        report["stall_timeout_aborts"] = log.count("has not read for")
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("mismatches", "near_tie_details")}, indent=2))
    print(f"wrote {args.out}")
    return 0 if report["ok"] else 1


def run(args: argparse.Namespace, url: str, pid: int | None) -> dict:
    reqs = make_requests(args)
    before, rss0 = server_state(url), rss_bytes(pid)
    start = time.perf_counter()
    results = asyncio.run(soak(args, url, reqs))
    duration = time.perf_counter() - start
    after = wait_idle(url)
    rss1 = rss_bytes(pid)
    counted = {o: after.get(f"resin:request_{o}_total", 0) - before.get(f"resin:request_{o}_total", 0)
               for o in OUTCOMES}
    checked = [(q, r) for q, r in zip(reqs, results) if q["kind"] != "random" and r["status"] == 200
               and r["choices"] and all(c["finish_reason"] in ("length", "stop") for c in r["choices"].values())]
    compared = [compare(q, r, alone, args.tie) for (q, r), alone in zip(checked, asyncio.run(
        replay_alone(url, [q for q, _ in checked])))]
    verdicts = [v for v, _ in compared]
    final = wait_idle(url)
    behaviours = {b: sum(q["behaviour"] == b for q in reqs) for b in ("normal", "disconnect", "stall", "invalid")}
    statuses: dict[str, int] = {}
    for r in results:
        statuses[str(r["status"])] = statuses.get(str(r["status"]), 0) + 1
    e2e = [r["e2e"] for r in results if r.get("e2e") is not None]
    ttft = [r["ttft"] for r in results if r.get("ttft") is not None]
    report = {
        "requests": len(reqs), "duration_s": round(duration, 2), "behaviours": behaviours, "client_statuses": statuses,
        "server_outcomes": counted, "outcomes_add_up": sum(counted.values()) == len(reqs),
        "server_5xx": sum(1 for r in results if isinstance(r["status"], int) and r["status"] >= 500),
        "compared_alone": len(verdicts), "equal": verdicts.count("equal"), "near_ties": verdicts.count("near-tie"),
        "different": verdicts.count("DIFFERENT"),
        "preemptions": after.get("resin:num_preemptions_total", 0) - before.get("resin:num_preemptions_total", 0),
        "kv_usage_after": final["resin:kv_cache_usage_perc"], "running_after": final["resin:num_requests_running"],
        "waiting_after": final["resin:num_requests_waiting"],
        "rss_growth_mb": None if rss0 is None else round((rss1 - rss0) / 2 ** 20, 1),
        "latency_s": {"e2e_p50": percentile(e2e, 50), "e2e_p99": percentile(e2e, 99),
                      "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99)},
        "mismatches": [d for v, d in compared if v == "DIFFERENT"],
        "near_tie_details": [d for v, d in compared if v == "near-tie"],
    }
    report["ok"] = (report["outcomes_add_up"] and report["server_5xx"] == 0 and report["different"] == 0
                    and report["kv_usage_after"] == 0 and report["running_after"] == 0
                    and report["waiting_after"] == 0 and counted["failed"] == 0)
    return report


if __name__ == "__main__":
    sys.exit(main())
