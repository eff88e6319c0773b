"""Which grammar a request asks for, and compiling it off the event loop, in bounded time, before admission.

Compiling first means a schema xgrammar cannot take is a 400 naming the problem before any response starts, and
the engine thread never compiles (the compiled grammar travels on the spec). Compiles run on a small pool of
their own: a schema that takes long cannot hold up tokenising, and one that takes longer than the bound is
refused (its thread still finishes in the background, so the pool size bounds what such requests can cost).
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from resin.core.engine import LLMEngine
from resin.core.structured_output import GrammarError, StructuredOutputsParams
from resin.server.errors import APIError
from resin.server.protocol import _Common

_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def requested_constraint(req: _Common) -> tuple[StructuredOutputsParams, str] | None:
    """The constraint a request's response_format, structured_outputs or guided_* field asks for, with the field's
    name; None when it asks for none. Asking in two places is a 400: which one would win is anyone's guess."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    field = "response_format"  # the one being read, for the error
    try:
        fmt = req.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append((StructuredOutputsParams(json_object=True), "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                               "response_format")
            found.append((StructuredOutputsParams(json=fmt.json_schema.json_schema), "response_format"))
        so = req.structured_outputs
        field = "structured_outputs"
        if so is not None:
            found.append((StructuredOutputsParams(
                json=so.json_, regex=so.regex, choice=so.choice, grammar=so.grammar, json_object=bool(so.json_object),
                any_whitespace=so.disable_any_whitespace is False), "structured_outputs"))
        for name in _GUIDED:
            value, field = getattr(req, name), name
            if value is not None:
                found.append((StructuredOutputsParams(**{name.removeprefix("guided_"): value}), name))
    except GrammarError as e:
        raise APIError(400, str(e), field) from None
    if len(found) > 1:
        raise APIError(400, f"{' and '.join(n for _, n in found)} both constrain the output: give only one",
                       found[1][1])
    return found[0] if found else None


class GrammarCompiles:
    """Compiles on a pool of its own, each within `timeout` seconds."""

    def __init__(self, engine: LLMEngine, timeout: float = 10.0, workers: int = 2):
        self.engine = engine
        self.timeout = timeout
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="resin-grammar")

    async def compile(self, spec: StructuredOutputsParams, param: str) -> None:
        loop = asyncio.get_running_loop()
        started = threading.Event()

        def job() -> None:
            started.set()
            self.engine.grammars.compile(spec)

        try:  # on timeout wait_for cancels the job: one still queued never runs
            await asyncio.wait_for(loop.run_in_executor(self.pool, job), self.timeout)
        except GrammarError as e:
            raise APIError(400, str(e), param) from None
        except TimeoutError:
            if not started.is_set():
                raise APIError(503, f"the grammar compilers stayed busy for {self.timeout:g} s (other requests' "
                                    f"grammars): retry later") from None
            raise APIError(400, f"the {spec.kind} constraint did not compile within {self.timeout:g} s: simplify "
                                f"it (fewer or smaller repetitions, a smaller schema)", param) from None

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
