"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out.

A request with n > 1 fans out into n sequences: the first computes the prompt, the others fork from it once
it has and find its full blocks in the prefix cache (with prefix caching off, each recomputes the prompt; a model
with recurrent state copies its parent's state and blocks instead).
Outputs are reported per request with one CompletionOutput per sequence, cumulative, as deltas, or only at the
end (SamplingParams.output_kind).
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from resin.core.cache_layout import plan_cache_layout
from resin.core.config import EngineConfig
from resin.core.detokenizer import IncrementalDetokenizer
from resin.core.kv_cache_manager import KVCacheManager
from resin.core.contained import execute_contained, sample_contained
from resin.core.model_runner import CausalLM, ModelRunner, RunnerOutput
from resin.core.outputs import RequestOutput
from resin.core.request import Request
from resin.core.request_group import RequestGroup
from resin.core.sampler import Sampler
from resin.core.sampling_params import SamplingParams
from resin.core.scheduler import Scheduler
from resin.core.step_channel import Command, StepChannel
from resin.core.step_outputs import logprobs_dict, prompt_logprobs_chunk
from resin.core.structured_output import GrammarCompiler

log = logging.getLogger("resin")
# Called with (sequences, logits) each step for the rows about to be sampled: the parity gate's window.
LogitsObserver = Callable[[list[Request], torch.Tensor], None]
# Prompt logprobs turn hidden states into full-vocabulary logits this many rows at a time (bounded memory).
_PROMPT_LOGITS_ROWS = 256


@dataclass
class StepStats:
    """What the last step did, for metrics and step logs."""
    num_seqs: int = 0
    num_tokens: int = 0
    num_sampled: int = 0
    num_preempted: int = 0


class LLMEngine:
    def __init__(self, model: CausalLM, config: EngineConfig, vocab_size: int, dtype: torch.dtype,
                 device: torch.device, num_blocks: int, tokenizer: Any = None,
                 eos_token_ids: frozenset[int] = frozenset(), logits_observer: LogitsObserver | None = None,
                 channel: StepChannel | None = None):
        """channel: tensor parallelism's rank 0 sends each step to the other ranks through it."""
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = vocab_size
        self.device = device
        self.layout = plan_cache_layout(model.attention_layers, config.block_size, dtype)
        chunk = config.max_num_batched_tokens
        if self.layout.pages_for(config.max_model_len, chunk) > num_blocks:  # else a long request never finishes
            fits = self.layout.capacity_tokens(num_blocks, chunk, config.max_model_len)
            raise ValueError(f"max_model_len={config.max_model_len} does not fit the KV cache ({num_blocks} blocks hold "
                             f"{fits} tokens of one sequence): raise kv_cache_memory or lower max_model_len")
        self.capacity_tokens = self.layout.capacity_tokens(num_blocks, chunk, max(config.max_model_len,
                                                                                  num_blocks * config.block_size))
        recurrent = getattr(model, "recurrent_layers", [])
        caching = config.enable_prefix_caching
        if recurrent and caching:
            # A cached block holds KV, not the recurrent state after it; rebuilding that state needs the whole prefix
            # anyway. (Snapshots of the state at block boundaries would make hits possible: not built yet.)
            log.info("prefix caching off: %d of the model's layers keep a recurrent state per sequence, which cached "
                     "KV blocks cannot restore", len(recurrent))
            caching = False
        self.kv = KVCacheManager(num_blocks, config.block_size, caching, self.layout.groups,
                                 num_state_slots=config.max_num_seqs if recurrent else 0)
        self.scheduler = Scheduler(self.kv, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.layout, num_blocks, config.max_num_seqs, config.max_model_len, dtype,
                                  device,
                                  channel=channel,
                                  graph_batch=min(config.max_num_seqs, config.max_graph_batch) if config.graphs else 0)
        self.sampler = Sampler(vocab_size, torch.Generator(device=device).manual_seed(config.seed))
        self.logits_observer = logits_observer
        self.groups: dict[str, RequestGroup] = {}
        self.last_step = StepStats()
        self.num_aborted = 0
        self._num_unforked = 0
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler, made on first use (it loads xgrammar and indexes the vocabulary);
        thread-safe, since the server compiles requests' grammars in worker threads before they reach the engine."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
            return self._grammars

    # ---- requests -------------------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= self.config.max_model_len:
            raise ValueError(f"the prompt has {n} tokens but max_model_len is {self.config.max_model_len}: "
                             f"shorten the prompt or raise max_model_len (the model allows its "
                             f"max_position_embeddings)")
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt token id(s) {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """Validate without side effects; returns the effective max_tokens (clipped to the context left)."""
        self.validate_prompt(prompt_token_ids)
        limit = min(self.config.max_logprobs, self.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > limit:
                raise ValueError(f"SamplingParams.{name}={value} is invalid: at most {limit} alternatives per "
                                 f"position (max_logprobs={self.config.max_logprobs}, vocabulary "
                                 f"{self.vocab_size}); ask for fewer")
        room = self.config.max_model_len - len(prompt_token_ids)
        return min(params.max_tokens or room, room)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> None:
        """Queue a request. Raises ValueError (naming the problem) without touching other requests."""
        if request_id in self.groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.check_request(prompt_token_ids, params)
        spec = params.structured_outputs
        compiled = self.grammars.compile(spec) if spec is not None else None  # a no-op if compiled before
        seqs, detoks = [], []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            seq = Request(f"{request_id}#{i}", prompt_token_ids, params, max_tokens, self.eos_token_ids,
                          prompt, seed=seed, parent_id=request_id, index=i)
            if i > 0:
                seq.prompt_logprobs = None  # computed once, for the first sequence
            if seed is not None:
                seq.generator = torch.Generator(device=self.device).manual_seed(seed)
            if compiled is not None:
                seq.grammar = self.grammars.matcher(compiled)
            seqs.append(seq)
            detoks.append(IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                                 params.stop_strings) if self.tokenizer is not None else None)
        group = RequestGroup(request_id, prompt, list(prompt_token_ids), seqs, detoks, unforked=seqs[1:])
        self.groups[request_id] = group
        self._num_unforked += len(group.unforked)
        self.scheduler.add(seqs[0])

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now; its KV blocks are freed at once."""
        group = self.groups.pop(request_id, None)
        if group is None:
            return None
        self.num_aborted += 1
        self._end(group, "abort")
        return group.output()

    def _end(self, group: RequestGroup, reason: str) -> None:
        self._num_unforked -= len(group.unforked)
        group.unforked = []
        for seq in group.seqs:
            if not seq.finished:
                seq.finish(reason)
                self._release(seq, group)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def abort_all(self) -> list[RequestOutput]:
        return [out for rid in list(self.groups) if (out := self.abort_request(rid)) is not None]

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to run, n > 1 siblings not forked yet included (admission counts sequences)."""
        return len(self.scheduler.waiting) + self._num_unforked

    # ---- stepping -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One scheduled forward, sampling and bookkeeping. A failure in the runner, the sampler or one
        sequence's detokeniser ends only the requests it touched, with an error; the engine's state advances
        only after a sequence's stages succeeded, so every other request continues exactly as it would have."""
        batch = self.scheduler.schedule()
        for seq in batch.preempted:
            self.runner.release(seq)
        self.last_step = StepStats(len(batch.requests), batch.total_tokens, 0, len(batch.preempted))
        if not batch.requests:
            return []
        failed: dict[str, str] = {}  # group id -> error
        out = execute_contained(self.runner, batch, failed)
        recompute = {id(seq) for seq in out.recompute}
        for seq in out.recompute:  # back to the queue to compute again from the start, as if preempted
            self.scheduler.preempt(seq)
            self.runner.release(seq)
        rows, row_of = self._sample_rows(out, failed)
        sampled = []
        if rows:
            logits = out.sample_logits
            if row_of != list(range(logits.shape[0])):  # failed rows left out, or siblings drawing from a row
                logits = logits[torch.tensor(row_of, device=logits.device)]
            if self.logits_observer is not None:
                self.logits_observer(rows, logits)
            sampled = sample_contained(self.sampler, logits, rows, failed)
        for seq, n in zip(batch.requests, batch.num_new_tokens):
            if seq.parent_id not in failed and id(seq) not in recompute:
                seq.num_computed_tokens += n
                self.kv.cache_full_blocks(seq)  # before any finish frees them, so later requests can reuse them
        for seq, start, hidden in out.prompt_chunks:
            if seq.parent_id not in failed:
                self._guard(seq, failed, self._add_prompt_logprobs, seq, start, hidden)
        touched: dict[str, RequestGroup] = {}
        now = time.monotonic()
        for seq, (token, lp) in zip(rows, sampled):
            if seq.parent_id in failed:
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            if self._guard(seq, failed, self._append, seq, token, lp):
                touched[seq.parent_id] = self.groups[seq.parent_id]
                self.last_step.num_sampled += 1
        for group in touched.values():
            if group.unforked and group.request_id not in failed and group.seqs[0].num_output_tokens:
                self._fork(group)
        outputs = []
        for rid, error in failed.items():
            outputs.append(self._fail(self.groups[rid], error))
        for group in touched.values():
            if group.request_id in failed:
                continue
            output = group.output()
            if output.finished:
                del self.groups[group.request_id]
            if output.outputs or output.finished:
                outputs.append(output)
        return outputs

    def _guard(self, seq: Request, failed: dict[str, str], fn: Callable, *args: Any) -> bool:
        """Run one sequence's stage; an exception fails that sequence's request alone."""
        try:
            fn(*args)
            return True
        except Exception as e:  # noqa: BLE001 - contained: this request ends with the error, the rest go on
            log.exception("request %s failed in %s", seq.parent_id, getattr(fn, "__name__", fn))
            failed.setdefault(seq.parent_id, f"{type(e).__name__}: {e}")
            return False

    def _sample_rows(self, out: RunnerOutput, failed: dict[str, str]) -> tuple[list[Request], list[int]]:
        """The sequences to sample and the logits row of each: the runner's rows, plus the n - 1 siblings of a
        request whose prompt just finished, which draw their first token from sequence 0's row."""
        rows, row_of = [], []
        for i, seq in enumerate(out.sample_requests):
            if seq.parent_id in failed:
                continue
            rows.append(seq)
            row_of.append(i)
            group = self.groups[seq.parent_id]
            if seq.index == 0 and seq.num_output_tokens == 0 and group.unforked:
                rows.extend(group.unforked)
                row_of.extend([i] * len(group.unforked))
        return rows, row_of

    def _add_prompt_logprobs(self, seq: Request, start: int, hidden: torch.Tensor) -> None:
        """Prompt logprobs from hidden states, a chunk of rows at a time: full-vocabulary logits for a whole
        prefill chunk (max_num_batched_tokens x vocab in fp32) would be gigabytes."""
        for i in range(0, hidden.shape[0], _PROMPT_LOGITS_ROWS):
            logits = self.runner.compute_logits(hidden[i:i + _PROMPT_LOGITS_ROWS])
            first = start + 1 + i
            seq.prompt_logprobs.extend(prompt_logprobs_chunk(
                logits, seq.prompt_token_ids[first:first + logits.shape[0]], seq.params.prompt_logprobs,
                self._decoder()))

    def _fork(self, group: RequestGroup) -> None:
        """Sequence 0 has computed the prompt and every sibling drew its first token from the same logits: the
        siblings now join the queue ahead of new requests. With prefix caching they find the prompt's full blocks
        in the cache (only the last partial block is computed again). A model with recurrent state has no prefix
        caching; its siblings are forked here instead: the prompt's full blocks shared, the partial block and the
        state copied, so none recomputes the prompt. Without a free block or slot a sibling recomputes it."""
        self._num_unforked -= len(group.unforked)
        parent = group.seqs[0]
        siblings = [seq for seq in group.unforked if not seq.finished]
        if self.kv.has_state and not self.kv.enable_prefix_caching and parent.block_ids:
            for seq in siblings:  # in order, so the forked ones queue ahead of any that must recompute
                forked = self.kv.fork(parent, seq)
                if forked is not None:
                    pages, slot = forked
                    self.runner.copy_for_fork(pages, parent.state_slot, slot)
        for seq in reversed(siblings):
            self.scheduler.add_front(seq)
        group.unforked = []

    def _fail(self, group: RequestGroup, error: str) -> RequestOutput:
        group.error = error
        self._end(group, "abort")
        del self.groups[group.request_id]
        return group.output()

    def _decoder(self) -> Callable[[int], str] | None:
        if self.tokenizer is None:
            return None
        return lambda t: self.tokenizer.decode([t], skip_special_tokens=False)

    def _append(self, seq: Request, token: int, lp: tuple | None) -> None:
        """Everything that can fail runs before the token is recorded, so a failure leaves the sequence as it was.
        A stop token (eos, stop_token_ids) ends the sequence without adding its text, as in vLLM."""
        params = seq.params
        logprobs = logprobs_dict(token, lp, self._decoder()) if lp is not None else None
        detok = self.groups[seq.parent_id].detoks[seq.index]
        counts = seq.num_output_tokens + 1 >= params.min_tokens
        stop_token = ((not params.ignore_eos and token in seq.eos_token_ids)
                      or (token in params.stop_token_ids and counts))
        stop_str = detok.add(token, counts) if detok is not None and not stop_token else None
        if seq.grammar is not None:  # last: a matcher cannot take a token back
            seq.grammar.accept(token)
        seq.token_ids.append(token)
        if logprobs is not None:
            seq.logprobs.append(logprobs)
        if stop_str is not None:
            seq.finish("stop", stop_str)
        elif stop_token:
            seq.finish("stop", token)
        elif seq.grammar is not None and seq.grammar.terminated:  # a stop token ended the grammar (ignore_eos)
            seq.finish("stop", token)
        elif seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.config.max_model_len:
            seq.finish("length")
        if seq.finished:
            self._release(seq, self.groups[seq.parent_id])

    def _release(self, seq: Request, group: RequestGroup) -> None:
        self.scheduler.finish(seq)
        self.runner.release(seq)
        if group.detoks[seq.index] is not None:
            group.detoks[seq.index].finish()

    def close(self) -> None:
        """Tensor parallelism: tell the other ranks to leave (they exit once they read it)."""
        if self.runner.channel is not None:
            self.runner.channel.send(Command.STOP)
            self.runner.channel = None

    # ---- facts ----------------------------------------------------------------------------------------------
    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def prefix_cache_stats(self):
        return self.kv.pool.stats
