"""From user-facing arguments to a running LLMEngine: backend selection, dtype, model, tokenizer, KV budget."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from resin.core.config import EngineConfig, default_kv_cache_bytes, parse_bytes
from resin.core.engine import LLMEngine, LogitsObserver
from resin.core.cache_layout import plan_cache_layout
from resin.core.provider_check import SelfCheckReport
from resin.core.self_check import SelfCheckError, run_self_check
from resin.core.model_runner import ModelRunner
from resin.core.step_channel import StepChannel
from resin.hal import Selection, move_to_huge_pages, parallel, select_backend
from resin.parallel import Workers, broadcast_ints, exchange_ints, leave_group, start
from resin.models.quantized import describe_weights
from resin.models.loader import LoadedModel, load_model
from resin.tokenizer import eos_token_ids, load_tokenizer

log = logging.getLogger("resin")

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}


def resolve_dtype(dtype: str | torch.dtype | None, selection: Selection) -> torch.dtype:
    """'auto' (or None): bf16 where matmuls run natively in it (GPUs; CPUs with AVX512-BF16 or AMX), else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        platform = selection.platform
        if platform.has_native_bf16_matmul():
            if platform.kind == "cpu":
                isa = ", ".join(sorted({"avx512_bf16", "amx_bf16"} & platform.cpu_flags))
                log.info("dtype auto: bfloat16 (this CPU has native bf16 matmul: %s)", isa)
            return torch.bfloat16
        log.info("dtype auto: float32 (no native bf16 matmul on this CPU)")
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def builtin_model(quantization: str) -> tuple[Path, Path]:
    """(the built-in model's folder: config, tokenizer; where to read its weights): its own GGUF file, kept packed,
    unless the dense path is asked for (the folder's safetensors, dequantised once when the model was fetched)."""
    from resin.builtin import ensure_builtin_model

    status = ensure_builtin_model()
    return status.path, status.gguf if quantization == "auto" else status.path


def free_memory(selection: Selection) -> int:
    """Free memory on the engine's device now (after the weights are loaded)."""
    if selection.platform.kind == "cpu":
        from resin.hal.platform import cpu_platform

        return cpu_platform().memory_free
    return torch.cuda.mem_get_info()[0]


@dataclass
class EngineArgs:
    model: str | Path | None = None
    backend: str = "auto"
    dtype: str | torch.dtype | None = None
    kv_cache_memory: int | str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    enable_prefix_caching: bool = True
    seed: int = 0
    ops: str | dict[str, str] | None = None
    enable_graphs: bool = True  # capture decode graphs where the platform has them (GPUs); --no-graphs
    self_check: str = "on"  # every chosen provider against native before serving: on (drop failures), strict, off
    quantization: str = "auto"  # auto (GGUF stays packed), none (dequantise GGUF on load), int8 (see QUANTIZATION)
    tensor_parallel_size: int = 1  # ranks the model is split over (resin/parallel.py)
    enable_expert_parallel: bool = False  # with tensor_parallel_size > 1: whole MoE experts per rank
    serving: bool = False  # an online server (resin run): a shorter default CPU step, first tokens sooner


@dataclass
class BuiltEngine:
    engine: LLMEngine
    selection: Selection
    tokenizer: Any
    architecture: str
    model_path: Path
    dtype: torch.dtype
    self_check: SelfCheckReport | None = None
    workers: Workers | None = None  # the tensor-parallel ranks this process spawned
    rank_weight_bytes: list[int] = field(default_factory=list)  # resident weight bytes of each rank


@dataclass
class CheckedModel:
    """A loaded model on a selected backend whose providers passed (or were dropped by) the self-check."""
    selection: Selection
    dtype: torch.dtype
    path: Path
    loaded: LoadedModel
    check: SelfCheckReport | None


# Tokens one CPU step may hold. The linear layers' GEMMs run best on ~2048 rows (their operands stay in cache): 32
# prompts of 256 tokens prefill in 1.32 s at 2048 or 4096 a step against 1.76 s at 8192 (built-in model, bf16,
# 2-core Xeon), and a step that long stalls every running sequence's next token. vLLM-CPU's server default too.
CPU_BATCHED_TOKENS = 2048
# The server's: half that. Served side by side (bench/serve_sweep.py, vLLM's client, 256-token prompts arriving in a
# burst, fp32, 2-core Zen 3), 1024 against 2048 cut the median time to first token by ~30% at 16 concurrent
# clients and ~20% at 64, and the p99 inter-token gap at 64 from ~3.5 s to ~1.9 s, with output tok/s within the
# runs' noise (+-5%). The price: at 16 the burst's first streams wait behind more (shorter) prefill steps, and more
# than 1% of their gaps are one such step, so the p99 gap there went from ~0.5 s to ~1.7 s. 512 halves the median
# TTFT but prefills a lone 4k prompt 11% slower (1024: 1.5%).
CPU_SERVING_BATCHED_TOKENS = 1024


