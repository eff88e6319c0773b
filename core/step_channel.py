"""Rank 0 -> every other tensor-parallel rank: the commands that keep their model runners in step.

Rank 0 schedules; the other ranks only run the model. Each step rank 0 broadcasts a command (run a step, compute
logits of some hidden rows, copy blocks for a fork, stop) with its tensors over the host-side gloo group: a fixed
header (command, each tensor's dtype and shape) and one byte payload holding the tensors back to back. Two
broadcasts a command, no pickle, and every rank then runs the same forward with the same inputs. A rank waits for
the next command without a time limit: a server may stay idle for hours.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, fields

import torch
import torch.distributed as dist

_HEADER = 96  # int64 words: command, tensor count, then (dtype, ndim, dims...) per tensor
_DTYPES = [torch.int32, torch.int64, torch.bool, torch.float32, torch.bfloat16, torch.float16]


class Command(enum.IntEnum):
    STEP = 1  # StepInputs: forward, then logits of the sampled rows
    LOGITS = 2  # hidden rows: their logits (prompt logprobs)
    FORK = 3  # source pages, destination pages, state slots: a forked sequence's copies
    STOP = 4


@dataclass
class StepInputs:
    """One step's forward, on the host: what every rank needs to run it. Optional fields are empty tensors."""
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    query_start_loc: torch.Tensor  # (B + 1,) int32
    seq_lens: torch.Tensor  # (B,) int32
    block_tables: torch.Tensor  # (groups, B, blocks) int32
    slot_mapping: torch.Tensor  # (groups, T) int64
    state_slots: torch.Tensor  # (B,) int32; empty without recurrent state
    fresh_slots: torch.Tensor  # state slots that start from zeros this step
    continuing: torch.Tensor  # (B,) bool: the sequence had computed tokens before this step
    logits_indices: torch.Tensor  # (S,) int64: the rows whose logits are sampled

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())

    @property
    def max_seq_len(self) -> int:
        return int(self.seq_lens.max())

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]


class StepChannel:
    """exchange: the ranks' shared-memory segment when they share a machine (backends/cpu/shm_collectives.py):
    commands go through it instead of gloo's loopback TCP (~1.4 ms a broadcast), payloads over a slot excepted."""

    def __init__(self, group: dist.ProcessGroup, rank: int, exchange=None):
        self.group, self.rank, self.exchange = group, rank, exchange

    def _broadcast(self, t: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """Rank 0's t (a same-sized buffer elsewhere) on every rank. idle: the wait for the next command."""
        nbytes = t.numel() * t.element_size()
        if self.exchange is None or nbytes > self.exchange.slot_bytes:
            dist.broadcast(t, 0, group=self.group)
            return t
        got = self.exchange.broadcast(t if self.rank == 0 else None, nbytes, idle)
        return t if self.rank == 0 else got.view(t.dtype).view(t.shape)

    def send(self, command: Command, tensors: list[torch.Tensor] = ()) -> None:
        """Rank 0: broadcast a command and its tensors (host copies are made here)."""
        header = torch.zeros(_HEADER, dtype=torch.int64)
        words = [int(command), len(tensors)]
        for t in tensors:
            words += [_DTYPES.index(t.dtype), t.dim(), *t.shape]
        if len(words) > _HEADER:
            raise ValueError(f"a {command.name} command with {len(tensors)} tensors does not fit the header")
        header[:len(words)] = torch.tensor(words)
        self._broadcast(header)
        if tensors:
            payload = torch.cat([t.detach().cpu().contiguous().view(-1).view(torch.uint8) for t in tensors])
            self._broadcast(payload)

    def recv(self) -> tuple[Command, list[torch.Tensor]]:
        """Other ranks: the next command and its tensors (host tensors)."""
        words = self._broadcast(torch.empty(_HEADER, dtype=torch.int64), idle=True).tolist()
        command, count, i = Command(words[0]), words[1], 2
        specs = []
        for _ in range(count):
            dtype, ndim = _DTYPES[words[i]], words[i + 1]
            specs.append((dtype, tuple(words[i + 2:i + 2 + ndim])))
            i += 2 + ndim
        sizes = [torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size() for dtype, shape in specs]
        if not specs:
            return command, []
        payload = self._broadcast(torch.empty(sum(sizes), dtype=torch.uint8))
        out, start = [], 0
        for (dtype, shape), size in zip(specs, sizes):
            out.append(payload[start:start + size].clone().view(dtype).view(shape))  # clone: aligned
            start += size
        return command, out
