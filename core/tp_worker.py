"""A tensor-parallel rank other than 0: runs the commands rank 0's StepChannel sends, in order, until STOP.

Its ModelRunner has no scheduler, no requests and no channel of its own: every input comes from rank 0, so its
forward is the same step rank 0 runs, over this rank's slices of the weights and its own KV cache. Anything that
raises here ends the process (and with it the engine: rank 0 sees the rank exit): a rank that skipped a step
would run the next one out of step with the others.
"""
from __future__ import annotations

import torch

from resin.core.model_runner import ModelRunner
from resin.core.step_channel import Command, StepChannel, StepInputs


@torch.inference_mode()
def serve_steps(runner: ModelRunner, channel: StepChannel) -> None:
    while True:
        command, tensors = channel.recv()
        if command is Command.STOP:
            return
        if command is Command.STEP:
            inputs = StepInputs(*tensors)
            runner.step_logits(inputs, runner.forward(inputs))
        elif command is Command.LOGITS:
            runner.compute_logits(tensors[0].to(runner.device))
        elif command is Command.FORK:
            pages, slots = tensors
            src, dst = (None if s < 0 else s for s in slots.tolist())
            runner.copy_for_fork([tuple(p) for p in pages.tolist()], src, dst)
