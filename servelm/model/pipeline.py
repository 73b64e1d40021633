"""One pipeline stage's part of a step: micro-batches in, hidden states passed stage to stage.

Every rank of every stage receives the whole step's BatchPlan and cuts it the same way
(``split_micro_batches``: contiguous runs of sequences, so the logits stay in plan order). Per
micro-batch a stage receives the previous stage's hidden states ``[num_tokens, hidden]`` (the first
stage embeds instead), runs its layers, and starts sending the result on without waiting for it to
arrive, so stage s works on micro-batch m + 1 while stage s + 1 works on m (GPipe-style overlap
within one engine step). Images (vision-language models): the first stage encodes them and puts
their rows in place of the placeholders' embeddings (``attach_images``); every stage builds its
batch with the image block mask (``bidirectional_images``) and the M-RoPE positions, both read from
the plan every rank receives. The last stage computes the logits of every micro-batch and returns them
concatenated; the others return an empty tensor.

Invariants:
- Shapes need no message of their own: both ends know each micro-batch's token count from the plan,
  and the hidden size and dtype from the model (its residual stream's dtype, ``--residual-dtype``).
- Sends and receives pair up by tag: a per-rank counter that every rank advances by one per
  micro-batch, in the same order on every rank (all ranks execute the same plans).
- A micro-batch's sequences are disjoint from the other micro-batches' (different requests), so
  running them one after the other on a stage computes what the whole batch would: each sequence
  reads only its own K/V.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.forward_batch import BatchPlan, ForwardBatch
from servelm.model.kv_cache import KVCache

_TAG_MODULO = 2 ** 30
"""Tags wrap here (gloo tags are 32-bit); far more micro-batches than are ever in flight."""


def split_micro_batches(plan: BatchPlan, num_stages: int, max_sequences: int | None) -> list[BatchPlan]:
    """``plan`` as contiguous micro-batches of at most ``max_sequences`` sequences each (None: cut
    into ``num_stages`` micro-batches of near-equal sequence counts, enough to keep every stage busy).
    Concatenating them gives ``plan`` back."""
    count = len(plan.sequences)
    if max_sequences is None:
        max_sequences = max(1, -(-count // num_stages))
    return [BatchPlan(plan.sequences[start:start + max_sequences])
            for start in range(0, count, max_sequences)]


class PipelineStage:
    """Runs this rank's layers over a step's micro-batches, receiving and sending hidden states."""

    def __init__(self, model: nn.Module, parallel: ParallelContext, block_size: int, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, attention: Any, vocab_size: int,
                 max_micro_batch_sequences: int | None, bidirectional_images: bool,
                 attach_images: Callable[[ForwardBatch], None]) -> None:
        self.model = model
        self.parallel = parallel
        self.block_size = block_size
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.device = device
        self.attention = attention
        self.vocab_size = vocab_size
        self.max_micro_batch_sequences = max_micro_batch_sequences
        self.bidirectional_images = bidirectional_images
        """Image placeholder rows attend to their whole image (Gemma 3): on every stage's layers."""
        self.attach_images = attach_images
        """Encodes a batch's images into ``mm_rows``/``mm_embeds`` (the first stage's tower)."""
        self._next_tag = 0

    def execute(self, plan: BatchPlan, kv_cache: KVCache) -> torch.Tensor:
        """Float32 logits ``[plan.num_logits, vocab]`` on the last stage, an empty tensor elsewhere."""
        parallel = self.parallel
        sending: list[tuple[Any, torch.Tensor]] = []  # (work, tensor): kept alive until sent
        logits: list[torch.Tensor] = []
        for micro in split_micro_batches(plan, parallel.pp_size, self.max_micro_batch_sequences):
            tag = self._next_tag
            self._next_tag = (self._next_tag + 1) % _TAG_MODULO
            batch = ForwardBatch.build(micro, self.block_size, self.device, kv_cache, self.attention,
                                       bidirectional_images=self.bidirectional_images)
            hidden = None
            if parallel.is_first_stage and batch.image_rows:
                self.attach_images(batch)
            if not parallel.is_first_stage:
                hidden = torch.empty(micro.num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
                parallel.recv_from_previous_stage(hidden, tag)
            hidden = self.model(batch, hidden)
            if parallel.is_last_stage:
                selected = hidden.index_select(0, batch.logits_indices)
                logits.append(self.model.compute_logits(selected).float())
            else:
                outgoing = hidden.to(self.dtype).contiguous()
                sending.append((parallel.send_to_next_stage(outgoing, tag), outgoing))
        for work, _ in sending:  # a failed send raises here (the step, and the rank, fail)
            work.wait()
        if not parallel.is_last_stage:
            return torch.empty(0, self.vocab_size, dtype=torch.float32, device=self.device)
        return torch.cat(logits)
