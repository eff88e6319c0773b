"""The `resin` command line: generate, chat, backends, models, parity."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from resin import hal
from resin.hal.platform import OPTIONAL_LIBRARIES

log = logging.getLogger("resin")


def _engine_flags(p: argparse.ArgumentParser, with_model: bool = True) -> None:
    if with_model:
        p.add_argument("--model", default=None, help="a Hugging Face model folder or .gguf file (default: the "
                                                     "built-in SmolLM2-135M-Instruct, fetched once into the cache)")
    p.add_argument("--backend", default="auto", choices=["auto", *hal.BACKENDS])
    p.add_argument("--dtype", default="auto", help="auto (fp32 on cpu, bf16 on GPUs), float32, bfloat16, float16")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache budget, e.g. 2GiB (default: on cpu a quarter "
                                                          "of free RAM, at most 1 GiB; on GPUs 85%% of free memory)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--ops", default=None, help="provider overrides, e.g. attention=native (also RESIN_OPS)")
    p.add_argument("--no-graphs", action="store_true",
                   help="run decode steps eagerly instead of replaying captured CUDA/HIP graphs (GPU backends)")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8"],
                   help="auto: GGUF weights stay packed (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) and run on quant_linear; "
                        "none: dequantise GGUF weights on load to --dtype; int8: weight-only int8 (per output row) "
                        "for a safetensors model")
    p.add_argument("--self-check", default="on", choices=["on", "strict", "off"],
                   help="before serving, run every chosen provider against the native op on the model's shapes: "
                        "on drops a provider that disagrees (logged), strict refuses to start, off skips")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="split the model over N ranks (one process each; on GPUs one device each). Several "
                        "machines: start the same command with torchrun on each (docs/distributed.md)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tensor-parallel-size: place whole MoE experts on ranks instead of splitting each")


def _sampling_flags(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument("--max-tokens", type=int, default=max_tokens)
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def exit_now(code: int = 0) -> None:
    from resin.parallel import exit_now as leave

    leave(code)


def _worker_rank(engine_args) -> bool:
    """Under torchrun, every process runs the same command: a rank other than 0 serves steps here and returns
    True once rank 0 stops it."""
    from resin.parallel import launched_by_torchrun, run_worker, start

    if not launched_by_torchrun() or int(os.environ["RANK"]) == 0:
        return False
    start(engine_args)
    run_worker(engine_args)
    return True


def _llm(args: argparse.Namespace):
    from resin.engine_builder import EngineArgs
    from resin.llm import LLM

    kwargs = dict(backend=args.backend, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                  max_model_len=args.max_model_len, ops=args.ops, enable_graphs=not args.no_graphs,
                  self_check=args.self_check, quantization=args.quantization,
                  tensor_parallel_size=args.tensor_parallel_size, enable_expert_parallel=args.enable_expert_parallel)
    if _worker_rank(EngineArgs(model=args.model, **kwargs)):
        exit_now()
    return LLM(args.model, **kwargs)


def _params(args: argparse.Namespace, **extra):
    from resin.core.sampling_params import SamplingParams

    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                          top_k=args.top_k, seed=args.seed, **extra)


def cmd_generate(args: argparse.Namespace) -> int:
    params = _params(args, ignore_eos=args.ignore_eos)
    llm = _llm(args)
    try:
        for piece in llm.stream(args.prompt, params, chat=args.chat):
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        llm.shutdown()  # tensor parallelism: leave the process group before the interpreter exits
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = _params(args)
    llm = _llm(args)
    try:
        return _chat(args, llm, params)
    finally:
        llm.shutdown()


def _chat(args: argparse.Namespace, llm, params) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        print("Chatting with the model. /reset starts over, /exit (or Ctrl-D) quits.", file=sys.stderr)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    base = list(history)
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = list(base)
            continue
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        reply = []
        if interactive:
            sys.stdout.write("assistant> ")
        for piece in llm.stream(history, params):
            reply.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_run(args: argparse.Namespace) -> int:
    try:
        from resin.server.run import ServeArgs, serve
    except ImportError as e:
        raise ValueError(f"the server needs its extra: pip install 'resin[server]' ({e})") from None
    from resin.engine_builder import EngineArgs

    engine_args = EngineArgs(model=args.model, backend=args.backend, dtype=args.dtype,
                             kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
                             max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                             enable_graphs=not args.no_graphs, self_check=args.self_check,
                             enable_prefix_caching=not args.no_prefix_caching, ops=args.ops, seed=args.seed,
                             quantization=args.quantization, tensor_parallel_size=args.tensor_parallel_size,
                             enable_expert_parallel=args.enable_expert_parallel, serving=True)
    if _worker_rank(engine_args):
        exit_now()
    if args.api_key is not None and not args.api_key.strip():
        # An empty key would silently leave the server open: someone meant to protect it.
        raise ValueError("the API key is empty (--api-key or $RESIN_API_KEY): set a real key, or unset it to serve "
                         "without one")
    if args.metrics_require_api_key and args.api_key is None:
        raise ValueError("--metrics-require-api-key needs an API key (--api-key or $RESIN_API_KEY)")
    return serve(engine_args, ServeArgs(host=args.host, port=args.port, api_key=args.api_key,
                                        served_model_name=args.served_model_name, max_waiting=args.max_waiting,
                                        max_n=args.max_n, stall_timeout=args.stream_stall_timeout,
                                        max_request_bytes=args.max_request_bytes,
                                        metrics_need_key=args.metrics_require_api_key,
                                        shutdown_timeout=args.shutdown_timeout,
                                        tool_call_parser=args.tool_call_parser,
                                        grammar_compile_timeout=args.grammar_compile_timeout))


def cmd_backends(args: argparse.Namespace) -> int:
    libraries = None
    if args.libraries is not None:
        libraries = frozenset(x.strip() for x in args.libraries.split(",") if x.strip())
        unknown = sorted(libraries - set(OPTIONAL_LIBRARIES))
        if unknown:
            raise SystemExit(f"--libraries: unknown {unknown}; known: {', '.join(OPTIONAL_LIBRARIES)}")
    report = None
    if args.model is not None:
        if args.arch is not None or libraries is not None:
            raise ValueError("--model runs the self-check on this machine's hardware: drop --arch / --libraries")
        from resin.engine_builder import EngineArgs, load_checked

        checked = load_checked(EngineArgs(model=None if args.model == "builtin" else args.model,
                                          backend=args.backend, dtype=args.dtype, ops=args.ops,
                                          quantization=args.quantization))
        sel, report = checked.selection, checked.check
    else:
        sel = hal.describe_backend(args.backend, arch=args.arch, ops=args.ops, libraries=libraries)
    for key, value in sel.platform.describe():
        print(f"{key:>14}: {value}")
    print(f"{'backend':>14}: {sel.backend.name} ({sel.backend.note})\n")
    print(sel.format_table())
    if report is not None:
        print("\n" + report.summary())
        for check in report.checks:
            print(f"  {check.describe()}")
    else:
        print("\n(each chosen provider is checked against native at startup on the loaded model's shapes; "
              "--model M, or --model builtin, runs that check now)")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from resin.models_report import supported_models

    rows = supported_models()
    width, type_width = max(len(r[0]) for r in rows), max(len("model_type"), *(len(r[1]) for r in rows))
    print(f"{'architecture':<{width}}  {'model_type':<{type_width}}  ops")
    for arch, model_type, ops in rows:
        print(f"{arch:<{width}}  {model_type:<{type_width}}  {', '.join(ops)}")
    return 0


def cmd_parity(args: argparse.Namespace) -> int:
    from resin.parity import run_parity

    prompts = None
    if args.prompts:
        prompts = [line for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    card = run_parity(args.model_or_arch, backend=args.backend, dtype=args.dtype, prompts=prompts,
                      decode_steps=args.steps)
    print(card.format())
    return 0 if card.passed else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resin", description="Resin: LLM inference on any chip.")
    parser.add_argument("-q", "--quiet", action="store_true", help="only warnings and errors on stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("run", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve MODEL (default: the built-in model) over HTTP: /v1/completions, "
                                   "/v1/chat/completions, /v1/models, /health, /version, /metrics.")
    p.add_argument("model", nargs="?", default=None, help="a Hugging Face model folder or .gguf file")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("RESIN_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 routes (default: $RESIN_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget per engine step (default: 1024 on a CPU, up to 8192 on a GPU)")
    p.add_argument("--max-waiting", type=int, default=1024,
                   help="sequences (n x prompts) queued past which requests get 429")
    p.add_argument("--max-n", type=int, default=128, help="most choices (n) one request may ask for (OpenAI's limit)")
    p.add_argument("--max-request-bytes", type=int, default=16 << 20,
                   help="larger request bodies get 413 (JSON is parsed on the event loop: ~40 ms per MiB)")
    p.add_argument("--stream-stall-timeout", type=float, default=30.0,
                   help="abort a stream whose client has not read for this many seconds while output waits")
    p.add_argument("--metrics-require-api-key", action="store_true",
                   help="/metrics needs the API key too (default: open, as Prometheus scrapers expect)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "mistral", "llama3_json", "none"],
                   help="how the model writes tool calls, for tool_choice 'auto' (default: read from the chat "
                        "template; 'none' refuses tool_choice 'auto')")
    p.add_argument("--grammar-compile-timeout", type=float, default=10.0,
                   help="structured outputs: a grammar that takes longer to compile is refused with 400")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted")
    _engine_flags(p, with_model=False)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("generate", help="generate text for a prompt, streamed to stdout",
                       description="Generate text for PROMPT and stream it to stdout as it is produced.")
    p.add_argument("prompt")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence tokens")
    _engine_flags(p)
    _sampling_flags(p, max_tokens=256)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="an interactive chat in the terminal",
                       description="Chat with the model; the conversation is kept until /reset. Reads stdin.")
    p.add_argument("--system", default=None, help="a system message")
    _engine_flags(p)
    _sampling_flags(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("backends", help="platform facts and the op -> provider table",
                       description="Print the platform facts and which provider each HAL op would use, and why "
                                   "the providers before it were skipped. Works for absent hardware too.")
    p.add_argument("--backend", default="auto", choices=["auto", *hal.BACKENDS])
    p.add_argument("--arch", default=None, help="describe this architecture (e.g. gfx942, gfx950, sm_90, sm_100)")
    p.add_argument("--libraries", default=None,
                   help="describe as if exactly these kernel libraries were installed (comma list of "
                        f"{', '.join(OPTIONAL_LIBRARIES)}; '' for none). Default: those importable here")
    p.add_argument("--ops", default=None, help="provider overrides, e.g. attention=native")
    p.add_argument("--model", default=None, help="also run the startup self-check of every chosen provider "
                                                 "against native on this model's shapes ('builtin' for the "
                                                 "built-in model) and show what passed and what was dropped")
    p.add_argument("--dtype", default="auto", help="with --model: the dtype to check in")
    p.add_argument("--quantization", default="auto", choices=["auto", "none", "int8"],
                   help="with --model: how its weights are held (as for resin run)")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("models", help="supported architectures and the HAL ops each uses",
                       description="List supported architectures; the ops column is traced from a forward pass "
                                   "of a tiny random model of each.")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("parity", help="the porting gate: Resin vs transformers logits and greedy tokens",
                       description="Run Resin and transformers on the same weights and prompts and print a "
                                   "scorecard. MODEL_OR_ARCH is a model folder / .gguf, or an architecture name "
                                   "(a random tiny model of it is built). fp32 gate: max |logit diff| <= 1e-3 at "
                                   "prefill and each decode step and identical greedy tokens; bf16/fp16 gate: "
                                   "top-1 agreement >= 95%. Exit code 0 only on pass.")
    p.add_argument("model_or_arch")
    p.add_argument("--backend", default="auto", choices=["auto", *hal.BACKENDS])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", default=None, help="a file with one prompt per line (token ids separated by "
                                                   "spaces for models without a tokenizer)")
    p.add_argument("--steps", type=int, default=16, help="greedy decode steps per prompt")
    p.set_defaults(func=cmd_parity)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="resin: %(message)s",
                        stream=sys.stderr)
    for noisy in ("transformers", "httpx", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        code = args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        code = 130
    if getattr(args, "tensor_parallel_size", 1) > 1 or _under_torchrun():
        # A process that joined a process group ends without the interpreter's teardown: gloo's threads, destroyed
        # there, abort it now and then ("terminate called without an active exception", exit -6) even after the
        # group was left; seen in 1 of 4 two-node launches on a 2-core Xeon
        exit_now(code)
    return code


def _under_torchrun() -> bool:
    from resin.parallel import launched_by_torchrun

    return launched_by_torchrun()


if __name__ == "__main__":
    sys.exit(main())
