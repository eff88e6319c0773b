"""A step's stages with failures contained: what fails takes down only the requests it belongs to.

A failed forward over a batch is retried one sequence at a time (each rewrites its own KV slots with the same
values). A recurrent state is updated in place, so a sequence that continued one cannot be retried (the failed
forward may already have advanced it): it computes again from the start, as after preemption. A failed batch
draw is redone row by row from the generator states it started with, so greedy and seeded rows get exactly what
a clean step would have given them (unseeded rows draw fresh noise: equally valid).
`failed` collects request id -> error.

A fault of the device itself (a CUDA/HIP error that poisons the context) is not contained: every later step would
fail the same way, so it is raised, the engine thread dies, and the server exits for its supervisor to restart it.
Under tensor parallelism a failed forward is raised too: the ranks may have failed at different points of the step,
and a retry would pair one rank's collectives with another's.
"""
from __future__ import annotations

import logging

import torch

from resin.core.model_runner import ModelRunner, RunnerOutput
from resin.core.request import Request
from resin.core.sampler import Sampler
from resin.core.scheduler import ScheduledBatch

log = logging.getLogger("resin")


def device_healthy(device: torch.device) -> bool:
    """Can the device still run a kernel and synchronise? After a sticky device error, nothing can."""
    try:
        torch.ones(1, device=device).add_(1).sum().item()
        return True
    except Exception:  # noqa: BLE001 - any failure here means the device is gone
        return False


def execute_contained(runner: ModelRunner, batch: ScheduledBatch, failed: dict[str, str]) -> RunnerOutput:
    """The forward; if it fails, each sequence runs alone (its KV slots are rewritten with the same values)
    so that only the sequences that fail on their own are lost. Sequences continuing a recurrent state come back
    in `recompute` instead."""
    try:
        return runner.execute(batch)
    except Exception as e:  # noqa: BLE001
        if runner.channel is not None or not device_healthy(runner.device):
            raise  # tensor parallelism: the other ranks may have stopped elsewhere in the step; no retry in step
        if len(batch) == 1:
            log.exception("model step failed")
            failed.setdefault(batch.requests[0].parent_id, f"{type(e).__name__}: {e}")
            return RunnerOutput([], None)
        log.warning("model step over %d sequences failed (%r): retrying each alone", len(batch), e)
    parts = []
    for seq, n in zip(batch.requests, batch.num_new_tokens):
        if seq.parent_id in failed:
            continue
        if runner.states and seq.num_computed_tokens > 0:  # its state may hold this step's tokens already
            parts.append(RunnerOutput([], None, recompute=[seq]))
        else:  # a fresh sequence's state is zeroed again by the retry
            parts.append(execute_contained(runner, ScheduledBatch([seq], [n]), failed))
    return RunnerOutput.concat(parts)


def sample_contained(sampler: Sampler, logits: torch.Tensor, rows: list[Request],
                     failed: dict[str, str]) -> list[tuple[int, tuple | None]]:
    """Tokens (and logprobs) for `rows`. If sampling the batch fails, generator states are restored and each
    row is sampled alone, so one bad row fails only its own request."""
    saved = [(g, g.get_state()) for g in [sampler.generator, *(r.generator for r in rows)] if g is not None]
    try:
        s = sampler(logits, rows)
        return list(zip(s.token_ids, s.logprobs))
    except Exception as e:  # noqa: BLE001
        if not device_healthy(logits.device):
            raise
        log.warning("sampling a batch of %d failed (%r): sampling each row alone", len(rows), e)
        for g, state in saved:
            g.set_state(state)
    result: list[tuple[int, tuple | None]] = []
    for i, seq in enumerate(rows):
        try:
            s = sampler(logits[i:i + 1], [seq])
            result.append((s.token_ids[0], s.logprobs[0]))
        except Exception as e:  # noqa: BLE001
            log.exception("sampling for request %s failed", seq.parent_id)
            failed.setdefault(seq.parent_id, f"{type(e).__name__}: {e}")
            result.append((-1, None))
    return result
