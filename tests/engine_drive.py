"""Driving an LLMEngine to the end in tests: the step loop the engine tests would each write."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams


def drain(engine: LLMEngine, tokens: dict[str, list[int]] | None = None,
          logprobs: dict[str, list[list[float]]] | None = None) -> dict[str, list[int]]:
    """Step until no request is unfinished; every request's new token ids, appended to
    ``tokens`` when given (so several calls can collect into one dict). ``logprobs``: also
    collect each new token's logprob followed by its top alternatives' (requests asking for them)."""
    collected: dict[str, list[int]] = {} if tokens is None else tokens
    while engine.has_unfinished():
        for output in engine.step():
            collected.setdefault(output.request_id, []).extend(output.new_token_ids)
            if logprobs is not None:
                logprobs.setdefault(output.request_id, []).extend(
                    [entry.logprob, *(value for _, value in entry.top)] for entry in output.logprobs or [])
    return collected


def greedy(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    """Add ``prompts`` as requests "0".."n-1" with ``params``, drain, and return their tokens in order."""
    for index, prompt in enumerate(prompts):
        assert engine.add_request(str(index), prompt, params) is None
    tokens = drain(engine)
    return [tokens[str(index)] for index in range(len(prompts))]


def greedy_logprobs(engine: LLMEngine, prompts: list[list[int]], max_tokens: int, num_top: int = 4
                    ) -> tuple[list[list[int]], list[torch.Tensor]]:
    """``greedy`` with ``max_tokens`` (ignore_eos) and logprobs: each prompt's tokens, and its
    ``[tokens, 1 + num_top]`` float64 logprobs (the chosen token's, then the top ``num_top``)."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=num_top)
    for index, prompt in enumerate(prompts):
        assert engine.add_request(str(index), prompt, params) is None
    values: dict[str, list[list[float]]] = {}
    tokens = drain(engine, logprobs=values)
    keys = [str(index) for index in range(len(prompts))]
    return [tokens[key] for key in keys], [torch.tensor(values[key], dtype=torch.float64) for key in keys]


def assert_greedy_parity(got: tuple[list[list[int]], list[torch.Tensor]],
                         expected: tuple[list[list[int]], list[torch.Tensor]], atol: float = 1e-4) -> None:
    """Two ``greedy_logprobs`` results: the same tokens, and logprobs within ``atol`` (float32
    logits computed in another order: a parallel layout against one process)."""
    assert got[0] == expected[0]
    for got_values, expected_values in zip(got[1], expected[1], strict=True):
        torch.testing.assert_close(got_values, expected_values, atol=atol, rtol=0)


def start_ranks_ahead(config: EngineConfig) -> None:
    """Start the rank processes an engine of ``config`` will use now, so that they import torch and
    the runner (seconds) while the test runs its one-process reference on the other core; the
    engine's executor gives them their jobs (servelm.workers.processes). The ``waiting_ranks_ended``
    fixture kills any left unused."""
    from servelm.engine.launch import num_rank_processes
    from servelm.workers.processes import start_waiting_workers

    start_waiting_workers(num_rank_processes(config), config.runtime.omp_wait_policy)


PARITY_PROMPTS = ("The capital of France is", "def quicksort(items):")
"""The text prompts of the real-model parity tests of the parallel layouts (one shared reference)."""
_REFERENCES: dict[tuple[Any, ...], tuple[list[list[int]], list[list[int]], list[torch.Tensor]]] = {}
"""reference_greedy's results in this test run, by its arguments (a real model's float32 engine
takes seconds to load; the tensor-, pipeline- and multi-node tests ask for the same reference)."""
REFERENCE_TOP = 2
"""Top logprobs the reference keeps per token (``reference_logprobs``: the top two give the margin
a greedy choice had)."""


def _reference(prompts: Sequence[str | list[int]], max_tokens: int, flags: dict[str, Any]
               ) -> tuple[list[list[int]], list[list[int]], list[torch.Tensor]]:
    key = (tuple(p if isinstance(p, str) else tuple(p) for p in prompts), max_tokens,
           tuple(sorted(flags.items())))
    if key not in _REFERENCES:
        engine = LLMEngine(EngineConfig.from_flat(flags))
        try:
            ids = [engine.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
            _REFERENCES[key] = (ids, *greedy_logprobs(engine, ids, max_tokens, REFERENCE_TOP))
        finally:
            engine.shutdown()
    return _REFERENCES[key]


def reference_greedy(prompts: Sequence[str | list[int]], max_tokens: int, **flags: Any
                     ) -> tuple[list[list[int]], list[list[int]]]:
    """The one-process reference a distributed run is compared with: an engine built from the flat
    config ``flags`` encodes the text prompts with its tokenizer, generates ``max_tokens`` greedy
    tokens per prompt (ignore_eos), and is shut down. Returns (prompt ids, output tokens); the same
    arguments again in one run (hashable flags, a model path that names the same files) give the
    first call's result without loading an engine."""
    ids, tokens, _ = _reference(prompts, max_tokens, flags)
    return [list(i) for i in ids], [list(t) for t in tokens]


def reference_logprobs(prompts: Sequence[str | list[int]], max_tokens: int, **flags: Any
                       ) -> list[torch.Tensor]:
    """The same reference's ``[tokens, 1 + REFERENCE_TOP]`` logprobs per prompt (``greedy_logprobs``:
    the chosen token's, then the top two), from the same engine run as ``reference_greedy``."""
    return [values.clone() for values in _reference(prompts, max_tokens, flags)[2]]
