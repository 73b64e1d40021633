"""Pieces every decoder-only architecture shares: the gated MLP, layer-type lookup, weight loading.

Weight names follow the HF checkpoints. Fused parameters (``qkv_proj``, ``gate_up_proj``) load from
their HF shards through ``STACKED_PARAMS``, the stacked MoE experts from per-expert tensors through
``FusedMoE.checkpoint_part``; every other tensor loads by its own name.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.layers.activation import ActAndMul
from servelm.model.layers.linear import LinearMethod, LoRAGroup, MergedColumnParallelLinear, RowParallelLinear
from servelm.model.layers.moe import FusedMoE

# (fused parameter, HF shard, shard id)
STACKED_PARAMS: list[tuple[str, str, int | str]] = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


class StackedLinear(nn.Linear):
    """A replicated ``nn.Linear`` whose output stacks equally sized parts that checkpoints keep apart
    (a vision tower's q/k/v, or gate/up): ``weight_loader`` copies one part by its shard id
    (``STACKED_PARAMS``'s), weight and bias alike."""

    def __init__(self, in_features: int, out_features: int, shard_ids: Sequence[int | str], bias: bool = True) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.shard_ids = list(shard_ids)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | str | None = None) -> None:
        assert shard_id in self.shard_ids, f"this stacked projection loads {self.shard_ids}, not {shard_id!r}"
        size = param.shape[0] // len(self.shard_ids)
        index = self.shard_ids.index(shard_id)
        part = param.data[index * size:(index + 1) * size]
        assert part.shape == loaded.shape, f"{tuple(loaded.shape)} != {tuple(part.shape)}"
        part.copy_(loaded)


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one column-parallel projection."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False,
                 linear_method: LinearMethod | None = None, dtype: torch.dtype | None = None, *,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias,
                                                       linear_method, dtype, parallel=parallel)
        self.act = ActAndMul(activation)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, linear_method, dtype,
                                           parallel=parallel)

    def forward(self, x: torch.Tensor, lora: Sequence[LoRAGroup] | None = None, rows: Any = None) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, lora, rows)), lora, rows)


_WINDOW_ON_EVERY_LAYER = ("mistral", "mixtral", "qwen3_moe")
"""Families whose config's ``sliding_window`` (None when off) applies to every layer."""


def layer_sliding_window(hf_config: Any, layer_id: int) -> int | None:
    """The sliding window of one layer, or None for full attention."""
    window = getattr(hf_config, "sliding_window", None)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_id] == "sliding_attention" else None
    if getattr(hf_config, "model_type", "") in _WINDOW_ON_EVERY_LAYER:
        return window
    return None


def head_dim_of(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def load_named_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       rename: Callable[[str], str | None] = lambda name: name) -> set[str]:
    """Load HF-named tensors into ``model``; returns the names of the parameters it filled.

    ``rename`` maps a checkpoint name to ours, or None to skip the tensor. Raises ValueError for a
    tensor that matches no parameter and for parameters left unloaded (a mismatched checkpoint).
    """
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for checkpoint_name, tensor in weights:
        name = rename(checkpoint_name)
        if name is None or name.endswith("rotary_emb.inv_freq"):
            continue
        shard_id: Any = None
        expert_part = FusedMoE.checkpoint_part(name)   # one expert's tensor of a stacked MoE weight
        if expert_part is not None:
            name, shard_id = expert_part
        for fused, shard, sid in STACKED_PARAMS if expert_part is None else ():
            if f".{shard}." in name:
                name, shard_id = name.replace(f".{shard}.", f".{fused}."), sid
                break
        if name not in params:
            raise ValueError(f"checkpoint tensor {checkpoint_name!r} matches no parameter of "
                             f"{type(model).__name__}")
        param = params[name]
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        loader = getattr(owner, "weight_loader", None)
        if shard_id is not None:
            assert loader is not None, f"{name} is fused but its module has no weight_loader"
            loader(param, tensor, shard_id)
        elif loader is not None:
            loader(param, tensor)
        else:
            assert param.shape == tensor.shape, f"{name}: {tuple(tensor.shape)} != {tuple(param.shape)}"
            param.data.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    missing += [f"{name} {part}" for name, module in model.named_modules() if isinstance(module, FusedMoE)
                for part in module.missing_parts()]
    if missing:
        raise ValueError(f"checkpoint has no weights for {len(missing)} parameters, e.g. {missing[:5]}")
    return loaded


class MissingLayer(nn.Module):
    """A decoder layer that another pipeline stage holds: no parameters, never called (it keeps the
    layer indices, and so the checkpoint names, of the layers this stage does hold)."""

    def forward(self, *args: Any) -> torch.Tensor:
        raise AssertionError("a layer of another pipeline stage was called")


def stage_layers(num_layers: int, parallel: ParallelContext, build: Callable[[int], nn.Module]) -> nn.ModuleList:
    """``num_layers`` decoder layers: ``build(i)`` for this pipeline stage's, MissingLayer elsewhere."""
    held = parallel.layer_range(num_layers)
    return nn.ModuleList(build(i) if i in held else MissingLayer() for i in range(num_layers))


def stage_rename(name: str | None, parallel: ParallelContext, num_layers: int,
                 tie_word_embeddings: bool) -> str | None:
    """A checkpoint name (already in our naming) as this pipeline stage loads it, or None for a
    tensor another stage holds. The first stage holds the embedding, the last the final norm and
    the LM head; a last stage without the embedding loads a tied head from ``embed_tokens``."""
    if name is None or parallel.pp_size == 1:
        return name
    if name.startswith("model.layers."):
        return name if int(name.split(".")[2]) in parallel.layer_range(num_layers) else None
    if name.startswith("model.embed_tokens."):
        if parallel.is_first_stage:
            return name
        if tie_word_embeddings and parallel.is_last_stage:
            return "lm_head." + name.removeprefix("model.embed_tokens.")
        return None
    if name.startswith("model.norm."):
        return name if parallel.is_last_stage else None
    if name.startswith("lm_head."):
        return name if parallel.is_last_stage and not tie_word_embeddings else None
    return name


def embed_tokens_and_images(embed_tokens: nn.Module, batch: Any) -> torch.Tensor:
    """The token embeddings of ``batch.input_ids``, with the rows of ``batch.mm_rows`` (image
    placeholders) replaced by ``batch.mm_embeds`` (the encoded images, unscaled: transformers
    merges them after the embedding's own scale). A placeholder id may lie past the vocabulary,
    so those rows look up id 0 first."""
    if batch.mm_rows is None:
        return embed_tokens(batch.input_ids)
    hidden = embed_tokens(batch.input_ids.index_fill(0, batch.mm_rows, 0))
    return hidden.index_copy(0, batch.mm_rows, batch.mm_embeds.to(hidden.dtype))


def set_residual_dtype(model: nn.Module, dtype: torch.dtype) -> bool:
    """Give every decoder body of ``model`` (a module with a ``residual_dtype`` class attribute:
    LlamaModel, Gemma3Model) its residual stream's dtype; False where there is none (encoders).
    With a float32 stream the projections whose outputs join it (each layer's o_proj and down_proj)
    get ``float_residual_output``: a linear method that accumulates in float32 (GGUF blocks) then
    returns their outputs unrounded."""
    bodies = [module for module in model.modules() if hasattr(type(module), "residual_dtype")]
    for body in bodies:
        body.residual_dtype = dtype
        for layer in body.layers:
            attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            for linear in (getattr(attention, "o_proj", None), getattr(mlp, "down_proj", None)):
                if linear is not None:
                    linear.float_residual_output = dtype == torch.float32
    return bool(bodies)
