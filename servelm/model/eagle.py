"""EAGLE and EAGLE-3 draft heads: the published checkpoint formats, the target's hidden states they
read, and a small runner with its own KV pool.

An EAGLE head is one (or a few) decoder layers that predict the target's next token from the
target's own features. Its entry at position p reads the token at p + 1 and a feature of position
p, so a chain of drafts continues from the target's last computed position:

- EAGLE (``LlamaForCausalLMEagle``, SGLang's name for the EAGLE-1 checkpoints): the feature is the
  target's last hidden state (after its final norm); ``fc`` maps [embedding(token), feature]
  (2 x hidden) to hidden, then decoder layers (the first without an input norm); the target's LM
  head turns the output into logits, and the output itself is the next entry's feature.
- EAGLE-3 (``LlamaForCausalLMEagle3``): the feature is three of the target's hidden layers (low,
  middle, high: the residual stream entering layers ``eagle3_layer_ids``) concatenated, which
  ``fc`` (3 x hidden -> hidden) reduces; the one decoder layer (``midlayer``) normalises the
  embedding (``input_layernorm``) and the feature (``hidden_norm``) separately and attends over
  their concatenation (q/k/v take 2 x hidden); its own ``norm`` and ``lm_head`` score a reduced
  draft vocabulary, whose token d is target token ``d + d2t[d]``. Later entries of a chain read the
  head's own pre-norm output as their feature (no ``fc``).

Both share the target's token embedding unless the checkpoint carries ``embed_tokens.weight``.

Invariants:
- The head's KV pool (``EagleHeadRunner``) has one layer per head layer and is separate from the
  model's; its block ids come from the proposer's own free list (``spec/eagle.py``).
- ``HiddenCapture`` costs nothing unless installed: it is a set of forward hooks the engine puts
  on the target model only with --speculative-algorithm EAGLE/EAGLE3; after each forward it holds
  the feature of every token of the plan, in plan order.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.common import GatedMLP, head_dim_of, load_named_weights
from servelm.model.attention import Attention
from servelm.model.forward_batch import BatchPlan, DraftTree, ForwardBatch, SequencePlan
from servelm.model.kv_cache import KVCache
from servelm.model.layers.embedding import VocabEmbedding
from servelm.model.layers.linear import (
    ColumnParallelLinear, QKVParallelLinear, RowParallelLinear, dense_linear)
from servelm.model.layers.norm import RMSNorm
from servelm.model.layers.rotary import RotaryEmbedding, rope_parameters

logger = logging.getLogger(__name__)

EAGLE_ARCHITECTURES = {"EAGLE": "LlamaForCausalLMEagle", "EAGLE3": "LlamaForCausalLMEagle3"}
"""--speculative-algorithm -> the ``architectures`` entry its head checkpoint declares."""

_SKIPPED_TENSORS = ("rotary_emb.inv_freq",)


def eagle3_layer_ids(num_layers: int, hf_config: Any = None) -> list[int]:
    """The target layers whose input (residual stream) EAGLE-3 reads: the head config's
    ``eagle_config.eagle_aux_hidden_state_layer_ids`` (layer outputs, so + 1) when given, else
    (2, L // 2, L - 3) as the published heads were trained; kept within 0..L (L: the final
    pre-norm output)."""
    eagle_config = getattr(hf_config, "eagle_config", None) or {}
    given = eagle_config.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle_config, dict) else None
    ids = [i + 1 for i in given] if given else [2, num_layers // 2, num_layers - 3]
    return [min(max(i, 0), num_layers) for i in ids]


class HiddenCapture:
    """Forward hooks on a decoder model that keep the features an EAGLE head reads.

    ``layer_ids`` None: the model body's output (the last hidden state after the final norm,
    EAGLE); else the residual stream entering each listed layer (L: the body's pre-norm output),
    concatenated in that order (EAGLE-3). ``take()`` hands over the last forward's
    ``[num_tokens, width]`` and forgets it."""

    def __init__(self, model: nn.Module, layer_ids: list[int] | None) -> None:
        body = getattr(model, "model", None)
        layers = getattr(body, "layers", None)
        if body is None or layers is None:
            raise ValueError(f"EAGLE heads read a decoder's hidden states; {type(model).__name__} has "
                             "no model.layers")
        self.layer_ids = layer_ids
        self._parts: dict[int, torch.Tensor] = {}
        self._states: torch.Tensor | None = None
        self._handles = [body.register_forward_hook(self._on_body_output)]
        for layer_id in layer_ids or []:
            if layer_id < len(layers):
                self._handles.append(layers[layer_id].register_forward_pre_hook(
                    lambda module, args, layer_id=layer_id: self._keep(layer_id, args[0])))
            else:
                self._handles.append(layers[-1].register_forward_hook(
                    lambda module, args, output, layer_id=layer_id: self._keep(layer_id, output)))
        hidden_size = int(getattr(model, "hf_config").hidden_size)
        self.width = hidden_size * (len(layer_ids) if layer_ids else 1)

    def _keep(self, layer_id: int, hidden: torch.Tensor) -> None:
        self._parts[layer_id] = hidden

    def _on_body_output(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if self.layer_ids is None:
            self._states = output
        else:
            # layer outputs are residual-stream states (float32 with --residual-dtype float32); the
            # head's fc takes the model dtype, which the body's normed output carries
            self._states = torch.cat([self._parts[i] for i in self.layer_ids], dim=-1).to(output.dtype)
            self._parts.clear()

    def take(self) -> torch.Tensor | None:
        states, self._states = self._states, None
        return states

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


class _HeadAttention(nn.Module):
    def __init__(self, config: Any, input_size: int, layer_id: int, parallel: ParallelContext) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        head_dim = head_dim_of(config)
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(input_size, head_dim, num_heads, num_kv_heads, bias=bias,
                                          parallel=parallel)
        self.o_proj = RowParallelLinear(num_heads * head_dim, config.hidden_size, bias=bias,
                                        parallel=parallel)
        self.rotary_emb = RotaryEmbedding(head_dim, rope_parameters(config))
        self.attn = Attention(layer_id, num_heads, num_kv_heads, head_dim, scale=head_dim ** -0.5)

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj.split(self.qkv_proj(hidden))  # [T, H, D], [T, Hkv, D], [T, Hkv, D]
        q, k = self.rotary_emb(batch.positions, q, k, batch.rope_cache)
        return self.o_proj(self.attn(q, k, v, batch))


class _HeadLayer(nn.Module):
    """A Llama decoder layer; EAGLE's first has no input norm, EAGLE-3's (``midlayer``) attends
    over [input_layernorm(embedding), hidden_norm(feature)]."""

    def __init__(self, config: Any, layer_id: int, is_eagle3: bool, parallel: ParallelContext) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_eagle3 = is_eagle3
        self.self_attn = _HeadAttention(config, 2 * hidden if is_eagle3 else hidden, layer_id, parallel)
        self.mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act,
                            bias=getattr(config, "mlp_bias", False), parallel=parallel)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.input_layernorm = RMSNorm(hidden, eps) if is_eagle3 or layer_id > 0 else None
        self.hidden_norm = RMSNorm(hidden, eps) if is_eagle3 else None

    def forward(self, hidden: torch.Tensor, batch: ForwardBatch,
                embeds: torch.Tensor | None = None) -> torch.Tensor:
        if self.is_eagle3:
            assert embeds is not None and self.input_layernorm is not None and self.hidden_norm is not None
            x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        else:
            x = hidden if self.input_layernorm is None else self.input_layernorm(hidden)
        hidden = hidden + self.self_attn(x, batch)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class EagleHead(nn.Module):
    """``forward(batch, embeds, features, is_target_feature) -> (for_logits, next_feature)``, both
    ``[num_tokens, hidden]``; names follow the checkpoints (``fc``, ``layers.N`` / ``midlayer``,
    ``norm``, ``lm_head``, ``embed_tokens``)."""

    def __init__(self, config: Any, is_eagle3: bool, target_hidden_size: int, has_fc_bias: bool,
                 has_embedding: bool, vocab_size: int) -> None:
        super().__init__()
        parallel = ParallelContext.single()
        hidden = config.hidden_size
        self.is_eagle3 = is_eagle3
        fc_input = 3 * target_hidden_size if is_eagle3 else 2 * hidden
        self.fc = ColumnParallelLinear(fc_input, hidden, bias=has_fc_bias, parallel=parallel)
        self.embed_tokens = VocabEmbedding(vocab_size, hidden, parallel=parallel) if has_embedding else None
        if is_eagle3:
            self.midlayer = _HeadLayer(config, 0, True, parallel)
            self.norm = RMSNorm(hidden, config.rms_norm_eps)
            self.lm_head = ColumnParallelLinear(hidden, config.draft_vocab_size, bias=False,
                                                parallel=parallel)
        else:
            self.layers = nn.ModuleList(_HeadLayer(config, i, False, parallel)
                                        for i in range(config.num_hidden_layers))

    def forward(self, batch: ForwardBatch, embeds: torch.Tensor, features: torch.Tensor,
                is_target_feature: bool) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_eagle3:
            hidden = self.fc(features) if is_target_feature else features
            hidden = self.midlayer(hidden, batch, embeds)
            return self.norm(hidden), hidden
        hidden = self.fc(torch.cat([embeds, features], dim=-1))
        for layer in self.layers:
            hidden = layer(hidden, batch)
        return hidden, hidden


def read_head_config(path: str) -> Any:
    """The head's config.json as a transformers LlamaConfig (ValueError naming what is wrong)."""
    import transformers

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"--speculative-draft-model-path {path!r}: an EAGLE head is a checkpoint "
                         "directory with config.json and its weights (safetensors or .bin)")
    raw = json.loads(config_file.read_text())
    raw.pop("model_type", None)
    return transformers.LlamaConfig(**raw)


