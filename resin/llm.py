"""The offline API: `LLM(...).generate(prompts, SamplingParams(...))`, shaped like vLLM's."""
from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any, Iterator, Sequence

from tqdm.auto import tqdm

from resin.core.engine import LogitsObserver
from resin.core.outputs import CompletionOutput, RequestOutput
from resin.core.sampling_params import OutputKind, SamplingParams
from resin.engine_builder import EngineArgs, build_engine, shutdown_engine

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, backend: str = "auto", dtype: str | None = None,
                 kv_cache_memory: int | str | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 256, enable_prefix_caching: bool = True, seed: int = 0,
                 logits_observer: LogitsObserver | None = None, **kwargs: Any):
        """kwargs: further EngineArgs (max_num_batched_tokens, block_size, ops, enable_graphs, self_check,
        quantization: auto | none | int8).
        logits_observer sees the logits of every sampled row (the parity gate uses it)."""
        args = EngineArgs(model=model, backend=backend, dtype=dtype, kv_cache_memory=kv_cache_memory,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          enable_prefix_caching=enable_prefix_caching, seed=seed,
                          **kwargs)
        built = build_engine(args, logits_observer=logits_observer)
        self.engine = built.engine
        self.tokenizer = built.tokenizer
        self.selection = built.selection
        self.architecture = built.architecture
        self.dtype = built.dtype
        self.self_check = built.self_check  # what the startup check ran and dropped (None when off)
        self.rank_weight_bytes = built.rank_weight_bytes  # resident weight bytes of each tensor-parallel rank
        self._ids = itertools.count()
        self._shutdown = weakref.finalize(self, shutdown_engine, built)

    def shutdown(self) -> None:
        """Stop the tensor-parallel ranks (also done when the LLM is collected, or at exit)."""
        self._shutdown()

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def _encode(self, prompt: Prompt, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as lists of token ids")
            return prompt, self.tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"]
        return None, [int(t) for t in prompt]

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, _add_special_tokens: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. A prompt that cannot be served (too long, empty, ...) gets an
        output with `error` set and finish_reason "abort"; the other prompts are unaffected."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} SamplingParams")
        results: dict[str, RequestOutput] = {}
        order = []
        final_only: dict[int, SamplingParams] = {}  # only finished outputs are used: no per-step output building
        for prompt, p in zip(prompts, params_list):
            p = final_only.setdefault(id(p), dataclasses.replace(p, output_kind=OutputKind.FINAL_ONLY))
            rid = str(next(self._ids))
            order.append(rid)
            text, ids = self._encode(prompt, _add_special_tokens)
            try:
                self.engine.add_request(rid, ids, p, prompt=text)
            except ValueError as e:
                results[rid] = RequestOutput(rid, text, ids, [CompletionOutput(i, "", [], "abort")
                                                             for i in range(p.n)], finished=True, error=str(e))
        bar = tqdm(total=len(order), desc="generate", disable=not use_tqdm)
        bar.update(len(results))
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    results[out.request_id] = out
                    bar.update(1)
        bar.close()
        return [results[rid] for rid in order]

    def stream(self, prompt: Prompt | list[dict[str, str]], sampling_params: SamplingParams | None = None,
               chat: bool = False) -> Iterator[str]:
        """Generate for one prompt, yielding text as it is produced. A conversation (a list of messages), or a
        string with chat=True (one user message), goes through the chat template."""
        params = dataclasses.replace(sampling_params or SamplingParams(), output_kind=OutputKind.DELTA)
        if isinstance(prompt, str) and chat:
            prompt = [{"role": "user", "content": prompt}]
        if prompt and isinstance(prompt, list) and isinstance(prompt[0], dict):
            prompt, chat = self.apply_chat_template(prompt), True
        text, ids = self._encode(prompt, add_special_tokens=not chat)
        rid = f"stream-{next(self._ids)}"
        self.engine.add_request(rid, ids, params, prompt=text)
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.request_id != rid:
                        continue
                    for c in out.outputs:  # deltas: only the sequences with news, so pick the first one's
                        if c.index == 0 and c.text:
                            yield c.text
        finally:
            self.engine.abort_request(rid)  # no-op once finished; frees blocks if the consumer stopped early

    def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template: use generate() with a plain prompt")
        return self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.apply_chat_template(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, _add_special_tokens=False)
