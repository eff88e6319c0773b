"""SamplingParams: per-request generation settings, validated on construction."""
from __future__ import annotations

import enum
import math
import numbers
from dataclasses import dataclass, field

from resin.core.structured_output import StructuredOutputsParams

# Temperatures below this sample greedily. Dividing by a tiny temperature overflows fp32 logits (1e-40 turns every
# logit into +-inf and the softmax into NaN), and already at 1e-5 a logit gap of 1e-3 is a probability ratio of
# e^-100: the draw is the argmax except between near-exact ties, so greedy is what such a request means.
GREEDY_TEMPERATURE = 1e-5
# Stop conditions are checked for every token of every sequence on the engine thread: their number and length are
# bounded (generously: OpenAI allows 4 stop strings) so that one request cannot make every step slow.
MAX_STOP_STRINGS, MAX_STOP_LENGTH, MAX_STOP_TOKEN_IDS = 32, 256, 1024
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # what torch.Generator.manual_seed takes
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


class OutputKind(enum.Enum):
    """What each RequestOutput of a request carries. DELTA and FINAL_ONLY keep every output O(new tokens), so a
    consumer that falls behind holds O(length), not a fresh copy of the whole text per step."""
    CUMULATIVE = "cumulative"  # everything so far, every step (simple; O(length) per step)
    DELTA = "delta"  # only what is new since the last output (streaming)
    FINAL_ONLY = "final_only"  # one output, when the request finishes


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    temperature: float = 1.0  # 0 (or anything below GREEDY_TEMPERATURE) means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (the chosen token is always included)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: OutputKind = OutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # a grammar every output must follow
    _stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.stop is None:
            self._stop_list = []
        elif isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def _validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            value = repr(getattr(self, name))
            value = value if len(value) <= 80 else value[:60] + f"... ({len(value)} characters)"  # echoed to clients
            return ValueError(f"SamplingParams.{name}={value} is invalid: {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an integer >= 1 (or None for up to the context length)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        for name in _FLOAT_FIELDS:  # first: inf passes the open-ended range checks below (temperature >= 0, ...)
            value = getattr(self, name)
            if not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, not inf or NaN (its default is "
                                f"{self.__dataclass_fields__[name].default})")
        if not 0.0 <= self.temperature:
            raise bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be an integer >= 1, or 0 / -1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be > 0 (1 disables it)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1] - (self.n - 1):
            raise bad("seed", f"must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}] (each of the n sequences uses "
                              f"seed + its index)")
        if len(self._stop_list) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in self._stop_list
                                                          if isinstance(s, str)):
            raise bad("stop", f"allows at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"allows at most {MAX_STOP_TOKEN_IDS} ids")
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative token ids")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams (json, regex, choice, grammar or "
                                            "json_object)")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise bad(name, "must be an integer >= 0 (the number of top alternatives) or None")
