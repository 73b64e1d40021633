"""Speculative verification: a sampling request's k + 1 verify rows become its emitted tokens.

The rule for a sampling (non-greedy) request's drafts is chosen once, at start-up, from
--spec-decoding-acceptance-method: typical acceptance, or rejection sampling for drafts a draft
model sampled (``DraftState.probs``). The rest follows from the drafts themselves:

- a draft tree (``DraftState.parents``): walked with the model's own token of each row (exact for
  greedy and sampling: the drafts are fixed point masses), or by typical acceptance;
- a chain with ``DraftState.probs``: rejection sampling against the distributions the sampler draws
  from, so the emitted tokens follow the model's distribution exactly (``spec/verify.py``);
- otherwise (greedy, n-gram drafts, or no drafts at all): the model's own tokens up to the first
  draft it disagrees with (``accept_point_mass``).

Row ``i`` of a request was sampled as plain decoding samples that output position (penalties,
min_tokens and the seeded stream see the drafts before it as output), so accepted runs are exact.
"""

from __future__ import annotations

import torch

from servelm.engine.outputs import TokenLogprob
from servelm.engine.scheduler_output import ScheduledRequest, StepResult
from servelm.sampling.logprobs import gather_logprobs
from servelm.sampling.sampler import Sampler, SamplingRow
from servelm.spec.tree import accept_tree
from servelm.spec.typical import TypicalAcceptance
from servelm.spec.verify import accept_point_mass, rejection_sample


class Verification:
    """Applies the verify rule chosen at start-up to one request's sampled rows."""

    def __init__(self, typical: TypicalAcceptance | None = None) -> None:
        self.typical = typical
        """--spec-decoding-acceptance-method typical_acceptance_sampler: a sampling request's
        drafts are verified by it instead of rejection sampling (None: exact verification)."""
        self._generator = torch.Generator()
        """Rejection-sampling draws of unseeded requests (seeded ones reseed per step)."""
        self._generator.seed()

    def verify(self, sampler: Sampler, result: StepResult, scheduled: ScheduledRequest,
               sampled_token_ids: list[int], logprobs: list[TokenLogprob | None] | None,
               position: int, sample_logits: torch.Tensor, sample_rows: list[SamplingRow]) -> None:
        """Fill ``result`` from the request's ``len(drafts) + 1`` sampled rows, which start at
        ``position`` of the step's sampled rows: ``sampled_token_ids`` (the sampler's token of
        each), ``sample_logits``/``sample_rows`` (masked logits and sampling rows) and
        ``logprobs`` (the sampler's logprobs, when asked). Plain decoding (no drafts) slices
        nothing: it is every step's path."""
        drafts = scheduled.draft_token_ids
        end = position + len(drafts) + 1
        if not drafts:
            result.token_ids = sampled_token_ids[position:end]
            first = logprobs[position] if logprobs is not None else None
            if first is not None:
                result.logprobs = [first]
            return
        token_ids = sampled_token_ids[position:end]
        logits, rows = sample_logits[position:end], sample_rows[position:end]
        is_greedy = scheduled.request.params.is_greedy
        if scheduled.draft_parents is not None:
            self._verify_tree(sampler, result, scheduled, token_ids, logprobs, position, logits, rows)
        elif self.typical is not None and drafts and not is_greedy:
            emitted = self.typical.accept(sampler.probabilities(logits, rows), drafts, token_ids[-1])
            result.token_ids = emitted
            self._gather_logprobs(result, scheduled, logits[:len(emitted)], emitted)
        elif (draft_state := scheduled.request.drafts) is not None and draft_state.probs is not None:
            emitted = self._rejection_sample(sampler, logits, rows, drafts, draft_state.probs)
            result.token_ids = emitted
            self._gather_logprobs(result, scheduled, logits[:len(emitted)], emitted)
        else:
            emitted = accept_point_mass(token_ids, drafts)
            result.token_ids = emitted
            if logprobs is not None and logprobs[position] is not None:
                result.logprobs = [logprob for logprob in logprobs[position:position + len(emitted)]
                                   if logprob is not None]

    def _verify_tree(self, sampler: Sampler, result: StepResult, scheduled: ScheduledRequest,
                     token_ids: list[int], logprobs: list[TokenLogprob | None] | None,
                     position: int, logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        """A draft tree (``spec/tree.py``): the model's own token of each row walks it, or typical
        acceptance does for a sampling request when configured."""
        drafts, parents = scheduled.draft_token_ids, scheduled.draft_parents
        assert parents is not None
        if self.typical is not None and not scheduled.request.params.is_greedy:
            emitted, accepted = self.typical.accept_tree(
                sampler.probabilities(logits, rows), drafts, parents, token_ids)
            result.token_ids, result.accepted_draft_indices = emitted, accepted
            used = [0] + [node + 1 for node in accepted]
            self._gather_logprobs(result, scheduled, logits[used], emitted)
            return
        emitted, accepted = accept_tree(token_ids, drafts, parents)
        result.token_ids, result.accepted_draft_indices = emitted, accepted
        if logprobs is not None and logprobs[position] is not None:
            used = [0] + [node + 1 for node in accepted]
            result.logprobs = [logprob for logprob in (logprobs[position + row] for row in used)
                               if logprob is not None]

    @staticmethod
    def _gather_logprobs(result: StepResult, scheduled: ScheduledRequest, logits: torch.Tensor,
                         emitted: list[int]) -> None:
        """Logprobs of tokens chosen outside the sampler (rejection sampling, typical
        acceptance): each from its own verify row."""
        num_top = scheduled.request.params.logprobs
        if num_top is not None:
            result.logprobs = gather_logprobs(logits, emitted, [num_top] * len(emitted))

    def _rejection_sample(self, sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRow],
                          drafts: list[int], draft_probs: torch.Tensor) -> list[int]:
        """Verify drafts a model sampled from ``draft_probs``: rejection sampling against the
        distributions the sampler draws each row from (processors, grammar mask and all)."""
        target_probs = sampler.probabilities(logits, rows)
        seed = rows[0].seed
        generator = self._generator
        if seed is not None:  # depends only on (seed, output length), like a seeded sampler row
            generator = torch.Generator(device=logits.device).manual_seed(
                (seed * 0x2545F4914F6CDD1D + len(rows[0].output_token_ids)) & ((1 << 64) - 1))
        elif logits.device.type != "cpu":
            generator = torch.Generator(device=logits.device).manual_seed(
                int(torch.randint(0, 2 ** 62, (1,), generator=self._generator)))
        return rejection_sample(target_probs, draft_probs[:len(drafts)].to(logits.device), drafts,
                                generator)
