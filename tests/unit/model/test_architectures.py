"""Our modules over the paged cache vs the transformers reference, per architecture (CPU, float32)."""

from __future__ import annotations

from typing import Any

import torch

from servelm.model.forward_batch import BatchPlan

from .conftest import BlockAllocator, prompts_for

ATOL = 1e-4
NUM_NEW_TOKENS = 32


def hf_logits(hf_model: Any, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids])).logits[0].float()


def test_prefill_logits_match(arch: str, hf_model: Any, runner_factory: Any, allocator: BlockAllocator) -> None:
    runner = runner_factory()
    prompts = prompts_for(arch, runner.vocab_size)
    plan = BatchPlan([allocator.plan(i, p, num_logits=len(p)) for i, p in enumerate(prompts)])
    logits = runner.execute(plan)
    assert logits.dtype == torch.float32 and logits.shape == (plan.num_logits, runner.vocab_size)
    expected = torch.cat([hf_logits(hf_model, p) for p in prompts])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)


def test_greedy_generation_matches_hf(arch: str, hf_model: Any, runner_factory: Any,
                                      allocator: BlockAllocator) -> None:
    """Sequences join one step apart, so most steps mix a prefill with decodes of other lengths."""
    runner = runner_factory()
    prompts = prompts_for(arch, runner.vocab_size)
    outputs: list[list[int]] = [[] for _ in prompts]
    step = 0
    while any(len(o) < NUM_NEW_TOKENS for o in outputs):
        sequences, members = [], []
        for i, prompt in enumerate(prompts):
            if i > step or len(outputs[i]) >= NUM_NEW_TOKENS:
                continue
            new_tokens = prompt if not outputs[i] else outputs[i][-1:]
            sequences.append(allocator.plan(i, new_tokens, num_logits=1))
            members.append(i)
        logits = runner.execute(BatchPlan(sequences))
        for i, token in zip(members, logits.argmax(-1).tolist()):
            outputs[i].append(token)
        step += 1
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            generated = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NUM_NEW_TOKENS,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
        assert output == generated[0, len(prompt):].tolist()


def test_chunked_prefill_matches_full(arch: str, hf_model: Any, runner_factory: Any,
                                      allocator: BlockAllocator) -> None:
    """A long prompt in uneven chunks over several steps, batched with another sequence's decodes."""
    runner = runner_factory()
    long_prompt, other_prompt = prompts_for(arch, runner.vocab_size)[2], [5, 6, 7]
    chunks = [long_prompt[:5], long_prompt[5:6], long_prompt[6:14], long_prompt[14:]]
    runner.execute(BatchPlan([allocator.plan(1, other_prompt, num_logits=1)]))
    rows = []
    for chunk in chunks:
        plan = BatchPlan([allocator.plan(1, [9], num_logits=1), allocator.plan(0, chunk, num_logits=len(chunk))])
        rows.append(runner.execute(plan)[1:])
    torch.testing.assert_close(torch.cat(rows), hf_logits(hf_model, long_prompt), atol=ATOL, rtol=1e-4)


def test_decode_batch_of_mixed_lengths(arch: str, hf_model: Any, runner_factory: Any,
                                       allocator: BlockAllocator) -> None:
    runner = runner_factory()
    prompts = prompts_for(arch, runner.vocab_size)
    for i, prompt in enumerate(prompts):  # prefill separately, no logits wanted
        assert runner.execute(BatchPlan([allocator.plan(i, prompt, num_logits=0)])).shape[0] == 0
    next_tokens = [7, 8, 9]
    plan = BatchPlan([allocator.plan(i, [t], num_logits=1) for i, t in enumerate(next_tokens)])
    logits = runner.execute(plan)
    expected = torch.stack([hf_logits(hf_model, p + [t])[-1] for p, t in zip(prompts, next_tokens)])
    torch.testing.assert_close(logits, expected, atol=ATOL, rtol=1e-4)