def default_batched_tokens(max_model_len: int, platform_kind: str, serving: bool = False) -> int:
    """--max-num-batched-tokens when not given: on a GPU up to 8192 (a long prompt in few steps), on a CPU 2048
    (1024 in the server)."""
    if platform_kind == "cpu":
        return CPU_SERVING_BATCHED_TOKENS if serving else CPU_BATCHED_TOKENS
    return max(2048, min(max_model_len, 8192))


def packing_for(quantization: str, selection: Selection) -> str:
    """Packed weights only where a kernel runs them: the native quant_linear unpacks every weight on every call
    (for a large lm_head, gigabytes a step), so without a provider GGUF weights are dequantised on load."""
    if quantization == "none" or selection.table["quant_linear"].chosen != "native":
        return quantization
    if quantization == "int8":
        reasons = "; ".join(why for _, why in selection.table["quant_linear"].skipped) or "none registered"
        raise ValueError(f"--quantization int8 needs a quant_linear kernel and backend {selection.backend.name} has "
                         f"none ({reasons}): drop --quantization int8")
    log.info("GGUF weights are dequantised on load: backend %s has no quant_linear kernel (the native op would "
             "unpack every weight on every call)", selection.backend.name)
    return "none"


def load_checked(args: EngineArgs) -> CheckedModel:
    """Select the backend, load the model, and check every provider it will call against native."""
    selection = select_backend(args.backend, args.ops)
    dtype = resolve_dtype(args.dtype, selection)
    quantization = packing_for(args.quantization, selection)
    if args.model is not None:
        path = weights = Path(args.model).expanduser()
    else:
        path, weights = builtin_model(quantization)
    loaded = load_model(weights, dtype, selection.platform.device, selection.platform.fp8_dtype, quantization)
    move_to_huge_pages(loaded.model)  # CPU weights: a TLB miss per 2 MiB streamed, not per 4 KiB (hal/memory.py)
    check = run_self_check(loaded.model, dtype, selection.platform.device, args.block_size, args.self_check)
    for failed in check.failed if check else []:
        selection.drop(failed.op, failed.provider, f"failed the self-check on {failed.call} "
                                                   f"({failed.version}): {failed.error}")
    return CheckedModel(selection, dtype, path, loaded, check)


def weight_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def validate_parallel(args: EngineArgs) -> None:
    if args.tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size={args.tensor_parallel_size}: give 1 or more ranks")
    if args.enable_expert_parallel and args.tensor_parallel_size == 1:
        raise ValueError("--enable-expert-parallel places experts on tensor-parallel ranks: give "
                         "--tensor-parallel-size 2 or more")


def build_worker_runner(args: EngineArgs) -> ModelRunner:
    """A rank other than 0: the same load and self-check as rank 0, in lockstep (the self-check's forward runs
    the model's collectives), then the runner rank 0's plan sizes."""
    checked = load_checked(args)
    model, dtype = checked.loaded.model, checked.dtype
    exchange_ints([weight_bytes(model), free_memory(checked.selection)])
    num_blocks, max_model_len, max_num_seqs, graph_batch, check_graphs = broadcast_ints(None, 5)
    layout = plan_cache_layout(model.attention_layers, args.block_size, dtype)
    runner = ModelRunner(model, layout, num_blocks, max_num_seqs, max_model_len, dtype,
                         checked.selection.platform.device, graph_batch)
    if check_graphs and runner.graphs is not None:
        runner.graphs_match_eager()  # rank 0 decides from its own replay; this rank's runs the collectives with it
    return runner


def shutdown_engine(built: BuiltEngine) -> None:
    """Stop the other tensor-parallel ranks and leave the process group (nothing to do with one rank)."""
    if parallel().world == 1:
        return
    if built.workers is not None:
        built.workers.expect_exit()
    try:
        built.engine.close()
        leave_group(together=True)
    finally:
        if built.workers is not None:
            built.workers.close()


def build_engine(args: EngineArgs, logits_observer: LogitsObserver | None = None) -> BuiltEngine:
    validate_parallel(args)
    workers = start(args) if args.tensor_parallel_size > 1 else None
    try:
        built = _build_engine(args, logits_observer, workers)
    except BaseException as e:
        # a ValueError is rank 0's own verdict on the arguments; anything else may be a peer that vanished
        deaths = workers.deaths_within(2.0) if workers is not None and not isinstance(e, ValueError) else []
        if workers is not None:
            workers.close(timeout=0)
        if parallel().world > 1:
            leave_group()
        if deaths:
            raise RuntimeError("; ".join(deaths)) from e
        raise
    if workers is not None:
        workers.started = True
    return built


