"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

A request with n > 1 fans out into n sequences that share the prompt (the prefix cache makes that cheap);
outputs are reported per request with one CompletionOutput per sequence.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from resin.core.config import EngineConfig
from resin.core.detokenizer import IncrementalDetokenizer
from resin.core.kv_cache_manager import KVCacheManager
from resin.core.model_runner import CausalLM, ModelRunner
from resin.core.outputs import CompletionOutput, RequestOutput
from resin.core.request import Request
from resin.core.sampler import Sampler
from resin.core.sampling_params import SamplingParams
from resin.core.scheduler import Scheduler
from resin.core.step_outputs import logprobs_dict, prompt_logprobs_chunk

log = logging.getLogger("resin")
# Called with (sequences, logits) each step for the rows about to be sampled: the parity gate's window.
LogitsObserver = Callable[[list[Request], torch.Tensor], None]


@dataclass
class StepStats:
    """What the last step did, for metrics and step logs."""
    num_seqs: int = 0
    num_tokens: int = 0
    num_sampled: int = 0
    num_preempted: int = 0


@dataclass
class _Group:
    """One user request: its n sequences and their detokenisers."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    arrival_time: float = field(default_factory=time.monotonic)


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, tokenizer: Any = None,
                 eos_token_ids: frozenset[int] = frozenset(), logits_observer: LogitsObserver | None = None):
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.device = device
        self.kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.max_num_seqs,
                                  config.max_model_len, dtype, device,
                                  graph_batch=min(config.max_num_seqs, config.max_graph_batch) if config.graphs else 0)
        self.sampler = Sampler(vocab_size, torch.Generator(device=device).manual_seed(config.seed))
        self.logits_observer = logits_observer
        self.groups: dict[str, _Group] = {}
        self.capacity_tokens = num_blocks * config.block_size
        if config.max_model_len > self.capacity_tokens:  # else one long request could never finish
            raise ValueError(f"max_model_len={config.max_model_len} does not fit the KV cache ({self.capacity_tokens} "
                             f"tokens): raise kv_cache_memory or lower max_model_len")
        self.last_step = StepStats()
        self.num_aborted = 0

    # ---- requests -------------------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= self.config.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but max_model_len is {self.config.max_model_len}: "
                             f"shorten the prompt or raise max_model_len (the model allows its "
                             f"max_position_embeddings)")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Validate without side effects; returns the effective max_tokens (clipped to the context left)."""
        self.validate_prompt(prompt_token_ids)
        room = self.config.max_model_len - len(prompt_token_ids)
        return min(params.max_tokens or room, room)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        """Queue a request. Raises ValueError (naming the problem) without touching other requests."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.check_request(prompt_token_ids, params)
        seqs, detoks = [], []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Request(f"{request_id}#{i}", prompt_token_ids, params, max_tokens, self.eos_token_ids,
                          prompt, seed=seed, parent_id=request_id, index=i)
            if i > 0:
                seq.prompt_logprobs = None  # computed once, for the first sequence
            if seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(seed)
            seqs.append(seq)
            detoks.append(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                 params.stop_strings) if self.tokenizer is not None else None)
        self.groups[request_id] = _Group(request_id, prompt, list(prompt_token_ids), seqs, detoks)
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks are freed at once."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        self.num_aborted += 1
        for seq in group.seqs:
            if not seq.finished:
                seq.finish("abort")
                self._release(seq)
        return self._output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def abort_all(self) -> list[RequestOutput]:
        return [out for rid in list(self.groups) if (out := self.abort_request(rid)) is not None]

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self.runner.release(seq)
        self.last_step = StepStats(len(batch.requests), batch.total_tokens, 0, len(batch.preempted))
        if not batch.requests:
            return []
        out = self.runner.execute(batch)
        for seq, n in zip(batch.requests, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.kv.cache_full_blocks(seq)  # before any finish frees them, so later requests can reuse them
        for seq, start, logits in out.prompt_chunks:
            seq.prompt_logprobs.extend(prompt_logprobs_chunk(
                logits, seq.prompt_token_ids[start + 1:start + 1 + logits.shape[0]],
                seq.params.prompt_logprobs, self._decoder()))
        touched: dict[str, _Group] = {}
        if out.sample_requests:
            if self.logits_observer is not None:
                self.logits_observer(out.sample_requests, out.sample_logits)
            sampled = self.sampler(out.sample_logits, out.sample_requests)
            self.last_step.num_sampled = len(sampled.token_ids)
            now = time.monotonic()
            for seq, token, lp in zip(out.sample_requests, sampled.token_ids, sampled.logprobs):
                if seq.first_token_time is None:
                    seq.first_token_time = now
                self._append(seq, token, lp)
                touched[seq.parent_id] = self.groups[seq.parent_id]
        outputs = []
        for group in touched.values():
            output = self._output(group)
            if output.finished:
                del self.groups[group.request_id]
            outputs.append(output)
        return outputs

    def _decoder(self) -> Callable[[int], str] | None:
        if self.tokenizer is None:
            return None
        return lambda t: self.tokenizer.decode([t], skip_special_tokens=False)

    def _append(self, seq: Request, token: int, lp: tuple | None) -> None:
        seq.token_ids.append(token)
        if lp is not None:
            seq.logprobs.append(logprobs_dict(token, lp, self._decoder()))
        detok = self.groups[seq.parent_id].detoks[seq.index]
        params = seq.params
        stop_str = detok.add(token, seq.num_output_tokens >= params.min_tokens) if detok is not None else None
        if stop_str is not None:
            seq.finish("stop", stop_str)
        elif not params.ignore_eos and token in seq.eos_token_ids:
            seq.finish("stop", token)
        elif token in params.stop_token_ids and seq.num_output_tokens >= params.min_tokens:
            seq.finish("stop", token)
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            seq.finish("length")
        if seq.finished:
            self._release(seq)

    def _release(self, seq: Request) -> None:
        self.scheduler.finish(seq)
        self.runner.release(seq)

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for i, (seq, detok) in enumerate(zip(group.seqs, group.detoks)):
            completions.append(CompletionOutput(
                index=i, text=detok.stable_text(seq.finished) if detok else "", token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, logprobs=seq.logprobs))
        first = group.seqs[0]
        metrics = {"arrival_time": group.arrival_time, "num_cached_tokens": first.num_cached_tokens}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, completions,
                             prompt_logprobs=first.prompt_logprobs,
                             finished=all(s.finished for s in group.seqs), metrics=metrics)

    # ---- facts ----------------------------------------------------------------------------------------------
    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_stats(self):
        return self.kv.pool.stats