def head_architecture(config: Any) -> str | None:
    names = getattr(config, "architectures", None) or []
    return names[0] if names else None


def check_head_config(path: str, algorithm: str, config: Any, target_config: Any) -> None:
    """The head must be the format ``algorithm`` reads and fit the target's hidden size."""
    expected = EAGLE_ARCHITECTURES[algorithm]
    found = head_architecture(config)
    if algorithm == "EAGLE" and found == "LlamaForCausalLM":
        found = expected  # the EAGLE authors' EAGLE-1 heads declare the plain name; tensors decide
    if found != expected:
        other = {v: k for k, v in EAGLE_ARCHITECTURES.items()}.get(found or "")
        hint = f" (an {other} head: --speculative-algorithm {other})" if other else ""
        raise ValueError(f"--speculative-draft-model-path {path!r} declares architecture {found!r}"
                         f"{hint}; --speculative-algorithm {algorithm} reads {expected} checkpoints")
    target_hidden = target_config.get_text_config().hidden_size
    if algorithm == "EAGLE" and config.hidden_size != target_hidden:
        raise ValueError(f"--speculative-draft-model-path {path!r}: EAGLE head hidden size "
                         f"{config.hidden_size} != the model's {target_hidden}")
    if algorithm == "EAGLE3":
        head_target = getattr(config, "target_hidden_size", None) or config.hidden_size
        if head_target != target_hidden:
            raise ValueError(f"--speculative-draft-model-path {path!r}: the EAGLE-3 head reads hidden "
                             f"states of width {head_target}, the model's are {target_hidden}")
        if not getattr(config, "draft_vocab_size", None):
            config.draft_vocab_size = config.vocab_size  # no reduced vocabulary: the model's


