"""Start-up of the STANDALONE draft model: load it next to the model, check it shares the model's
tokenizer, split the KV budget between the two pools, and hand the proposer its runner and pool.

Sizing. The draft needs K/V for every token of every running request, as the model does, plus
the drafts of one step. When the pool is sized from memory (no --max-total-tokens), the model's
pool gives up the draft's share: tokens = capacity x t / (t + d) for t and d the two models' bytes
per token, and the draft pool holds as many tokens plus one step's drafts per running request
(``max_running_requests x ceil(k / block_size)`` blocks). With --max-total-tokens the model keeps
that many tokens and the draft pool comes on top. Both sizes are logged. A request the draft pool
cannot hold this step simply gets no drafts (``DraftModelProposer``).

Refused: tensor or pipeline parallelism (the draft would have to run on rank 0 only, beside a
sharded model, and its forwards would serialise the ranks: not cheap), embedding models, and a
draft whose vocabulary differs from the model's.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from servelm.cache.block_pool import BlockPool
from servelm.config import EngineConfig
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.runner import ModelRunner
from servelm.spec.draft_model import DraftModelProposer, DraftSequence

logger = logging.getLogger(__name__)


class DraftModelRunner:
    """A ModelRunner as the proposer's ``DraftRunner``: sequences in, last-token logits out."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @property
    def block_size(self) -> int:
        return self.runner.block_size

    def forward_last(self, sequences: list[DraftSequence]) -> torch.Tensor:
        plan = BatchPlan([SequencePlan(s.token_ids, s.start_position, s.block_ids, num_logits=1)
                          for s in sequences])
        return self.runner.execute(plan).cpu()


def check_draft_supported(config: EngineConfig) -> None:
    """Refuse the set-ups a draft model does not run with (before anything loads)."""
    parallel = config.parallel
    draft = ("--speculative-draft-model-path" if config.speculative.speculative_algorithm == "STANDALONE"
             else f"--speculative-algorithm {config.speculative.speculative_algorithm}")
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        raise ValueError(f"{draft} cannot be combined with --tp-size or "
                         "--pp-size > 1: the draft would run on one rank beside the sharded model "
                         "and every rank would wait for its k forwards each step; use NGRAM, or "
                         "--dp-size for more throughput")
    if config.model.is_embed_task:
        raise ValueError(f"{draft} serves generation; it cannot be combined with --task embed")


def draft_engine_config(config: EngineConfig) -> EngineConfig:
    """The config the draft's ModelRunner is built from: the model's, with the draft's path and
    none of the model-only options (tokenizer, overrides, context length, torch.compile, the MoE
    expert placement and recording: the draft runs whole on the engine's rank; experts_int8, which
    names the model's experts: the draft, often a dense model, loads as it is)."""
    path = config.speculative.speculative_draft_model_path
    assert path is not None, "STANDALONE has a draft path (SpeculativeConfig)"
    quantization = "auto" if config.model.quantization == "experts_int8" else config.model.quantization
    model = dataclasses.replace(config.model, model=path, tokenizer=None, hf_overrides=None,
                                context_length=None, served_model_name=None, revision=None,
                                download_dir=None, quantization=quantization)
    runtime = dataclasses.replace(config.runtime, enable_torch_compile=False)
    parallel = dataclasses.replace(config.parallel, expert_parallel_size=1, enable_expert_parallel=False,
                                   ep_num_redundant_experts=0, enable_eplb=False)
    observability = dataclasses.replace(config.observability, expert_distribution_recorder_mode=None,
                                        enable_expert_distribution_metrics=False)
    return dataclasses.replace(config, model=model, runtime=runtime, parallel=parallel,
                               observability=observability)


def load_draft_runner(config: EngineConfig) -> tuple[ModelRunner, Any]:
    """The draft's ModelRunner (KV pool not sized yet) and its tokenizer (None when skipped)."""
    from servelm.model.source import resolve_model_source
    from servelm.model.tokenizer import load_tokenizer

    check_draft_supported(config)
    draft_config = draft_engine_config(config)
    source = resolve_model_source(draft_config.model)
    tokenizer = load_tokenizer(draft_config.model, source)
    runner = ModelRunner(draft_config, source, defer_kv_cache=True)
    if runner.task != "generate":
        raise ValueError(f"--speculative-draft-model-path {draft_config.model.model!r} is not a "
                         "generative model")
    return runner, tokenizer


def check_vocab(draft: ModelRunner, draft_tokenizer: Any, target_vocab_size: int,
                target_tokenizer: Any) -> None:
    """The draft must score the model's tokens: same logits width and, when tokenizers are
    loaded, the same token -> id map."""
    path = draft.config.model.model
    if draft.vocab_size != target_vocab_size:
        raise ValueError(f"--speculative-draft-model-path {path!r}: the draft has {draft.vocab_size} "
                         f"vocabulary rows, the model {target_vocab_size}; a draft model must "
                         "share the model's tokenizer and vocabulary")
    if draft_tokenizer is not None and target_tokenizer is not None:
        draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
        if draft_vocab != target_vocab:
            different = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()))[:3]
            raise ValueError(f"--speculative-draft-model-path {path!r}: its tokenizer differs from "
                             f"the model's ({len(draft_vocab)} vs {len(target_vocab)} tokens; e.g. "
                             f"{different}); a draft model must share the model's tokenizer")


def split_kv_blocks(config: EngineConfig, capacity_blocks: int, target_bytes_per_token: int,
                    draft_bytes_per_token: int) -> tuple[int, int]:
    """(model blocks, draft blocks) from the model's capacity (see the module docstring)."""
    block_size = config.cache.page_size
    step_blocks = -(-config.speculative.max_draft_positions // block_size) + 1
    headroom = min(config.scheduler.max_running_requests, capacity_blocks) * step_blocks
    target_blocks = capacity_blocks
    if config.cache.max_total_tokens is None:
        target_blocks = max(1, capacity_blocks * target_bytes_per_token
                            // (target_bytes_per_token + draft_bytes_per_token))
    draft_blocks = target_blocks + headroom
    logger.info("speculative draft model: KV pool %d tokens (%.1f MiB, %d bytes per token) beside "
                "the model's %d tokens (%.1f MiB)%s", draft_blocks * block_size,
                draft_blocks * block_size * draft_bytes_per_token / 2 ** 20, draft_bytes_per_token,
                target_blocks * block_size,
                target_blocks * block_size * target_bytes_per_token / 2 ** 20,
                "; the model's pool gave up the draft's share of the budget"
                if target_blocks < capacity_blocks else
                "; --max-total-tokens fixes the model's pool, the draft's comes on top")
    return target_blocks, draft_blocks


def make_draft_proposer(config: EngineConfig, draft: ModelRunner) -> DraftModelProposer:
    """The proposer over the draft's runner and pool (sized by the engine: ``split_kv_blocks``)."""
    assert draft.num_blocks > 0, "the engine sizes the draft's pool with the model's"
    return DraftModelProposer(DraftModelRunner(draft), BlockPool(draft.num_blocks), seed=config.model.seed,
                              max_catch_up_tokens=config.scheduler.max_chunk_tokens,
                              max_forward_tokens=config.scheduler.max_prefill_tokens)
