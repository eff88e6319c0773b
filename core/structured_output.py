"""Structured outputs: a request's grammar (JSON schema, regex, choice, EBNF) as a token mask on every step.

Built on xgrammar: a grammar is compiled once against the tokenizer's vocabulary (cached by its spec, so repeated
schemas cost nothing), each sequence keeps a matcher that advances on every accepted token, and before each draw
the matcher fills a bitmask of the tokens that keep the output inside the grammar; the sampler masks the rest.
The mask allows the model's stop tokens exactly where the grammar may end, so a constrained output ends with a
stop token at the grammar's accept state (the matcher then reports `terminated`).

xgrammar is imported on first use: an engine that never sees a structured request never loads it.
"""
from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

_KINDS = ("json", "regex", "choice", "grammar", "json_object")
# Compiled grammars kept by spec; xgrammar's own cache sits under this one.
_CACHE_ENTRIES = 256
# Compile time grows with a grammar's size (50,000 choices take ~40 s on one core): cheap bounds refuse the
# extreme at once, and the server's compile timeout covers what stays.
MAX_CHOICES, MAX_SPEC_CHARS = 4096, 1 << 18
# xgrammar errors read "[12:00:00] /project/cpp/regex_converter.cc:94: Regex parsing error ...": keep the message.
_XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")


class GrammarError(ValueError):
    """The grammar cannot be used: invalid, unsupported by xgrammar, or xgrammar is missing."""


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint: a JSON schema (dict or JSON text), any JSON object, a regex, one of a list of
    strings, or an EBNF grammar (xgrammar's dialect, GBNF-like). JSON comes out compact (", " and ": " between
    items, no free whitespace) unless any_whitespace: a model at a high temperature could otherwise spend its
    whole budget on newlines, and a grammar only guarantees valid output if the output ends."""
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    any_whitespace: bool = False
    _compiled: Any = field(default=None, init=False, repr=False, compare=False)  # set by GrammarCompiler

    def __post_init__(self) -> None:
        given = [k for k in _KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            raise GrammarError(f"structured outputs take exactly one of {', '.join(_KINDS)}; got "
                               f"{', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise GrammarError("structured outputs: json must be a JSON schema (an object or its JSON text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise GrammarError(f"structured outputs: {name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise GrammarError("structured outputs: choice must be a non-empty list of non-empty strings")
        if self.choice is not None and len(self.choice) > MAX_CHOICES:
            raise GrammarError(f"structured outputs: choice has {len(self.choice)} strings; at most {MAX_CHOICES} "
                               f"(a regex or grammar can say more, more cheaply)")
        value = getattr(self, self.kind)
        try:
            size = (sum(map(len, value)) if self.kind == "choice" else 0 if self.kind == "json_object"
                    else len(value) if isinstance(value, str) else len(json.dumps(value)))
        except (TypeError, ValueError):
            raise GrammarError("structured outputs: json must be a JSON schema made of JSON values") from None
        if size > MAX_SPEC_CHARS:
            raise GrammarError(f"structured outputs: the {self.kind} is {size} characters; at most {MAX_SPEC_CHARS}")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple:
        """What identifies the compiled grammar. A schema's key order is kept: it is the order the properties
        are generated in."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            schema = json.loads(value) if isinstance(value, str) else value
            value = json.dumps(schema, ensure_ascii=False)
        elif self.kind == "choice":
            value = tuple(value)
        return self.kind, value, self.any_whitespace


def choice_grammar(choices: list[str]) -> str:
    """EBNF for exactly one of the strings (JSON string escapes are valid EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles StructuredOutputsParams against one tokenizer; thread-safe (the server compiles in worker
    threads, off the event loop and off the engine step)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        try:
            import xgrammar as xgr
        except ImportError:
            raise GrammarError("structured outputs need xgrammar: pip install xgrammar (the server extra "
                               "includes it)") from None
        if tokenizer is None:
            raise GrammarError("structured outputs need the model's tokenizer, and this model ships none")
        self._xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # xgrammar's own cache is unbounded by default: the bounded one here is the only one.
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[tuple, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> Any:
        """The compiled grammar; raises GrammarError naming the problem. The result is also kept on the spec, so
        a request compiled before it reached the engine is never compiled again on the engine thread."""
        if spec._compiled is not None:
            return spec._compiled
        try:
            key = spec.key()
        except json.JSONDecodeError as e:
            raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        except RecursionError:
            raise GrammarError("the JSON schema is nested too deeply") from None
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        if compiled is None:
            compiled = self._compile(spec, key)
            with self._lock:
                self._cache[key] = compiled
                while len(self._cache) > _CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        spec._compiled = compiled
        return compiled

    def _compile(self, spec: StructuredOutputsParams, key: tuple) -> Any:
        c = self._compiler
        try:
            if spec.kind == "json":
                return c.compile_json_schema(key[1], any_whitespace=spec.any_whitespace, strict_mode=True)
            if spec.kind == "json_object":
                if spec.any_whitespace:
                    return c.compile_builtin_json_grammar()
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if spec.kind == "regex":
                return c.compile_regex(spec.regex)
            if spec.kind == "choice":
                return c.compile_grammar(choice_grammar(spec.choice))
            return c.compile_grammar(spec.grammar)
        except RecursionError:
            raise GrammarError(f"the {spec.kind} constraint is nested too deeply") from None
        except (RuntimeError, ValueError, TypeError) as e:
            what = {"json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex",
                    "choice": "choice", "grammar": "grammar"}[spec.kind]
            message = _XGRAMMAR_PREFIX.sub("", str(e).strip()).splitlines()[0] if str(e).strip() else type(e).__name__
            raise GrammarError(f"the {what} cannot be compiled: {message}") from None

    def matcher(self, compiled: Any) -> "Grammar":
        return Grammar(self._xgr.GrammarMatcher(compiled))


class Grammar:
    """One sequence's position in its grammar."""
    __slots__ = ("matcher",)

    def __init__(self, matcher: Any):
        self.matcher = matcher

    def accept(self, token: int) -> None:
        """Advance by one sampled token. The sampler only draws allowed tokens, so a refusal is a bug (or a
        mask that could not be honoured): the request fails rather than leave its grammar."""
        if not self.matcher.accept_token(token):
            raise RuntimeError(f"token {token} does not fit the request's grammar")

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


@dataclass
class GrammarMask:
    """The allowed tokens of the batch's constrained rows, as xgrammar's packed bitmask (one bit per token)."""
    bitmask: torch.Tensor  # (len(rows), ceil(vocab / 32)) int32, on the logits' device
    rows: list[int]  # the batch rows it applies to (bitmask row i belongs to logits row i)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits with every token outside each row's grammar at -inf (a new tensor)."""
        import xgrammar as xgr

        out = logits.clone()
        xgr.apply_token_bitmask_inplace(out, self.bitmask, indices=self.rows)
        return out


def grammar_mask(grammars: list[Grammar | None], vocab_size: int, device: torch.device) -> GrammarMask | None:
    """The bitmask of every row that has a grammar, or None when no row has one."""
    rows = [i for i, g in enumerate(grammars) if g is not None]
    if not rows:
        return None
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(grammars), vocab_size)
    for i in rows:
        grammars[i].matcher.fill_next_token_bitmask(bitmask, i)
    return GrammarMask(bitmask.to(device, non_blocking=True), rows)
