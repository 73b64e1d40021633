"""Start-up and step glue of EAGLE / EAGLE-3 speculation (and NEXTN, whose head is the model's own
MTP layer, ``model/mtp.py``): read the head checkpoint before the model's pool is sized, attach
the head to the loaded model, and hand the model's features of each step's accepted tokens to the
proposer.

Start-up. ``prepare_eagle_head`` reads the head's config.json (its format checked against
--speculative-algorithm and the model) so the engine can split the KV budget as for a draft
model (``engine.draft_model.split_kv_blocks``: the head's one layer costs little). ``attach_eagle_head``
then loads the head's weights beside the model (sharing its embedding and, for EAGLE, its LM head)
and installs the ``HiddenCapture`` hooks, which only this path does: without EAGLE the model's
forward is untouched.

Each step. The model computed features for every token of the plan; ``hand_over_features`` gives a
request's proposer state the rows of its computed tokens that stayed: a prefill chunk's tokens,
or a verify pass's last token plus its accepted drafts (the rejected drafts' rows are dropped; a
draft tree's accepted path is picked by its draft indices).

Refused: the same set-ups as a draft model (tensor / pipeline parallelism, embedding models).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from servelm.cache.block_pool import BlockPool
from servelm.config import EngineConfig
from servelm.engine.draft_model import check_draft_supported
from servelm.engine.scheduler import SchedulerOutput, StepResult
from servelm.model.eagle import DraftHeadRunner, EagleHeadRunner, HiddenCapture
from servelm.model.runner import ModelRunner
from servelm.spec.eagle import EagleProposer


def load_token_map(path: str, vocab_size: int) -> torch.Tensor:
    """--speculative-token-map: a torch file holding a 1-D tensor of distinct model token ids."""
    if not Path(path).is_file():
        raise ValueError(f"--speculative-token-map {path!r}: no such file")
    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ValueError(f"--speculative-token-map {path!r}: not a torch tensor file ({error})") from error
    if not isinstance(loaded, torch.Tensor) or loaded.dim() != 1 or loaded.is_floating_point() \
            or not loaded.numel():
        raise ValueError(f"--speculative-token-map {path!r}: expected a non-empty 1-D integer tensor "
                         "of token ids")
    ids = loaded.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or len(set(ids.tolist())) != ids.numel():
        raise ValueError(f"--speculative-token-map {path!r}: token ids must be distinct and within "
                         f"the model's vocabulary of {vocab_size}")
    return ids


def prepare_eagle_head(config: EngineConfig, source: Any) -> DraftHeadRunner:
    """The head, weights not loaded yet, for sizing the pools (checks the format first): an EAGLE
    checkpoint's, or for NEXTN the model's own multi-token-prediction layer (``model/mtp.py``)."""
    check_draft_supported(config)
    speculative = config.speculative
    path = speculative.speculative_draft_model_path
    algorithm = speculative.speculative_algorithm
    if algorithm == "NEXTN":
        from servelm.model.mtp import MtpHeadRunner

        return MtpHeadRunner(source, config.cache.page_size)
    assert path is not None and algorithm is not None, "SpeculativeConfig requires the head path"
    vocab_size = source.hf_config.get_text_config().vocab_size
    token_map = (load_token_map(speculative.speculative_token_map, vocab_size)
                 if speculative.speculative_token_map is not None else None)
    return EagleHeadRunner(path, algorithm, source.hf_config, config.cache.page_size, token_map)


def attach_eagle_head(config: EngineConfig, head: DraftHeadRunner, runner: ModelRunner) -> EagleProposer:
    """Load the head beside ``runner``'s model, hook the features it reads, and build the proposer
    over the head's pool (sized by the engine)."""
    if runner.task != "generate":
        raise ValueError(f"--speculative-algorithm {head.algorithm} serves generation; it cannot be "
                         "combined with --task embed")
    head.attach(runner.model, runner.attention, runner.device, runner.dtype, runner.kv_dtype)
    capture = HiddenCapture(runner.model, head.layer_ids)
    return EagleProposer(head.algorithm, head, BlockPool(head.num_blocks), seed=config.model.seed,
                         feature_source=capture, topk=config.speculative.speculative_eagle_topk or 1,
                         num_steps=config.speculative.speculative_num_steps)


def hand_over_features(proposer: EagleProposer, scheduled: SchedulerOutput,
                       results: list[StepResult]) -> None:
    """Give each request's state the features of the tokens it keeps from this step (call before
    ``Scheduler.update``, while ``num_computed_tokens`` is still the step's start)."""
    features = proposer.take_features()
    if features is None or not scheduled.scheduled:
        return
    row = 0
    known: list[tuple[str, list[int]]] = []
    for item, result, sequence in zip(scheduled.scheduled, results, scheduled.plan.sequences,
                                      strict=True):
        num_rows = len(sequence.token_ids)
        request = item.request
        if not request.is_finished and not item.is_pooled:
            num_kept = item.num_tokens
            if item.draft_token_ids and result.token_ids:
                num_kept += len(result.token_ids) - 1  # the accepted drafts
            kept = features[row:row + num_kept]
            if result.accepted_draft_indices:  # a tree: the rows of its accepted path
                kept = features[[row + i for i in range(item.num_tokens)]
                                + [row + item.num_tokens + i for i in result.accepted_draft_indices]]
            proposer.add_features(request.request_id, request.num_computed_tokens, kept)
            known.append((request.request_id, request.prompt_token_ids + request.output_token_ids
                          + result.token_ids))
        row += num_rows
    assert row == features.shape[0], f"{features.shape[0]} feature rows for a plan of {row} tokens"
    proposer.absorb(known)
