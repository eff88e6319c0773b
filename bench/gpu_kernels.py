"""GPU kernel evidence, in one run: paged decode attention bandwidth against a measured copy bandwidth, fused MoE
against the unfused torch loop, and the decode step time of a SmolLM2-135M-shaped model with and without graphs, for
each attention provider this machine has.

    python bench/gpu_kernels.py --out bench/results/gpu-kernels.json      # on a GPU (bench/gpu_check.sh runs it)
    TRITON_INTERPRET=1 python bench/gpu_kernels.py --smoke                 # the script's logic on the cpu, tiny

Targets (DESIGN.md): paged decode attention >= 70% of measured HBM bandwidth; fused MoE >= 2x the unfused loop;
decode step at small batch close to weight bytes / bandwidth, graphs removing launch gaps. Times are medians of
CUDA-event-timed repetitions (triton.testing.do_bench) after warm-up. Absolute numbers mean something only on a
GPU; --smoke only proves the script runs.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from timers import median_seconds


def bench(fn, device: torch.device, reps: int) -> float:
    """Median seconds per call."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=max(reps, 50), return_mode="median") / 1e3
    return median_seconds(fn, reps)


def copy_bandwidth(device: torch.device, nbytes: int, reps: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src), device, reps)  # read + write


def attention_bandwidth(device: torch.device, batch: int, ctx: int, heads: int, kv_heads: int, head: int,
                        reps: int) -> dict:
    from resin import hal

    bs, dtype = 16, torch.bfloat16
    blocks_per_seq = -(-ctx // bs)
    num_blocks = batch * blocks_per_seq
    layer = hal.AttentionLayer(heads, kv_heads, head, head ** -0.5)
    tables = torch.randperm(num_blocks, device=device).view(batch, blocks_per_seq).to(torch.int32)
    pos = torch.full((batch,), ctx - 1, device=device)
    slots = tables[:, -1].long() * bs + pos % bs
    meta = hal.AttentionMetadata(
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        seq_lens=torch.full((batch,), ctx, dtype=torch.int32, device=device), block_tables=tables,
        slot_mapping=slots, max_query_len=1, max_seq_len=ctx,
        query_start_loc_host=torch.arange(batch + 1, dtype=torch.int32))
    attn = hal.ATTENTION([layer], bs, dtype, device)
    cache = torch.randn(attn.kv_cache_shape(num_blocks, bs, kv_heads, head), device=device, dtype=dtype)
    q = torch.randn(batch, heads * head, device=device, dtype=dtype)
    k, v = (torch.randn(batch, kv_heads * head, device=device, dtype=dtype) for _ in range(2))
    attn.plan(meta)
    seconds = bench(lambda: attn.forward(0, q, k, v, cache), device, reps)
    kv_bytes = 2 * batch * ctx * kv_heads * head * 2
    return {"provider": type(attn).__name__, "batch": batch, "context": ctx, "heads": heads, "kv_heads": kv_heads,
            "head_size": head, "us": seconds * 1e6, "GBps": kv_bytes / seconds / 1e9,
            "splits": getattr(attn, "num_splits", None)}


def moe_speedup(device: torch.device, tokens: int, hidden: int, inter: int, experts: int, top_k: int,
                reps: int) -> dict:
    from resin import hal

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=device) * hidden ** -0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=device) * inter ** -0.5).to(dtype)
    w, ids = hal.MOE_ROUTE.native(torch.randn(tokens, experts, device=device), top_k)
    fused = bench(lambda: hal.FUSED_MOE(x, w13, w2, w, ids), device, reps)
    loop = bench(lambda: hal.FUSED_MOE.native(x, w13, w2, w, ids), device, reps)
    return {"tokens": tokens, "hidden": hidden, "inter": inter, "experts": experts, "top_k": top_k,
            "fused_us": fused * 1e6, "loop_us": loop * 1e6, "speedup": loop / fused}


