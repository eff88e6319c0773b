"""Request: one sequence being generated, with its scheduling and cache state."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from resin.core.outputs import PositionLogprobs
from resin.core.sampling_params import SamplingParams
from resin.core.structured_output import Grammar


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # params.max_tokens clipped to the context left after the prompt
    eos_token_ids: frozenset[int] = frozenset()
    prompt: str | None = None
    seed: int | None = None
    parent_id: str = ""  # the user request this sequence belongs to (n > 1 fans out)
    index: int = 0  # which of the n sequences
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    token_ids: list[int] = field(init=False)  # prompt then outputs
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at admission
    block_ids: list[list[int]] = field(default_factory=list)  # per cache group (core/kv_cache_manager.py)
    num_indexed_blocks: int = 0  # leading full blocks already in the prefix-cache index
    state_slot: int | None = None  # its recurrent-state slot while running (models with recurrent layers)
    block_hashes: list[bytes] = field(default_factory=list)  # chained sha256 keys of the full blocks
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_preemptions: int = 0
    prefix_query: tuple[int, int] = (0, 0)  # (blocks looked up, blocks hit) at the last admission attempt
    first_token_time: float | None = None
    generator: torch.Generator | None = field(default=None, repr=False)  # set by the engine for seeded requests
    grammar: Grammar | None = field(default=None, repr=False)  # set by the engine for structured outputs

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []
        if self.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt positions still lack logprobs. Counted by the list, not by computed tokens: a preempted
        request recomputes its prompt but must not report those positions twice."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason
