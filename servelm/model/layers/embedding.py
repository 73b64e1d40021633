"""Token embedding and LM head, partitioned over the vocabulary across tensor-parallel ranks.

Vocabulary parallel: the vocabulary is padded to a multiple of the TP size and rank r holds rows
``r * part .. (r + 1) * part`` (``ParallelContext.padded_split``; padding rows are zero and never
looked up). The embedding looks up the ids in its range, zeroes the others and all-reduces; the LM
head computes logits for its rows and all-gathers them, dropping the padding. At tp 1 the part is
the whole vocabulary and neither collective runs.

The LM head may share its weight with the embedding (``tie_word_embeddings``); then the checkpoint's
``lm_head.weight`` (if any) is ignored and only the embedding is loaded. Quantization
(servelm.model.layers.quantization) may replace either float weight afterwards: the head by a
``linear_method``, the embedding by ``quantized_rows``; the weight attribute is then None.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.layers.linear import dense_linear


class VocabEmbedding(nn.Module):
    """``[num_tokens] -> [num_tokens, hidden]``, optionally multiplied by a scale in the weight dtype."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None,
                 dtype: torch.dtype | None = None, *, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.scale = scale
        self.parallel = parallel or ParallelContext.single()
        self.vocab_shard = self.parallel.padded_split(vocab_size)
        """This rank's rows of the (padded) vocabulary."""
        self.weight = nn.Parameter(torch.empty(self.vocab_shard.size, hidden_size, dtype=dtype),
                                   requires_grad=False)
        self.quantized_rows: Any = None
        """Set by quantization: ``ids -> rows`` in the replaced weight's dtype, dequantizing only the
        looked-up rows of a low-bit copy (the float weight is then dropped)."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's rows of the checkpoint's ``[vocab, hidden]`` weight; padding stays 0."""
        load_vocab_rows(param, loaded, self.vocab_shard.start, self.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        is_sharded = self.parallel.tp_size > 1
        if is_sharded:  # ids outside this rank's rows look up row 0 and are zeroed below
            local_ids = input_ids - self.vocab_shard.start
            outside = (local_ids < 0) | (local_ids >= self.vocab_shard.size)
            input_ids = local_ids.masked_fill(outside, 0)
        if self.quantized_rows is not None:
            embedded = self.quantized_rows(input_ids)
        else:
            embedded = F.embedding(input_ids, self.weight)
        if is_sharded:
            embedded = self.parallel.all_reduce(embedded.masked_fill(outside.unsqueeze(-1), 0))
        if self.scale is not None:
            # Round the scale to the model dtype first, as transformers' Gemma does.
            embedded = embedded * torch.tensor(self.scale, dtype=embedded.dtype, device=embedded.device)
        return embedded


class LMHead(nn.Module):
    """``[n, hidden] -> [n, vocab]`` logits in the model dtype; ``final_softcap`` as in Gemma."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None,
                 final_softcap: float | None = None, dtype: torch.dtype | None = None, *,
                 parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.final_softcap = final_softcap
        self.is_tied = tied_to is not None
        self.parallel = parallel or ParallelContext.single()
        self.vocab_shard = self.parallel.padded_split(vocab_size)
        if tied_to is not None:
            assert tied_to.vocab_shard == self.vocab_shard, "a tied head shares the embedding's rows"
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(self.vocab_shard.size, hidden_size, dtype=dtype),
                                       requires_grad=False)
        self.linear_method: Any = None
        """Set by quantization (servelm.model.layers.quantization): computes the logits from its own
        copy of the weight; the (tied) float weight then serves only the embedding lookup."""
        self.dense_routes: Any = None
        """A float32 head's measured routes (layers/f32_rows.py ``DenseRoutes``), else None: oneDNN."""
        self.fp32_weight: torch.Tensor | None = None
        """Set by --enable-fp32-lm-head on a 16-bit model: a float32 copy of ``weight``; the logits
        are then computed in float32 from float32 hidden states."""

    def forward(self, hidden: torch.Tensor, rows: Any = None) -> torch.Tensor:
        """``rows``: which logit rows are generation rows (the forward batch's ``head_rows``), for
        the method's routes."""
        if self.linear_method is not None:
            logits = self.linear_method.apply(self, hidden, None, rows)
        elif self.fp32_weight is not None:
            logits = F.linear(hidden.float(), self.fp32_weight)
        else:
            logits = dense_linear(hidden, self.weight, None, self.dense_routes)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        if self.parallel.tp_size > 1:
            logits = self.parallel.all_gather(logits)[..., :self.vocab_size]
        return logits

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """Copy this rank's rows of the checkpoint's ``[vocab, hidden]`` weight; padding stays 0."""
        load_vocab_rows(param, loaded, self.vocab_shard.start, self.vocab_size)


def load_vocab_rows(param: torch.Tensor, loaded: torch.Tensor, start: int, vocab_size: int) -> None:
    """Copy rows ``start ..`` of ``loaded`` into ``param``; rows past the vocabulary are zeroed."""
    assert loaded.shape[0] == vocab_size and param.shape[1:] == loaded.shape[1:], (
        f"weight shape {tuple(loaded.shape)} does not fit {vocab_size} rows of {tuple(param.shape[1:])}")
    rows = max(0, min(param.shape[0], vocab_size - start))
    param.data[rows:].zero_()
    param.data[:rows].copy_(loaded.narrow(0, start, rows))
