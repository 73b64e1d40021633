"""Runs a scheduled step: the forward pass, then sampling and logprobs for each request.

Invariants: the logits rows returned by the runner are in plan order, ``num_logits`` per request;
a request's leading ``num_prompt_logprob_rows`` rows score its prompt tokens and, when it is
sampling, its last row is sampled.
"""

from __future__ import annotations

from typing import Protocol

import torch

from servelm.engine.scheduler import SchedulerOutput, StepResult
from servelm.model.forward_batch import BatchPlan
from servelm.sampling.sampler import Sampler, SamplingRow, compute_prompt_logprobs


class Runner(Protocol):
    """What the executor needs from a model runner (servelm.model.runner.ModelRunner)."""

    num_blocks: int
    block_size: int

    def execute(self, plan: BatchPlan) -> torch.Tensor: ...


class Executor:
    """Forward pass plus sampling for one step."""

    def __init__(self, runner: Runner, sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.sampler = sampler or Sampler()

    def execute(self, output: SchedulerOutput) -> list[StepResult]:
        logits = self.runner.execute(output.plan)
        results = [StepResult() for _ in output.scheduled]
        sample_rows: list[int] = []
        sample_targets: list[tuple[int, SamplingRow]] = []
        row = 0
        for index, scheduled in enumerate(output.scheduled):
            request = scheduled.request
            if scheduled.num_prompt_logprob_rows:
                start = request.num_computed_tokens + 1
                targets = request.token_slice(start, start + scheduled.num_prompt_logprob_rows)
                k = request.params.prompt_logprobs or 0
                results[index].prompt_logprobs = compute_prompt_logprobs(
                    logits[row:row + len(targets)], targets, k)
            if scheduled.is_sampling:
                sample_rows.append(row + scheduled.num_logits - 1)
                sample_targets.append((index, SamplingRow(
                    params=request.params,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=request.output_token_ids,
                    eos_token_ids=request.eos_token_ids,
                )))
            row += scheduled.num_logits
        assert row == logits.shape[0], f"runner returned {logits.shape[0]} rows, plan needs {row}"
        if sample_rows:
            sampled = self.sampler(logits[sample_rows], [r for _, r in sample_targets])
            for position, (index, _) in enumerate(sample_targets):
                results[index].token_ids = [sampled.token_ids[position]]
                if sampled.logprobs is not None and sampled.logprobs[position] is not None:
                    results[index].logprobs = [sampled.logprobs[position]]
        return results