def read_head_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the head checkpoint (``*.safetensors``, else ``pytorch_model*.bin``), with
    a leading ``model.`` dropped."""
    directory = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    files = sorted(directory.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        for file in files:
            tensors.update(load_file(str(file)))
    else:
        files = sorted(directory.glob("pytorch_model*.bin"))
        for file in files:
            tensors.update(torch.load(file, map_location="cpu", weights_only=True))
    if not files:
        raise ValueError(f"--speculative-draft-model-path {path!r}: no *.safetensors or "
                         "pytorch_model*.bin weights")
    return {name.removeprefix("model."): tensor for name, tensor in tensors.items()}


def _expected_shapes(head: EagleHead, config: Any) -> dict[str, tuple[int, ...]]:
    """Checkpoint name -> shape for every parameter the head loads (q/k/v and gate/up unfused)."""
    shapes: dict[str, tuple[int, ...]] = {}
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = head_dim_of(config)
    for name, param in head.named_parameters():
        if ".qkv_proj." in name:
            stem, kind = name.rsplit(".qkv_proj.", 1)
            for shard, count in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                shapes[f"{stem}.{shard}_proj.{kind}"] = (count * head_dim, *param.shape[1:])
        elif ".gate_up_proj." in name:
            stem, kind = name.rsplit(".gate_up_proj.", 1)
            half = param.shape[0] // 2
            for shard in ("gate", "up"):
                shapes[f"{stem}.{shard}_proj.{kind}"] = (half, *param.shape[1:])
        else:
            shapes[name] = tuple(param.shape)
    return shapes


def load_head_weights(head: EagleHead, config: Any, tensors: dict[str, torch.Tensor],
                      path: str) -> None:
    """Load the checkpoint, naming the first missing, unknown or mis-shaped tensor."""
    expected = _expected_shapes(head, config)
    for name, tensor in tensors.items():
        if name.endswith(_SKIPPED_TENSORS):
            continue
        if name not in expected:
            raise ValueError(f"--speculative-draft-model-path {path!r}: tensor {name!r} is not part "
                             f"of the {head_architecture(config)} format")
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"--speculative-draft-model-path {path!r}: tensor {name!r} has shape "
                             f"{tuple(tensor.shape)}, the format needs {expected[name]}")
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ValueError(f"--speculative-draft-model-path {path!r}: the checkpoint lacks "
                         f"{len(missing)} tensors of the {head_architecture(config)} format, e.g. "
                         f"{missing[:4]}")
    with torch.no_grad():
        load_named_weights(head, ((n, t) for n, t in tensors.items() if n in expected))


class DraftHeadRunner:
    """A draft head beside a loaded target model (an EAGLE checkpoint's head, DeepSeek's MTP layer
    in ``model/mtp.py``): its KV pool and one batched forward.

    Built in two steps so the engine can size both pools first: the constructor reads only
    configs (``kv_bytes_per_token``); ``init_kv_cache`` records the pool size; ``attach(target_model,
    ...)`` (the subclass's) loads the weights next to the target's and allocates the pool. ``head``
    is called as ``head(batch, embeds, features, is_target_feature) -> (for_logits,
    next_feature)`` and has ``embed_tokens`` (None: the target's)."""

    def __init__(self, algorithm: str, target_config: Any, block_size: int) -> None:
        self.algorithm = algorithm
        self.is_eagle3 = algorithm == "EAGLE3"
        text_config = target_config.get_text_config()
        self.target_hidden_size: int = text_config.hidden_size
        self.vocab_size: int = text_config.vocab_size
        """The target's vocabulary (drafts are target token ids)."""
        self.block_size = block_size
        self.layer_ids: list[int] | None = None
        """Target layers the features come from (None: the last hidden state)."""
        self.num_blocks = 0
        self.head: nn.Module | None = None
        self.kv_cache: KVCache | None = None
        self.draft_to_target: torch.Tensor | None = None
        """``[draft_vocab]`` target id of each logits column (None: the target's own vocabulary)."""
        self._target: nn.Module | None = None
        self._token_map_weight: torch.Tensor | None = None
        self.attention: Any = None
        self.device = torch.device("cpu")

    kv_bytes_per_token: int
    """The head's pool bytes per token, set by the subclass from configs only: float32, an upper
    bound (the pools are sized before the model's dtype is known)."""

    def init_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def attach(self, target: nn.Module, attention: Any, device: torch.device, dtype: torch.dtype,
               kv_dtype: torch.dtype) -> None:
        """Load the head beside ``target`` (sharing what it shares) and allocate its pool."""
        raise NotImplementedError

    def _place(self, head: nn.Module, target: nn.Module, attention: Any, device: torch.device) -> None:
        """Keep the loaded ``head`` beside ``target``."""
        self.head = head.eval()
        self._target = target
        self.attention = attention
        self.device = device
        assert self.num_blocks > 0, "init_kv_cache before attach"

    @torch.inference_mode()
    def forward(self, sequences: list[Any], features: torch.Tensor,
                is_target_feature: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over ``sequences`` (each with ``token_ids``, ``start_position``,
        ``block_ids``; ``features``: one row per token, in order): float32 logits of each
        sequence's last token over the draft vocabulary, and its output feature. A sequence with
        ``tree_parents`` is a tree step (``spec/eagle.py``): every token gets logits, and attends
        through the tree's mask."""
        assert self.head is not None and self.kv_cache is not None and self._target is not None
        plan = BatchPlan([SequencePlan(s.token_ids, s.start_position, s.block_ids, num_logits=1)
                          if getattr(s, "tree_parents", None) is None else
                          SequencePlan(s.token_ids, s.start_position, s.block_ids,
                                       num_logits=len(s.token_ids),
                                       tree=DraftTree(s.tree_first_position, s.tree_parents))
                          for s in sequences])
        for sequence in plan.sequences:
            assert max(sequence.block_ids) < self.num_blocks, "block id outside the head's KV pool"
        batch = ForwardBatch.build(plan, self.block_size, self.device, self.kv_cache, self.attention)
        embedding = self.head.embed_tokens or self._target.model.embed_tokens
        embeds = embedding(batch.input_ids)
        features = features.to(embeds.dtype)
        for_logits, next_feature = self.head(batch, embeds, features, is_target_feature)
        last = batch.logits_indices
        hidden = for_logits.index_select(0, last)
        if self.is_eagle3:
            logits = self.head.lm_head(hidden)
        elif self._token_map_weight is not None:
            logits = dense_linear(hidden, self._token_map_weight)
        else:
            logits = self._target.compute_logits(hidden)
            if self.draft_to_target is not None:
                logits = logits.index_select(-1, self.draft_to_target)
        return logits.float(), next_feature.index_select(0, last)


class EagleHeadRunner(DraftHeadRunner):
    """An EAGLE / EAGLE-3 checkpoint's head: ``EagleHeadRunner(path, algorithm, target_config,
    block_size)`` reads only config.json; ``attach`` loads the weights (sharing the target's
    embedding and, for EAGLE, its LM head)."""

    def __init__(self, path: str, algorithm: str, target_config: Any, block_size: int,
                 token_map: torch.Tensor | None = None) -> None:
        super().__init__(algorithm, target_config, block_size)
        self.path = path
        self.config = read_head_config(path)
        check_head_config(path, algorithm, self.config, target_config)
        text_config = target_config.get_text_config()
        self.num_layers = 1 if self.is_eagle3 else int(self.config.num_hidden_layers)
        self.num_kv_heads = int(getattr(self.config, "num_key_value_heads", None)
                                or self.config.num_attention_heads)
        self.kv_bytes_per_token = KVCache.bytes_per_token(self.num_layers, self.num_kv_heads,
                                                          head_dim_of(self.config), torch.float32)
        self.layer_ids = (eagle3_layer_ids(text_config.num_hidden_layers, self.config)
                          if self.is_eagle3 else None)
        if token_map is not None and self.is_eagle3:
            raise ValueError("--speculative-token-map is for EAGLE heads; an EAGLE-3 head carries its "
                             "own reduced vocabulary (d2t)")
        self.token_map = token_map

    def attach(self, target: nn.Module, attention: Any, device: torch.device, dtype: torch.dtype,
               kv_dtype: torch.dtype) -> None:
        tensors = read_head_tensors(self.path)
        has_embedding = "embed_tokens.weight" in tensors
        with torch.device(device):
            default = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                head = EagleHead(self.config, self.is_eagle3, self.target_hidden_size,
                                 "fc.bias" in tensors, has_embedding, self.vocab_size)
            finally:
                torch.set_default_dtype(default)
        mapping = self._take_vocab_map(tensors)
        load_head_weights(head, self.config, tensors, self.path)
        self._place(head, target, attention, device)
        if mapping is not None:
            self.draft_to_target = mapping.to(device)
        if self.token_map is not None:
            self.draft_to_target = self.token_map.to(device)
            lm_head = getattr(target, "lm_head", None)
            if lm_head is not None and getattr(lm_head, "linear_method", None) is None \
                    and getattr(lm_head, "final_softcap", None) is None:
                self._token_map_weight = lm_head.weight[self.draft_to_target].contiguous()
        self.kv_cache = KVCache(self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads,
                                head_dim_of(self.config), kv_dtype, device)
        logger.info("%s head %s: %d layer(s), %s vocabulary, KV pool %d tokens (%.1f MiB)",
                    self.algorithm, self.path, self.num_layers,
                    f"{len(self.draft_to_target)}-token draft" if self.draft_to_target is not None
                    else "the model's", self.num_blocks * self.block_size, self.kv_cache.nbytes / 2 ** 20)

    def _take_vocab_map(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """EAGLE-3: pop ``d2t`` (and ``t2d``) and return the target id of each draft token."""
        d2t = tensors.pop("d2t", None)
        t2d = tensors.pop("t2d", None)
        if not self.is_eagle3:
            if d2t is not None or t2d is not None:
                raise ValueError(f"--speculative-draft-model-path {self.path!r}: d2t/t2d belong to "
                                 "EAGLE-3 heads (--speculative-algorithm EAGLE3)")
            return None
        draft_vocab = self.config.draft_vocab_size
        if d2t is None:
            if draft_vocab != self.vocab_size:
                raise ValueError(f"--speculative-draft-model-path {self.path!r}: a draft vocabulary of "
                                 f"{draft_vocab} tokens needs the d2t tensor")
            return None
        if tuple(d2t.shape) != (draft_vocab,):
            raise ValueError(f"--speculative-draft-model-path {self.path!r}: d2t has shape "
                             f"{tuple(d2t.shape)}, the draft vocabulary is {draft_vocab}")
        target_ids = torch.arange(draft_vocab, dtype=torch.int64) + d2t.to(torch.int64)
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= self.vocab_size:
            raise ValueError(f"--speculative-draft-model-path {self.path!r}: d2t maps draft tokens "
                             f"outside the model's {self.vocab_size}-token vocabulary")
        if t2d is not None and int(t2d.to(torch.int64).sum()) != draft_vocab:
            raise ValueError(f"--speculative-draft-model-path {self.path!r}: t2d marks "
                             f"{int(t2d.to(torch.int64).sum())} tokens, d2t {draft_vocab}")
        return target_ids
