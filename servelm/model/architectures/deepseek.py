"""DeepSeek-V2 (V2-Lite, V2, V2.5) and DeepSeek-V3 (V3, R1): multi-head latent attention (MLA)
and a mixture of experts with shared experts, on the Llama decoder's pre-norm skeleton.

Attention. A token's keys and values are compressed into one latent row: ``kv_a_proj_with_mqa``
gives ``kv_lora_rank`` latent columns (then RMS-normed: ``c``) and ``qk_rope_head_dim`` rope-key
columns (``k_pe``, one for all heads). ``kv_b_proj`` expands ``c`` per head into a no-rope key
(``qk_nope_head_dim``) and a value (``v_head_dim``). Queries come from ``q_proj`` (V2-Lite:
``q_lora_rank`` None) or ``q_b_proj(norm(q_a_proj(x)))`` (V2, V3), split per head into a no-rope
and a rope part. A head's score is ``q_nope . k_nope + q_pe . k_pe``, scaled by
``qk_head_dim ** -0.5`` (times YaRN's ``mscale(factor, mscale_all_dim) ** 2``).

Two forms compute the same scores:
- ``DeepseekLatentAttention`` (default): the pool holds the latent row ``[c, k_pe]``
  (``LatentKVCache``: kv_lora_rank + qk_rope_head_dim values per token and layer, one "head").
  ``kv_b_proj``'s key rows are absorbed into the query (``q_nope @ W_UK[h]``: a query in the latent
  space), so every head attends to the latent rows directly (MQA with a 576-wide head at V2-Lite's
  shape, the value being the row's first 512 columns), and the value rows ``W_UV[h]`` multiply the
  attended latent out afterwards. Absorbed at every step, prefill included: one route and one pool
  layout; a decode step reads each cached token's 576 values once for all heads, where the
  expanded form reads 16 x (192 + 128) (V2-Lite), and no step re-expands the cached context. The
  cost is prefill attention over 576/512-wide heads instead of 192/128 (about 3x its FLOPs).
- ``DeepseekExpandedAttention`` (``--disable-mla``): per-head K ``[k_nope, k_pe]`` and V in the
  ordinary pool (K and V of different widths), as transformers computes it.

Rope turns the ``qk_rope_head_dim`` columns only. DeepSeek lays them out as interleaved pairs
(V2 always; V3 where ``rope_interleave``); both q and k are de-interleaved (even columns, then odd)
before the neox rotation, which turns the same pairs by the same angles: the scores are those of
transformers' complex (V2) or interleaved (V3) rotation.

Experts (``DeepseekMoE``): on layers from ``first_k_dense_replace``, ``n_routed_experts`` routed
experts of ``moe_intermediate_size`` plus ``n_shared_experts`` shared ones (one gated MLP of
``n_shared_experts * moe_intermediate_size``, every token, no gate). The router (float32) is
V2's softmax top-k, group-limited where ``topk_method`` is ``group_limited_greedy``, or V3's
sigmoid grouped top-k with ``e_score_correction_bias`` (noaux_tc); both scale the weights by
``routed_scaling_factor`` (layers/moe.py). Layers before ``first_k_dense_replace`` have a dense MLP.

Tensor parallelism splits the query heads (``num_attention_heads`` must divide by the ranks); the
latent projection and the latent pool are replicated on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.common import GatedMLP, load_named_weights
from servelm.model.architectures.llama import LlamaDecoderLayer, LlamaForCausalLM
from servelm.model.architectures.moe_block import RoutedExpertsBlock
from servelm.model.attention import Attention, LatentAttention
from servelm.model.forward_batch import ForwardBatch
from servelm.model.layers.linear import ColumnParallelLinear, LoRAGroup, RowParallelLinear, dense_linear
from servelm.model.layers.moe import Routing, route_group_limited, route_noaux_tc
from servelm.model.layers.norm import RMSNorm
from servelm.model.layers.rotary import RotaryEmbedding, rope_parameters, yarn_softmax_scale

DISABLE_MLA = "disable_mla"
"""The ``hf_config`` attribute ``--disable-mla`` sets (model/source.py): True runs the expanded form."""

_LOW_RANK_NORM_EPS = 1e-6
"""The eps of ``q_a_layernorm`` and ``kv_a_layernorm`` (transformers' default, not ``rms_norm_eps``)."""


def has_latent_attention(hf_config: Any) -> bool:
    """Whether the config describes DeepSeek's multi-head latent attention."""
    return getattr(hf_config, "kv_lora_rank", None) is not None


class _HeadRows(nn.Module):
    """A bias-free projection whose output rows are per-head blocks of ``rows_per_head``; this rank
    holds its heads' blocks. Its weight stays a plain float tensor (no LinearBase: --quantization
    leaves it alone) because latent attention reads it per head, ``[heads, rows_per_head, input]``."""

    def __init__(self, input_size: int, num_heads: int, rows_per_head: int, heads: Any) -> None:
        super().__init__()
        self.heads, self.rows_per_head = heads, rows_per_head
        self.full_rows = num_heads * rows_per_head
        self.weight = nn.Parameter(torch.empty(heads.size * rows_per_head, input_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight)

    def per_head(self) -> torch.Tensor:
        return self.weight.view(self.heads.size, self.rows_per_head, -1)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if tuple(loaded.shape) != (self.full_rows, param.shape[1]):
            raise ValueError(f"kv_b_proj of shape {tuple(loaded.shape)}, expected {(self.full_rows, param.shape[1])}")
        param.data.copy_(loaded.narrow(0, self.heads.start * self.rows_per_head, param.shape[0]))


class _DeepseekAttention(nn.Module):
    """The projections both forms share; ``_project`` gives the queries, latent and rope key."""

    has_flat_decode = False

    def __init__(self, hf_config: Any, parallel: ParallelContext) -> None:
        super().__init__()
        num_heads = hf_config.num_attention_heads
        if num_heads % parallel.tp_size:
            raise ValueError(f"--tp-size {parallel.tp_size}: DeepSeek's {num_heads} attention heads do not "
                             "divide evenly over the ranks")
        hidden, bias = hf_config.hidden_size, bool(getattr(hf_config, "attention_bias", False))
        self.nope_dim, self.rope_dim = hf_config.qk_nope_head_dim, hf_config.qk_rope_head_dim
        self.v_dim, self.latent_dim = hf_config.v_head_dim, hf_config.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        heads = parallel.split(num_heads)
        self.num_heads = heads.size
        replicated = ParallelContext.single()
        q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        self.q_head_proj: ColumnParallelLinear | None = None
        """The checkpoint's ``q_proj`` (renamed: common.STACKED_PARAMS takes ``q_proj`` for a QKV shard)."""
        self.q_a_proj: ColumnParallelLinear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if q_lora_rank is None:
            self.q_head_proj = ColumnParallelLinear(hidden, num_heads * qk_dim, parallel=parallel)
        else:
            self.q_a_proj = ColumnParallelLinear(hidden, q_lora_rank, bias, parallel=replicated)
            self.q_a_layernorm = RMSNorm(q_lora_rank, _LOW_RANK_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(q_lora_rank, num_heads * qk_dim, parallel=parallel)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, self.latent_dim + self.rope_dim, bias,
                                                       parallel=replicated)
        self.kv_a_layernorm = RMSNorm(self.latent_dim, _LOW_RANK_NORM_EPS)
        self.kv_b_proj = _HeadRows(self.latent_dim, num_heads, self.nope_dim + self.v_dim, heads)
        self.o_proj = RowParallelLinear(num_heads * self.v_dim, hidden, bias, parallel=parallel)
        params = rope_parameters(hf_config)
        self.rotary_emb = RotaryEmbedding(self.rope_dim, params)
        self.interleaved = (hf_config.model_type == "deepseek_v2"
                            or bool(getattr(hf_config, "rope_interleave", False)))
        self.scale = yarn_softmax_scale(params, qk_dim ** -0.5)

    def _project(self, hidden: torch.Tensor, batch: ForwardBatch
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_nope ``[T, H, nope]``, q_pe ``[T, H, rope]`` and k_pe ``[T, 1, rope]`` (both roped), and
        the normed latent c ``[T, kv_lora_rank]``."""
        lora, rows = batch.lora, batch.rows
        if self.q_head_proj is not None:
            q = self.q_head_proj(hidden, lora, rows)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden, lora, rows)), lora, rows)
        q_nope, q_pe = q.view(-1, self.num_heads, self.nope_dim + self.rope_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(hidden, lora, rows).split([self.latent_dim, self.rope_dim], dim=-1)
        q_pe, k_pe = self.rotary_emb(batch.positions, self._rope_layout(q_pe),
                                     self._rope_layout(k_pe.view(-1, 1, self.rope_dim)), batch.rope_cache)
        return q_nope, q_pe, k_pe, self.kv_a_layernorm(c.contiguous())

    def _rope_layout(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` with its interleaved rope pairs as halves (a fresh tensor: rope turns it in place)."""
        if self.interleaved:
            return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return x.contiguous()


class DeepseekLatentAttention(_DeepseekAttention):
    """MLA in its absorbed form over the latent pool (see the module docstring)."""

    def __init__(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> None:
        super().__init__(hf_config, parallel)
        self.attn = LatentAttention(layer_id, self.num_heads, self.latent_dim, self.rope_dim, self.scale,
                                    (self.nope_dim + self.rope_dim, self.v_dim))

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q_nope, q_pe, k_pe, c = self._project(hidden, batch)
        weight = self.kv_b_proj.per_head()                                   # [H, nope + v, latent]
        w_uk, w_uv = weight[:, :self.nope_dim], weight[:, self.nope_dim:]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)   # [T, H, latent]
        q = torch.cat((q_latent, q_pe), dim=-1)
        latent = torch.cat((c, k_pe.view(-1, self.rope_dim)), dim=-1).unsqueeze(1)   # [T, 1, latent + rope]
        attended = self.attn(q, latent, batch).view(-1, self.num_heads, self.latent_dim)
        out = torch.bmm(attended.transpose(0, 1), w_uv.transpose(1, 2))     # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(-1, self.num_heads * self.v_dim), batch.lora, batch.rows)


class DeepseekExpandedAttention(_DeepseekAttention):
    """``--disable-mla``: the latent expanded to per-head K and V, cached as such."""

    def __init__(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> None:
        super().__init__(hf_config, parallel)
        self.attn = Attention(layer_id, self.num_heads, self.num_heads, self.nope_dim + self.rope_dim,
                              self.scale, v_head_dim=self.v_dim)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q_nope, q_pe, k_pe, c = self._project(hidden, batch)
        k_nope, v = self.kv_b_proj(c).view(-1, self.num_heads, self.nope_dim + self.v_dim).split(
            [self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.expand(-1, self.num_heads, -1)), dim=-1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        return self.o_proj(self.attn(q, k, v.contiguous(), batch), batch.lora, batch.rows)


class DeepseekRouter(nn.Module):
    """The router's float32 weight ``[E, H]`` (and V3's ``e_score_correction_bias`` ``[E]``) and its
    routing rule; ``forward(x) -> Routing``."""

    def __init__(self, hf_config: Any, has_correction_bias: bool) -> None:
        super().__init__()
        num_experts = int(hf_config.n_routed_experts)
        self.top_k = int(hf_config.num_experts_per_tok)
        if not 0 < self.top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be in [1, {num_experts}]")
        self.num_groups = int(getattr(hf_config, "n_group", None) or 1)
        self.topk_groups = int(getattr(hf_config, "topk_group", None) or self.num_groups)
        if num_experts % self.num_groups or not 0 < self.topk_groups <= self.num_groups:
            raise ValueError(f"n_group {self.num_groups} / topk_group {self.topk_groups} do not fit "
                             f"{num_experts} routed experts")
        self.scaling = float(getattr(hf_config, "routed_scaling_factor", 1.0))
        self.renormalize = bool(getattr(hf_config, "norm_topk_prob", False))
        self.weight = nn.Parameter(torch.empty(num_experts, hf_config.hidden_size, dtype=torch.float32),
                                   requires_grad=False)
        self.e_score_correction_bias: nn.Parameter | None = None
        if has_correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)
            return
        method = getattr(hf_config, "topk_method", None) or "greedy"
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {method!r}: greedy or group_limited_greedy")
        if method == "greedy":
            self.num_groups = self.topk_groups = 1

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x.float(), self.weight.float())
        if self.e_score_correction_bias is None:
            return route_group_limited(logits, self.top_k, self.num_groups, self.topk_groups, self.scaling)
        return route_noaux_tc(logits, self.e_score_correction_bias, self.top_k, self.num_groups,
                              self.topk_groups, self.renormalize, self.scaling)


class DeepseekMoE(RoutedExpertsBlock):
    """Routed experts plus the shared experts (no gate on them): ``forward(x [T, H]) -> [T, H]``."""

    def __init__(self, hf_config: Any, has_correction_bias: bool, parallel: ParallelContext) -> None:
        hidden, intermediate = hf_config.hidden_size, hf_config.moe_intermediate_size
        super().__init__(int(hf_config.n_routed_experts), hidden, intermediate, hf_config.hidden_act, parallel)
        self.gate = DeepseekRouter(hf_config, has_correction_bias)
        num_shared = int(getattr(hf_config, "n_shared_experts", None) or 0)
        self.shared_experts = (GatedMLP(hidden, intermediate * num_shared, hf_config.hidden_act, parallel=parallel)
                               if num_shared else None)

    def forward(self, x: torch.Tensor, lora: Sequence[LoRAGroup] | None = None, rows: Any = None) -> torch.Tensor:
        out = self.run_experts(x, self.gate(x), rows)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, lora, rows)
        return out


def deepseek_attention(hf_config: Any, layer_id: int, parallel: ParallelContext) -> _DeepseekAttention:
    """Layer ``layer_id``'s attention: latent, or expanded under ``--disable-mla``."""
    if getattr(hf_config, DISABLE_MLA, False):
        return DeepseekExpandedAttention(hf_config, layer_id, parallel)
    return DeepseekLatentAttention(hf_config, layer_id, parallel)


CHECKPOINT_LEAVES = {"q_head_proj": "q_proj"}
"""Our module -> the checkpoint's (``q_proj`` is ``q_head_proj``: see _DeepseekAttention)."""


def our_name(checkpoint_name: str) -> str:
    """A checkpoint tensor's name in our modules (``CHECKPOINT_LEAVES``)."""
    for ours, theirs in CHECKPOINT_LEAVES.items():
        checkpoint_name = checkpoint_name.replace(f".self_attn.{theirs}.", f".self_attn.{ours}.")
    return checkpoint_name


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    has_correction_bias = False
    """V3's router (sigmoid, bias-corrected grouped top-k) instead of V2's softmax one."""
    checkpoint_leaves = CHECKPOINT_LEAVES
    """Module names that differ from the checkpoint's (the GGUF blocks find their tensors by it)."""

    def build_attention(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        return deepseek_attention(hf_config, layer_id, parallel)

    def build_mlp(self, hf_config: Any, layer_id: int, parallel: ParallelContext) -> nn.Module:
        if layer_id < int(getattr(hf_config, "first_k_dense_replace", 0) or 0):
            return super().build_mlp(hf_config, layer_id, parallel)
        return DeepseekMoE(hf_config, self.has_correction_bias, parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint layers past ``num_hidden_layers`` (V3's multi-token-prediction layer) are
        skipped: ``DeepseekMtpLayer`` loads them as the NEXTN draft (model/mtp.py)."""
        num_layers = self.hf_config.num_hidden_layers
        return super().load_weights(
            (our_name(name), tensor) for name, tensor in weights if not _is_layer_at_or_after(name, num_layers))


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    has_correction_bias = True


def mtp_layer_prefix(hf_config: Any) -> str | None:
    """The checkpoint prefix of the multi-token-prediction layer NEXTN drafts with (the first, as
    SGLang and vLLM use it: ``model.layers.{num_hidden_layers}.``); None where the config has none."""
    if not has_latent_attention(hf_config) or not int(getattr(hf_config, "num_nextn_predict_layers", 0) or 0):
        return None
    return f"model.layers.{hf_config.num_hidden_layers}."


class _SharedHead(nn.Module):
    """The MTP layer's ``shared_head``: its norm before the LM head (the head is the model's)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class DeepseekMtpLayer(nn.Module):
    """DeepSeek-V3's multi-token-prediction module as a draft head (``model/mtp.py``). Its entry at
    position p reads the token at p + 1 and a feature of position p (the model's last hidden state,
    after its final norm; in a chain, this module's own output of the entry before):

        h = layer(eh_proj([enorm(embed(token)); hnorm(feature)]))

    ``layer`` is a decoder layer built as the model's (MLA, the experts with the model's router);
    the logits are the model's LM head over ``shared_head.norm(h)``, and ``h`` is the feature of the
    next chained step (the paper's h_i^k). The embedding and LM head are the model's (the checkpoint
    stores copies). Parameter names are the checkpoint's after its ``model.layers.{L}.`` prefix,
    the decoder layer's under ``layer.``."""

    OWN_PARTS = ("enorm", "hnorm", "eh_proj", "shared_head")
    """Checkpoint names (after the prefix) that are this module's own; the rest are the layer's."""

    def __init__(self, hf_config: Any, model: DeepseekV2ForCausalLM) -> None:
        super().__init__()
        hidden, eps = hf_config.hidden_size, hf_config.rms_norm_eps
        single = ParallelContext.single()
        self.embed_tokens: nn.Module | None = None
        """None: the model's embedding (``model.eagle.DraftHeadRunner``)."""
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = ColumnParallelLinear(2 * hidden, hidden, parallel=single)
        # its pool holds this one layer (index 0); the MLP is the one layer num_hidden_layers gets
        self.layer = LlamaDecoderLayer(hf_config, model.build_attention(hf_config, 0, single),
                                       model.build_mlp(hf_config, hf_config.num_hidden_layers, single))
        self.shared_head = _SharedHead(hidden, eps)

    def forward(self, batch: ForwardBatch, embeds: torch.Tensor, features: torch.Tensor,
                is_target_feature: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(for the logits, the next step's feature), both ``[num_tokens, hidden]``; the model's
        features and this module's own go through the same ``hnorm``."""
        hidden = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(features)), dim=-1))
        hidden = self.layer(hidden, batch)
        return self.shared_head.norm(hidden), hidden

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], prefix: str) -> set[str]:
        """The checkpoint's ``prefix`` tensors (other names are not passed in); the copies of the
        embedding and LM head are skipped."""
        def rename(name: str) -> str | None:
            local = our_name(name)[len(prefix):]
            if local.startswith(("embed_tokens.", "shared_head.head.")):
                return None
            return local if local.split(".", 1)[0] in self.OWN_PARTS else f"layer.{local}"
        return load_named_weights(self, weights, rename)


def _is_layer_at_or_after(name: str, num_layers: int) -> bool:
    prefix = "model.layers."
    if not name.startswith(prefix):
        return False
    index = name[len(prefix):].split(".", 1)[0]
    return index.isdigit() and int(index) >= num_layers
