"""Runs a scheduled step: the forward pass, then sampling and logprobs for each request.

Invariants: the logits rows returned by the runner are in plan order, ``num_logits`` per request;
a request's leading ``num_prompt_logprob_rows`` rows score its prompt tokens and, when it is
sampling, its last row is sampled. A step of embedding requests (the engine's task fixes that a
step holds only those, or none) runs ``runner.pool`` instead: one vector per request, no sampler.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import torch

from servelm.constrained.grammar import GrammarBackend, GrammarMatcher
from servelm.engine.scheduler import SchedulerOutput, StepResult
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.layers import fused
from servelm.model.pooling import PoolerConfig
from servelm.sampling.sampler import Sampler, SamplingRow, compute_prompt_logprobs, needs_only_argmax
from servelm.engine.verification import Verification
from servelm.spec.tree import path_tokens

logger = logging.getLogger(__name__)

NAN_FILL = -1e5
"""What --enable-nan-detection puts in place of a NaN logit (SGLang's value): far below any real
logit, so the token is effectively never sampled, yet finite so a whole-NaN row stays a valid
(uniform) distribution."""


class NaNLogitsError(RuntimeError):
    """--crash-on-nan: the step's logits hold NaN. Fatal like a failed rank: the engine ends
    every request with this message and its process exits."""


class GrammarBackendSource(Protocol):
    """Where the executor finds the grammar backend (the grammar compiler)."""

    @property
    def backend(self) -> GrammarBackend | None: ...


class Runner(Protocol):
    """Everything the engine uses of the model side: one in-process ``ModelRunner`` (tp 1, the
    fast path) or a group of rank workers (``servelm.workers.multiproc.MultiprocExecutor``).

    Start-up is a handshake: the engine reads ``rank_kv_capacity_blocks()``, decides the pool size
    (the minimum over the ranks) and calls ``init_kv_cache`` once; then it only calls ``execute``
    or ``pool`` (rank 0's logits/vectors come back) and finally ``shutdown``.
    """

    @property
    def num_blocks(self) -> int:
        """KV pool blocks, the same on every rank (0 before ``init_kv_cache``)."""

    @property
    def block_size(self) -> int:
        """Tokens per block (--page-size)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def task(self) -> str:
        """generate or embed (servelm.model.pooling.resolve_task)."""

    @property
    def pooler(self) -> PoolerConfig | None:
        """How an embed model pools its hidden states (None for generate)."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def kv_cache_bytes(self) -> int:
        """KV pool bytes on rank 0."""

    @property
    def device(self) -> torch.device: ...

    def rank_kv_capacity_blocks(self) -> list[int]: ...

    def init_kv_cache(self, num_blocks: int) -> None: ...

    def execute(self, plan: BatchPlan) -> torch.Tensor: ...

    def pool(self, plan: BatchPlan) -> torch.Tensor: ...

    def layout(self) -> dict[str, Any]: ...

    def shutdown(self) -> None: ...


def argmax_rows(output: SchedulerOutput) -> list[int]:
    """The plan's logits rows of which this step reads only the argmax: the sampled rows of each
    plainly greedy request (``needs_only_argmax``) without a grammar or prompt logprobs. A greedy
    request's draft rows are among them: verifying drafts against a greedy target reads only each
    row's argmax (``accept_point_mass``, ``accept_tree``, and the point mass rejection sampling
    compares a greedy row's drafts with); ``needs_only_argmax`` holds at every later position
    once it holds at the first (a min_tokens ban only lifts as the output grows)."""
    rows: list[int] = []
    row = 0
    for scheduled in output.scheduled:
        request = scheduled.request
        if (scheduled.is_sampling and not scheduled.num_prompt_logprob_rows
                and request.grammar is None and request.params.structured is None
                and needs_only_argmax(request.params, len(request.output_token_ids))):
            end = row + scheduled.num_logits
            rows.extend(range(end - len(scheduled.draft_token_ids) - 1, end))
        row += scheduled.num_logits
    return rows


def token_passes(plan: BatchPlan) -> list[BatchPlan]:
    """``plan`` as one forward pass per token, in plan order (--enable-deterministic-inference).

    Token i of a sequence is computed alone at its position, attending to the K/V the earlier
    passes wrote, so the same token at the same position over the same context is the same
    computation whether it came in a long prefill chunk, after a prefix-cache hit, or beside other
    requests. Its pass has a logits row exactly when the plan gives the token one, so the passes'
    rows, concatenated, are the plan's rows. The block and slot copies go with the first pass."""
    passes: list[BatchPlan] = []
    argmax = set(plan.argmax_rows)
    row = 0
    for sequence in plan.sequences:
        assert sequence.tree is None, "a draft tree is verified in one pass"
        first_logit = len(sequence.token_ids) - sequence.num_logits
        for index, token_id in enumerate(sequence.token_ids):
            has_logits = index >= first_logit
            single = SequencePlan([token_id], sequence.start_position + index, sequence.block_ids,
                                  num_logits=int(has_logits), lora_slot=sequence.lora_slot)
            passes.append(BatchPlan([single], argmax_rows=[0] if has_logits and row in argmax else []))
            row += int(has_logits)
    if passes:
        passes[0].block_copies, passes[0].slot_copies = plan.block_copies, plan.slot_copies
    return passes


class Executor:
    """Forward pass plus sampling for one step."""

    def __init__(self, runner: Runner, sampler: Sampler | None = None,
                 grammars: GrammarBackendSource | None = None,
                 verification: Verification | None = None, nan_check: str = "off",
                 deterministic: bool = False) -> None:
        self.runner = runner
        self.deterministic = deterministic
        """--enable-deterministic-inference: one token of one sequence per forward pass."""
        self.nan_check = nan_check
        """off, warn (--enable-nan-detection) or crash (--crash-on-nan)."""
        self.sampler = sampler or Sampler(native_argmax=fused.first_argmax)   # the fused ops where this process built them
        self.grammars = grammars
        """Gives the backend that applies structured-output bitmasks (it is created on a compile
        worker at start-up, so it is read when the first grammar request runs)."""
        self.verification = verification or Verification()
        """Turns each sampling request's rows into its tokens (the speculation stage's rule)."""

    def execute(self, output: SchedulerOutput) -> list[StepResult]:
        if output.plan.num_pooled:
            return self._pool(output)
        output.plan.argmax_rows = argmax_rows(output)
        output.plan.argmax_tokens = {}
        logits = self._forward(output.plan)
        if self.nan_check != "off":
            logits = self._check_nan(logits, output)
        results = [StepResult() for _ in output.scheduled]
        sample_rows: list[int] = []
        sample_targets: list[tuple[int, SamplingRow]] = []
        matchers: list[GrammarMatcher | None] = []
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
                drafts = scheduled.draft_token_ids
                parents = scheduled.draft_parents
                first = row + scheduled.num_logits - 1 - len(drafts)
                for position in range(len(drafts) + 1):
                    # Row ``position`` follows the drafts before it (in a tree: its root path):
                    # sample it as plain decoding would sample that output position (penalties,
                    # min_tokens and the seeded stream all see those drafts as output), so
                    # accepted runs are exact.
                    sample_rows.append(first + position)
                    sample_targets.append((index, SamplingRow(
                        params=request.params,
                        prompt_token_ids=request.prompt_token_ids,
                        output_token_ids=(request.output_token_ids + (
                            drafts[:position] if parents is None
                            else path_tokens(position - 1, drafts, parents))
                                          if position else request.output_token_ids),
                        eos_token_ids=request.eos_token_ids,
                        default_seed=request.default_seed,
                    )))
                matchers.append(request.grammar.matcher if request.grammar is not None else None)
            row += scheduled.num_logits
        assert row == logits.shape[0], f"runner returned {logits.shape[0]} rows, plan needs {row}"
        if sample_rows:
            if sample_rows == list(range(row)) and not any(s.num_prompt_logprob_rows for s in output.scheduled):
                sample_logits = logits  # every row samples (decode): skip copying [rows, vocab]
            else:
                sample_logits = logits[sample_rows]  # a copy: masking it leaves prompt logprobs alone
            sampling = [s for s in output.scheduled if s.is_sampling]
            self._apply_grammars(sample_logits, matchers, [s.draft_token_ids for s in sampling],
                                 [s.draft_parents for s in sampling])
            rows = [r for _, r in sample_targets]
            known = output.plan.argmax_tokens   # the screen's argmax of some greedy rows
            sampled = self.sampler(sample_logits, rows, {position: known[row] for position, row in enumerate(sample_rows)
                                                         if row in known} if known else None)
            position = 0
            for index, scheduled in enumerate(output.scheduled):
                if scheduled.is_sampling:
                    self.verification.verify(self.sampler, results[index], scheduled,
                                             sampled.token_ids, sampled.logprobs, position,
                                             sample_logits, rows)
                    position += len(scheduled.draft_token_ids) + 1
        return results

    def _forward(self, plan: BatchPlan) -> torch.Tensor:
        """The plan's logits; in deterministic mode from one pass per token (``token_passes``)."""
        if not self.deterministic or not plan.sequences or (
                len(plan.sequences) == 1 and len(plan.sequences[0].token_ids) == 1):
            return self.runner.execute(plan)
        return torch.cat([self.runner.execute(single) for single in token_passes(plan)], dim=0)

    def _check_nan(self, logits: torch.Tensor, output: SchedulerOutput) -> torch.Tensor:
        """NaN rows: logged with their requests and filled (warn), or NaNLogitsError (crash).
        A row's sum is NaN when the row holds one (or both infinities): one read of the logits
        and no mask in the usual case; the exact per-entry check runs only then. Rows whose token the
        LM-head screen gave (``plan.argmax_tokens``) are not read: the screen gives none to a row with a
        value that is not finite, and the rest of such a row is -inf (a 32-stream step's [32, 262,144]
        logits were ~2 ms of reading, nearly all of them screened rows)."""
        screened = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        screened[list(output.plan.argmax_tokens)] = True
        quick = logits[~screened] if output.plan.argmax_tokens else logits
        if quick.numel() == 0 or not bool(torch.isnan(quick.sum(dim=-1)).any()):
            return logits
        is_nan = torch.isnan(logits) & ~screened[:, None]   # the screened rows' entries are left as they are
        bad_rows = is_nan.any(dim=-1)
        if not bool(bad_rows.any()):
            return logits
        rows = set(bad_rows.nonzero().flatten().tolist())
        owners, row = [], 0
        for scheduled in output.scheduled:
            if rows.intersection(range(row, row + scheduled.num_logits)):
                owners.append(scheduled.request.request_id)
            row += scheduled.num_logits
        message = f"NaN in the logits of {len(rows)} row(s) this step, of requests {owners}"
        if self.nan_check == "crash":
            raise NaNLogitsError(f"{message} (--crash-on-nan)")
        logger.warning("%s; sampling with those logits at %g (--enable-nan-detection)",
                       message, NAN_FILL)
        return logits.masked_fill(is_nan, NAN_FILL)

    def _pool(self, output: SchedulerOutput) -> list[StepResult]:
        """Embeddings: every request of the step is pooled; row i is request i's vector."""
        assert all(s.is_pooled for s in output.scheduled), "a step pools all its requests or none"
        pooled = self.runner.pool(output.plan).cpu()
        assert pooled.shape[0] == len(output.scheduled), "one vector per pooled request"
        return [StepResult(embedding=row) for row in pooled.tolist()]

    def _apply_grammars(self, logits: torch.Tensor, matchers: list[GrammarMatcher | None],
                        drafts: list[list[int]], trees: list[list[int] | None] | None = None) -> None:
        """Mask each grammar row's disallowed tokens to -inf, with one bitmask op for the batch.

        The mask goes in before the sampler, so logprobs are those of the constrained distribution;
        it commutes with the sampler's bias, min_tokens ban and penalties (-inf stays -inf).
        A request with k drafts has k + 1 rows: row i gets the grammar's mask after drafts
        1..i (the matcher is advanced over them and rolled back). At a draft the grammar forbids,
        the rows stop: the masked row before it cannot sample that draft, so verification cuts
        there, and the later rows (left unmasked) are never used. A draft tree's row gets the mask
        after its root path (``_fill_tree_bitmask``).
        """
        if all(matcher is None for matcher in matchers):
            return
        backend = self.grammars.backend if self.grammars is not None else None
        assert backend is not None, "a grammar request needs the engine's backend"
        bitmask = backend.allocate_bitmask(logits.shape[0])  # all tokens allowed
        row = 0
        for number, (matcher, draft) in enumerate(zip(matchers, drafts, strict=True)):
            parents = trees[number] if trees is not None else None
            if matcher is not None and parents is not None:
                self._fill_tree_bitmask(matcher, bitmask, row, draft, parents)
            elif matcher is not None:
                matcher.fill_bitmask(bitmask, row)
                num_advanced = 0
                for token_id in draft:
                    if not matcher.accept_token(token_id):
                        break
                    num_advanced += 1
                    if matcher.is_terminated():  # an accepted stop token ends the request
                        break
                    matcher.fill_bitmask(bitmask, row + num_advanced)
                if num_advanced:
                    matcher.rollback(num_advanced)
            row += len(draft) + 1
        backend.apply_bitmask(logits, bitmask)

    @staticmethod
    def _fill_tree_bitmask(matcher: Any, bitmask: Any, row: int, drafts: list[int],
                           parents: list[int]) -> None:
        """Row 0: the mask now; row j + 1: the mask after draft j's root path (the matcher is
        advanced along it and rolled back). A path the grammar refuses, or one that ends the
        request, leaves its row unmasked: its parent's masked row cannot produce it, so the walk
        never reaches it."""
        matcher.fill_bitmask(bitmask, row)
        for node in range(len(drafts)):
            path = path_tokens(node, drafts, parents)
            num_advanced = 0
            for token_id in path:
                if not matcher.accept_token(token_id):
                    break
                num_advanced += 1
                if matcher.is_terminated():
                    break
            if num_advanced == len(path) and not matcher.is_terminated():
                matcher.fill_bitmask(bitmask, row + 1 + node)
            if num_advanced:
                matcher.rollback(num_advanced)