def decode_steps(model_dir: Path, batch: int, graphs: bool, steps: int, backend: str, attention: str) -> dict:
    from resin import LLM, SamplingParams

    llm = LLM(str(model_dir), backend=backend, kv_cache_memory="2GiB", max_num_seqs=max(batch, 1),
              enable_graphs=graphs, ops=f"attention={attention}")
    engine = llm.engine
    for i in range(batch):
        engine.add_request(f"d{i}", [100 + (i * 13 + j) % 4000 for j in range(32)],
                           SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True))
    engine.step()  # prefill
    engine.step()
    if llm.selection.platform.kind != "cpu":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()  # sampling reads tokens back to the host, so each step is synchronous
    elapsed = time.perf_counter() - start
    captured = engine.runner.graphs
    return {"attention": attention, "batch": batch, "graphs": graphs, "ms_per_step": elapsed / steps * 1e3,
            "graph_replays": captured.replays if captured is not None else 0,
            # captured decode steps run the first graph-safe attention provider (the Triton kernel behind aiter's)
            "graph_attention": type(captured.attns[0]).__name__ if captured is not None else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/gpu-kernels.json", help="JSON results file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device is here (script check)")
    p.add_argument("--model", default=None, help="model folder for the decode-step timing (default: a random "
                                                 "SmolLM2-135M-shaped model, built once in the results folder)")
    p.add_argument("--reps", type=int, default=100)
    args = p.parse_args()

    from resin import hal
    from resin.tiny import save_tiny_model

    sel = hal.select_backend("auto")
    device = sel.platform.device
    results: dict = {"device": sel.platform.device_name, "arch": sel.platform.arch, "backend": sel.backend.name,
                     "table": {name: c.chosen for name, c in sel.table.items()}}
    reps = 3 if args.smoke else args.reps
    results["copy_GBps"] = copy_bandwidth(device, (1 << 20) if args.smoke else (2 << 30), reps) / 1e9
    shapes = [(4, 64, 8, 2, 32)] if args.smoke else [
        (b, c, 32, 8, 128) for b, c in ((1, 4096), (8, 4096), (32, 2048), (64, 4096), (256, 1024))]
    results["attention"] = [attention_bandwidth(device, *s, reps=reps) for s in shapes]
    for r in results["attention"]:
        r["fraction_of_copy"] = r["GBps"] / results["copy_GBps"]
    moe_shapes = [(16, 64, 32, 4, 2)] if args.smoke else [(256, 2048, 1408, 60, 4), (2048, 4096, 1792, 8, 2)]
    results["moe"] = [moe_speedup(device, *s, reps=max(3, reps // 10)) for s in moe_shapes]

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if args.model else out.parent / ("tiny-llama" if args.smoke else "smollm2-135m-random")
    if not args.model and not (model_dir / "config.json").exists():
        shape = dict(head_dim=16) if args.smoke else dict(  # SmolLM2-135M's config, random weights
            hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, head_dim=64, vocab_size=49152, max_position_embeddings=8192,
            tie_word_embeddings=True)
        save_tiny_model(model_dir, "LlamaForCausalLM", seed=0, **shape)
    batches = [1, 4] if args.smoke else [1, 8, 32, 64]
    steps = 3 if args.smoke else 50
    # every attention provider this machine has (graphs on and off each); --smoke: the first only
    providers = [p.name for p in sel.table["attention"].chain if p.name != "native"] or ["native"]
    results["decode"] = [decode_steps(model_dir, b, g, steps, sel.backend.name, a)
                         for a in providers[:1 if args.smoke else None] for b in batches for g in (False, True)]
    hal.select_backend("auto")  # the LLMs above re-selected; leave the table as it was
    out.write_text(json.dumps(results, indent=2))
    print(format_table(results))
    print(f"\nwrote {out}")


def format_table(r: dict) -> str:
    lines = [f"{r['device']} ({r['arch']}), backend {r['backend']}; copy bandwidth {r['copy_GBps']:.0f} GB/s", "",
             "paged decode attention (bf16, block 16)      provider          us      GB/s   of copy"]
    for a in r["attention"]:
        lines.append(f"  B={a['batch']:<4} ctx={a['context']:<5} H={a['heads']}/{a['kv_heads']} D={a['head_size']:<4}"
                     f"          {a['provider']:<16} {a['us']:8.1f} {a['GBps']:8.0f}  {a['fraction_of_copy']:6.0%}")
    lines += ["", "fused MoE vs unfused torch loop                 fused us    loop us   speedup"]
    for m in r["moe"]:
        lines.append(f"  T={m['tokens']:<5} H={m['hidden']:<5} I={m['inter']:<5} E={m['experts']:<3} k={m['top_k']}"
                     f"        {m['fused_us']:9.1f} {m['loop_us']:10.1f} {m['speedup']:8.1f}x")
    lines += ["", "decode step (SmolLM2-135M shape)   attention      graphs   ms/step   replays  (attention in graphs)"]
    for d in r["decode"]:
        lines.append(f"  batch {d['batch']:<4}                     {d['attention']:<14} "
                     f"{'on ' if d['graphs'] else 'off'}"
                     f"    {d['ms_per_step']:7.2f}   {d['graph_replays']:<7}  {d['graph_attention'] or '-'}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