def _build_engine(args: EngineArgs, logits_observer: LogitsObserver | None, workers: Workers | None) -> BuiltEngine:
    checked = load_checked(args)
    selection, dtype, path, loaded, check = (checked.selection, checked.dtype, checked.path, checked.loaded,
                                             checked.check)
    tokenizer = load_tokenizer(path, loaded.gguf_file if args.model is not None else None)
    gen_config_file = path / "generation_config.json" if path.is_dir() else None
    gen_config = json.loads(gen_config_file.read_text()) if gen_config_file and gen_config_file.exists() else {}

    model_max = int(loaded.hf_config.get("max_position_embeddings", 4096))
    max_model_len = args.max_model_len or model_max
    if max_model_len > model_max:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's max_position_embeddings={model_max}")
    rank_facts = [[weight_bytes(loaded.model), free_memory(selection)]]
    group = parallel()
    if group.world > 1:
        rank_facts = exchange_ints(rank_facts[0])
    free = min(f[1] for f in rank_facts)
    if group.world > 1 and selection.platform.kind == "cpu":
        free //= group.world  # the ranks of one machine share its memory
    budget = (parse_bytes(args.kv_cache_memory) if args.kv_cache_memory is not None
              else default_kv_cache_bytes(free, on_gpu=selection.platform.kind != "cpu"))
    layout = plan_cache_layout(loaded.model.attention_layers, args.block_size, dtype)
    recurrent = getattr(loaded.model, "recurrent_layers", [])
    state_per_seq = sum(layer.bytes_per_sequence(dtype) for layer in recurrent)
    state_bytes = (args.max_num_seqs + 1) * state_per_seq  # a slot per running sequence and a scratch slot
    if state_bytes and state_bytes >= budget:
        raise ValueError(f"kv_cache_memory ({budget} bytes) does not even hold the recurrent state of "
                         f"max_num_seqs={args.max_num_seqs} sequences ({state_bytes} bytes, {state_per_seq} each): "
                         f"raise kv_cache_memory or lower max_num_seqs")
    budget -= state_bytes
    num_blocks = budget // layout.page_bytes - 1  # one more page, the null page, is allocated beside the pool
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory={args.kv_cache_memory} holds no block ({layout.page_bytes} bytes each, "
                         f"2 at least): raise it")
    max_batched = args.max_num_batched_tokens or default_batched_tokens(max_model_len, selection.platform.kind,
                                                                         args.serving)
    capacity = layout.capacity_tokens(num_blocks, max_batched, max(max_model_len, num_blocks * args.block_size))
    if max_model_len > capacity:
        if args.max_model_len is not None:
            raise ValueError(f"max_model_len={max_model_len} needs {max_model_len} tokens of KV cache but "
                             f"kv_cache_memory holds {capacity}: raise kv_cache_memory or lower max_model_len")
        log.warning("the KV cache holds %d tokens, fewer than the model's %d: max_model_len set to %d",
                    capacity, max_model_len, capacity)
        max_model_len = capacity
    graphs = args.enable_graphs and selection.platform.supports_graphs
    graph_batch = min(args.max_num_seqs, EngineConfig.max_graph_batch) if graphs else 0
    channel = None
    if group.world > 1:
        broadcast_ints([num_blocks, max_model_len, args.max_num_seqs, graph_batch, int(check is not None)], 5)
        channel = StepChannel(group.cpu_group, group.rank, group.host_exchange)
    config = EngineConfig(
        max_model_len=max_model_len, block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max_batched,
        enable_prefix_caching=args.enable_prefix_caching, seed=args.seed,
        graphs=graphs)
    engine = LLMEngine(loaded.model, config, vocab_size=loaded.model.config.vocab_size, dtype=dtype,
                       device=selection.platform.device, num_blocks=num_blocks, tokenizer=tokenizer,
                       eos_token_ids=eos_token_ids(tokenizer, loaded.hf_config, gen_config),
                       logits_observer=logits_observer, channel=channel)
    log.info("backend %s on %s (%s), dtype %s; KV cache: %d pages x %d tokens (%.1f MiB) hold %d tokens of one "
             "sequence", selection.backend.name, selection.platform.device_name, selection.platform.arch,
             str(dtype).removeprefix("torch."), num_blocks, args.block_size,
             (num_blocks + 1) * layout.page_bytes / (1 << 20), engine.capacity_tokens)
    log.info("weights: %s", describe_weights(loaded.model))
    if group.world > 1:
        log.info("tensor parallel over %d ranks%s: weights per rank %s MiB", group.world,
                 " (experts placed whole)" if group.expert_parallel else "",
                 ", ".join(f"{f[0] / (1 << 20):.1f}" for f in rank_facts))
    for line in layout.describe(loaded.model.attention_layers, dtype):
        log.info("KV cache, %s", line)
    if recurrent:
        log.info("recurrent state: %d layers, %d bytes per sequence, %d slots (%.1f MiB)", len(recurrent),
                 state_per_seq, args.max_num_seqs + 1, state_bytes / (1 << 20))
    if check is not None and engine.runner.graphs is not None:
        mismatch = engine.runner.graphs_match_eager()
        if mismatch:
            if args.self_check == "strict":
                raise SelfCheckError(f"decode graphs: {mismatch}; refusing to start (--self-check strict)")
            log.warning("decode graphs off: %s", mismatch)
            engine.runner.graphs = None
    return BuiltEngine(engine, selection, tokenizer, loaded.architecture, path, dtype, check, workers,
                       [f[0] for f in rank_facts])
