"""NEXTN: a model's own multi-token-prediction (MTP) layer as the speculative draft (DeepSeek-V3,
R1: ``num_nextn_predict_layers`` in config.json, the layer stored as checkpoint layer
``num_hidden_layers``).

The MTP layer is structurally an EAGLE-1 head (``model/eagle.py``): its entry at position p reads
the token at p + 1 and the model's last hidden state of position p and predicts the token at p + 2,
so the EAGLE proposer (``spec/eagle.py``) drafts with it unchanged: a chain of
--speculative-num-steps drafts, the layer applied again to its own output for each further draft,
as SGLang does. Only the first MTP layer is used (SGLang and vLLM do the same with V3's one).

Invariants:
- The layer's weights come from the model's own checkpoint (``ModelSource.select_weights``: only
  the ``model.layers.{L}.`` tensors are read; the model's loader skips them), dequantized as the
  model's are where the checkpoint is pre-quantized; its embedding and LM head are the model's.
- Its K/V lives in its own one-layer pool, of the model's kind (latent rows, or per-head K/V under
  --disable-mla), sized beside the model's pool as an EAGLE head's is.
- A model without an MTP layer (no ``num_nextn_predict_layers``, or a checkpoint that left its
  tensors out, GGUF, --load-format dummy) is refused at start-up with the reason.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.deepseek import (
    DeepseekMtpLayer, DeepseekV2ForCausalLM, deepseek_attention, mtp_layer_prefix)
from servelm.model.attention import Attention
from servelm.model.eagle import DraftHeadRunner
from servelm.model.kv_cache import pool_class
from servelm.model.loader import default_dtype
from servelm.model.prequantized import dequantizing_weights
from servelm.model.prequantized import detect as detect_prequantized
from servelm.model.source import ModelSource

logger = logging.getLogger(__name__)

_FLAG = "--speculative-algorithm NEXTN"


def mtp_prefix_or_refusal(source: ModelSource) -> str:
    """The checkpoint prefix of the model's MTP layer; ValueError saying why there is none to read."""
    hf_config = source.hf_config
    prefix = mtp_layer_prefix(hf_config)
    if prefix is None:
        name = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
        raise ValueError(f"{_FLAG} drafts with the model's own multi-token-prediction layer "
                         f"(DeepSeek-V3/R1, num_nextn_predict_layers in config.json); {name} has "
                         "none: use EAGLE/EAGLE3 with a head checkpoint, STANDALONE or NGRAM")
    if source.select_weights is None:
        reason = ("a GGUF file carries no MTP layer" if source.gguf_path is not None
                  else "--load-format dummy has no checkpoint to read it from")
        raise ValueError(f"{_FLAG} reads the MTP layer ({prefix}*) from the model's checkpoint: {reason}")
    return prefix


def _pool_attention(layer: nn.Module) -> Attention:
    return next(module for module in layer.modules() if isinstance(module, Attention))


class MtpHeadRunner(DraftHeadRunner):
    """The model's MTP layer beside the loaded model: ``MtpHeadRunner(source, block_size)`` reads
    the config only (the pool's bytes per token); ``attach`` builds the layer as the model builds
    its layers, loads its tensors and allocates its pool."""

    def __init__(self, source: ModelSource, block_size: int) -> None:
        super().__init__("NEXTN", source.hf_config, block_size)
        self.prefix = mtp_prefix_or_refusal(source)
        self.source = source
        with torch.device("meta"):
            attention = _pool_attention(deepseek_attention(source.hf_config, 0, ParallelContext.single()))
        self.kv_bytes_per_token = pool_class(attention.latent).bytes_per_token(
            1, attention.num_kv_heads, attention.head_dim, torch.float32, attention.v_head_dim)

    def attach(self, target: nn.Module, attention: Any, device: torch.device, dtype: torch.dtype,
               kv_dtype: torch.dtype) -> None:
        if not isinstance(target, DeepseekV2ForCausalLM):
            raise ValueError(f"{_FLAG}: the MTP layer is built as DeepSeek's layers are; the model is "
                             f"{type(target).__name__}")
        with default_dtype(dtype), torch.device(device):
            layer = DeepseekMtpLayer(self.source.hf_config, target)
        self._load(layer)
        self._place(layer, target, attention, device)
        layer_attention = _pool_attention(layer)
        self.kv_cache = pool_class(layer_attention.latent)(
            1, self.num_blocks, self.block_size, layer_attention.num_kv_heads, layer_attention.head_dim,
            kv_dtype, device, v_head_dim=layer_attention.v_head_dim)
        logger.info("%s: the model's multi-token-prediction layer (%s*) drafts; its KV pool %d tokens "
                    "(%.1f MiB)", _FLAG, self.prefix, self.num_blocks * self.block_size,
                    self.kv_cache.nbytes / 2 ** 20)

    def _load(self, layer: DeepseekMtpLayer) -> None:
        """Fill ``layer`` from the checkpoint's ``prefix`` tensors (refused when there are none)."""
        prefix, source = self.prefix, self.source
        assert source.select_weights is not None, "refused in __init__"
        select = source.select_weights

        def read() -> Iterator[tuple[str, torch.Tensor]]:
            return select(lambda name: name.startswith(prefix))

        spec = detect_prequantized(source.hf_config)
        tensors = list((read if spec is None else dequantizing_weights(read, spec))())
        if not tensors:
            raise ValueError(f"{_FLAG}: {source.model_path} has no {prefix}* tensors, the "
                             f"multi-token-prediction layer its config.json announces "
                             f"(num_nextn_predict_layers {source.hf_config.num_nextn_predict_layers}): "
                             "this checkpoint left the MTP weights out")
        try:
            with torch.no_grad():
                layer.load_weights(tensors, prefix)
        except (ValueError, AssertionError) as error:
            raise ValueError(f"{_FLAG}: the MTP layer's tensors ({prefix}*) do not fit: {error}") from error
