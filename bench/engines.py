"""One engine, one measurement, in its own process (run by compare.py; also usable by hand).

    python bench/engines.py --engine resin --dtype bfloat16 --mode batch --concurrency 32 --prompts p.json
    python bench/engines.py --engine hf --dtype float32 --mode single --prompts p.json
    python bench/engines.py --engine resin-gguf --dtype bfloat16 --mode single --prompts p.json  # packed Q4_1
    python bench/engines.py --engine resin-tp2 --dtype bfloat16 --mode batch --prompts p.json  # 2 ranks, gloo

Modes: `batch` submits the first --concurrency prompts at once and reports output tokens/s over the whole
generation (prefill included); `single` runs the first prompt alone, the same method for every engine (vLLM's
offline API does not stream): prefill tokens/s = its length / time(1 token) on the prompt's first sight, then
batch-1 decode tokens/s = (N - 1) / (time(N tokens) - time(1 token)), N = --output-len, both times with the prompt
in the engine's prefix cache, so a second prefill's run-to-run noise (half a second at 8k tokens) does not land in
the decode rate. With --no-prefix-caching (or an engine without one) every run prefills and time(1 token) is the
fastest of three. Prints one line `RESULT {json}` with the generated tokens, so compare.py can check agreement
between engines.
"""
from __future__ import annotations

import argparse
import json
import os
import time


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run_resin(args, prompts, gguf: bool = False, tensor_parallel: int = 1):
    """gguf: the built-in model's own GGUF with its weights kept packed (Q4_1 layers, a Q8_0 embedding);
    otherwise the dense safetensors folder (weights dequantised once, run in --dtype). tensor_parallel: ranks
    (processes) the model is split over, the machine's cores shared between them."""
    import atexit

    from resin import LLM, SamplingParams

    model = None if gguf else args.model_dir  # None: the built-in model, read from its GGUF
    llm = LLM(model, dtype=args.dtype, kv_cache_memory="1GiB", max_num_seqs=256,
              quantization="auto" if gguf else "none", max_model_len=args.max_model_len,
              enable_prefix_caching=not args.no_prefix_caching, tensor_parallel_size=tensor_parallel)
    atexit.register(llm.shutdown)

    def gen(ps, n):
        outs = llm.generate(ps, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    return gen


def run_hf(args, prompts):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=dtype).eval()
    pad = model.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else (pad or 0)

    def gen(ps, n):
        width = max(len(p) for p in ps)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])  # left padding, as generate wants
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=pad)
        return out[:, width:].tolist()
    return gen


def run_llamacpp(args, prompts):
    from llama_cpp import Llama

    llm = Llama(model_path=args.gguf, n_ctx=args.max_model_len or 2048, n_threads=args.threads, n_batch=512,
                verbose=False)

    def gen(ps, n):  # the Python binding generates one sequence at a time
        outs = []
        for p in ps:
            llm.reset()
            tokens = []
            for tok in llm.generate(p, temp=0.0, top_k=1, reset=True):
                tokens.append(tok)
                if len(tokens) == n:
                    break
            outs.append(tokens)
        return outs
    return gen


def vllm_cpu_env(cpus: int, kv_cache_gib: int = 1) -> dict[str, str]:
    """vLLM-CPU configured as its docs advise: OpenMP threads bound to every core (its default binding leaves one
    core to the front end, on 2 cores half the machine) and an explicit KV cache space in GiB."""
    return {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cpus - 1}", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}


def run_vllm(args, prompts):
    for key, value in vllm_cpu_env(args.threads).items():
        os.environ.setdefault(key, value)  # an explicit setting by the caller wins
    # THP_MEM_ALLOC_ENABLE (torch's allocator on huge pages) is not in vLLM's docs; recorded where a caller sets it
    args.peer_config = {key: os.environ[key] for key in (*vllm_cpu_env(args.threads), "THP_MEM_ALLOC_ENABLE")
                        if key in os.environ}
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=args.model_dir, dtype=args.dtype, max_model_len=args.max_model_len or 2048, enforce_eager=False,
              enable_prefix_caching=not args.no_prefix_caching)

    def gen(ps, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return gen


RUNNERS = {"resin": run_resin, "resin-gguf": lambda args, prompts: run_resin(args, prompts, gguf=True),
           "resin-tp2": lambda args, prompts: run_resin(args, prompts, tensor_parallel=2),
           "hf": run_hf, "llamacpp": run_llamacpp, "vllm": run_vllm}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=sorted(RUNNERS), required=True)
    ap.add_argument("--dtype", default="bfloat16", help="float32 or bfloat16 (llama.cpp runs its GGUF's q4)")
    ap.add_argument("--mode", choices=["batch", "single"], default="batch")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists (compare.py writes it)")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-model-len", type=int, default=None, help="longest prompt + output (engine default)")
    ap.add_argument("--no-prefix-caching", action="store_true", help="every run prefills its whole prompt")
    args = ap.parse_args()
    with open(args.prompts) as f:
        prompts = json.load(f)
    gen = RUNNERS[args.engine](args, prompts)
    # warm-up (lazy init, first-call compilation, a full prefill chunk's shapes): up to 2048 tokens, as prompts may
    # be 8k long, and reversed, so that no block of the measured prompt is in a prefix cache before its first run
    gen([prompts[0][:2048][::-1]], 2)
    if args.mode == "batch":
        batch = prompts[:args.concurrency]
        start = time.perf_counter()
        tokens = gen(batch, args.output_len)
        seconds = time.perf_counter() - start
        n_out = sum(len(t) for t in tokens)
        result = {"seconds": seconds, "output_tokens": n_out, "output_tok_s": n_out / seconds,
                  "per_user_tok_s": n_out / seconds / len(batch), "tokens": tokens}
    else:
        p = prompts[:1]
        first = _timed(lambda: gen(p, 1))
        one = min(first, *(_timed(lambda: gen(p, 1)) for _ in range(2)))
        full = _timed(lambda: gen(p, args.output_len))
        result = {"seconds": full, "decode_tok_s": (args.output_len - 1) / max(full - one, 1e-9),
                  "prompt_len": len(p[0]), "prefill_tok_s": len(p[0]) / first}
    result.update(engine=args.engine, dtype=args.dtype, mode=args.mode, concurrency=args.concurrency,
                  threads=args.threads, peer_config=getattr(args, "peer_config", {}))
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
