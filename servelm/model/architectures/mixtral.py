"""Mixtral: the Mistral decoder (a sliding window on every layer where the config sets one) with a
sparse MoE block on every layer: softmax over the router's logits, top ``num_experts_per_tok``
(2), renormalised over the chosen ones (so: a softmax over the chosen logits); each expert a
gated MLP of ``intermediate_size``.

Checkpoints name the block ``block_sparse_moe`` and the experts' projections ``w1`` (gate),
``w3`` (up), ``w2`` (down); transformers (>= 5) and we call it ``mlp``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.llama import MistralForCausalLM
from servelm.model.architectures.moe_block import SparseMoeBlock


class MixtralForCausalLM(MistralForCausalLM):
    def build_mlp(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        return SparseMoeBlock(hf_config, hf_config.intermediate_size, renormalize=True, parallel=parallel)

    @staticmethod
    def weight_name(name: str) -> str:
        """A checkpoint tensor's name as this model holds it (``block_sparse_moe`` -> ``mlp``)."""
        return name.replace(".block_sparse_moe.", ".mlp.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights((self.weight_name(name), tensor) for name, tensor in weights)
