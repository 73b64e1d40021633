"""Token embedding and LM head (vocab-parallel seams at tp world size 1).

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

from servelm.model.layers.linear import dense_linear


class VocabEmbedding(nn.Module):
    """``[num_tokens] -> [num_tokens, hidden]``, optionally multiplied by a scale in the weight dtype."""

    def __init__(self, vocab_size: int, hidden_size: int, scale: float | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.scale = scale
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.quantized_rows: Any = None
        """Set by quantization: ``ids -> rows`` in the replaced weight's dtype, dequantizing only the
        looked-up rows of a low-bit copy (the float weight is then dropped)."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized_rows is not None:
            embedded = self.quantized_rows(input_ids)
        else:
            embedded = F.embedding(input_ids, self.weight)
        if self.scale is not None:
            # Round the scale to the model dtype first, as transformers' Gemma does.
            embedded = embedded * torch.tensor(self.scale, dtype=embedded.dtype, device=embedded.device)
        return embedded


class LMHead(nn.Module):
    """``[n, hidden] -> [n, vocab]`` logits in the model dtype; ``final_softcap`` as in Gemma."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabEmbedding | None = None,
                 final_softcap: float | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.final_softcap = final_softcap
        self.is_tied = tied_to is not None
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype), requires_grad=False)
        self.linear_method: Any = None
        """Set by quantization (servelm.model.layers.quantization): computes the logits from its own
        copy of the weight; the (tied) float weight then serves only the embedding lookup."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.linear_method is not None:
            logits = self.linear_method.apply(self, hidden, None)
        else:
            logits = dense_linear(hidden, self.weight)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
