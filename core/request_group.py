"""RequestGroup: one user request (its n sequences and their detokenisers) and the outputs it reports.

Outputs come in the three kinds of SamplingParams.output_kind: cumulative (everything so far), delta (what is new
since the last output: a stream's consumer never holds more than the request's length), or final only.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from resin.core.detokenizer import IncrementalDetokenizer
from resin.core.outputs import CompletionOutput, RequestOutput
from resin.core.request import Request
from resin.core.sampling_params import OutputKind


@dataclass
class RequestGroup:
    """One user request: its n sequences, their detokenisers, and what DELTA outputs already handed out."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Request]
    detoks: list[IncrementalDetokenizer | None]
    arrival_time: float = field(default_factory=time.monotonic)
    # Sequences 1..n-1, kept out of the scheduler until sequence 0 has computed the prompt (see _fork).
    unforked: list[Request] = field(default_factory=list)
    error: str | None = None  # set when a step failed for this request
    sent_tokens: list[int] = field(init=False)  # output tokens already in DELTA outputs, per sequence
    closed: list[bool] = field(init=False)  # its final DELTA output went out, per sequence
    sent_prompt_logprobs: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self.sent_tokens = [0] * len(self.seqs)
        self.closed = [False] * len(self.seqs)

    def output(self) -> RequestOutput:
        kind = self.seqs[0].params.output_kind
        finished = all(s.finished for s in self.seqs)
        first = self.seqs[0]
        if kind is OutputKind.FINAL_ONLY and not finished:  # nothing to build: the engine does not report it
            return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [], finished=False)
        metrics = {"arrival_time": self.arrival_time, "num_cached_tokens": first.num_cached_tokens}
        if first.first_token_time is not None:
            metrics["first_token_time"] = first.first_token_time
        if kind is OutputKind.DELTA:
            completions = self._delta_completions()
            prompt_logprobs = None if self.sent_prompt_logprobs else first.prompt_logprobs
            self.sent_prompt_logprobs = True
        else:
            completions = [CompletionOutput(
                index=i, text=detok.stable_text(seq.finished) if detok else "", token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=None if seq.logprobs is None else list(seq.logprobs))
                for i, (seq, detok) in enumerate(zip(self.seqs, self.detoks))]
            prompt_logprobs = first.prompt_logprobs
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             prompt_logprobs=prompt_logprobs, finished=finished, error=self.error,
                             metrics=metrics)

    def _delta_completions(self) -> list[CompletionOutput]:
        """What each sequence produced since its last DELTA output; sequences with nothing new are left out."""
        out = []
        for i, (seq, detok) in enumerate(zip(self.seqs, self.detoks)):
            if self.closed[i]:
                continue
            start = seq.num_prompt_tokens + self.sent_tokens[i]
            tokens = seq.token_ids[start:]
            text = detok.take_delta() if detok is not None else ""
            if not tokens and not text and not seq.finished:
                continue
            self.sent_tokens[i] += len(tokens)
            self.closed[i] = seq.finished
            out.append(CompletionOutput(
                index=i, text=text, token_ids=tokens, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                logprobs=None if seq.logprobs is None else seq.logprobs[start - seq.num_prompt_tokens:]))
        return out
