"""Embeddings: which task a model serves, how its hidden states are pooled, and the pooling itself.

A model serves one task (``--task``): ``generate`` (logits and sampling) or ``embed`` (one vector
per prompt). ``auto`` picks embed for encoder-only architectures (BERT) and generate otherwise.

Pooling turns the final hidden states of one prompt (after the final norm for decoders; BERT's
last layer output) into one vector:
- ``last``: the last token's state (a causal decoder: the only token that saw the whole prompt);
- ``mean``: the mean over every token of the prompt (sentence-transformers' mean pooling);
- ``cls``: the first token's state (BERT's [CLS]);
then, with ``normalize``, divided by its L2 norm.

Defaults: a sentence-transformers directory says what it does in ``modules.json`` (a Pooling
module and its ``config.json``, and whether a Normalize module follows); another encoder gets mean
+ normalize; a decoder gets last + normalize. ``--override-pooler-config`` (a JSON object) wins.

Invariants:
- Every pooled sequence is a whole prompt computed in one forward (the scheduler never chunks an
  embedding request), so ``query_lens`` are the prompts' lengths and the rows are packed in order.
- Pooling runs in float32 whatever the model dtype.
- Matryoshka truncation (``dimensions`` smaller than the hidden size) is allowed only when the
  pooler config says the model was trained for it; truncating then renormalizing a normalized
  vector equals normalizing the truncated raw vector, so the server may truncate after pooling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from servelm.config import POOLING_TYPES, parse_pooler_override

TASKS = ("generate", "embed")
_UNSUPPORTED_TASKS = ("classify", "score", "reward")
_ST_POOLING_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean",
                     "pooling_mode_lasttoken": "last"}


@dataclass(frozen=True)
class PoolerConfig:
    """How one embedding model turns hidden states into a vector."""

    pooling_type: str
    """last, mean or cls (see the module docstring)."""
    normalize: bool
    """Divide each vector by its L2 norm."""
    is_matryoshka: bool = False
    """The model was trained so that leading dimensions form a smaller embedding."""
    matryoshka_dimensions: tuple[int, ...] | None = None
    """With is_matryoshka, the sizes it supports; None: any size up to the hidden size."""

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type {self.pooling_type!r} is not supported; choose from "
                             f"{', '.join(POOLING_TYPES)}")

    def allows_dimensions(self, dimensions: int, hidden_size: int) -> bool:
        """True when an embedding of ``dimensions`` values can be served."""
        if dimensions == hidden_size:
            return True
        if not self.is_matryoshka or not 1 <= dimensions <= hidden_size:
            return False
        return self.matryoshka_dimensions is None or dimensions in self.matryoshka_dimensions

    def as_dict(self) -> dict[str, Any]:
        return {"pooling_type": self.pooling_type, "normalize": self.normalize,
                "is_matryoshka": self.is_matryoshka,
                "matryoshka_dimensions": list(self.matryoshka_dimensions or []) or None}


# -- task -----------------------------------------------------------------------------------------

def is_encoder_only(hf_config: Any) -> bool:
    """True for bidirectional encoders (BERT), which can only embed."""
    from servelm.model.registry import ENCODER_ARCHITECTURES, architecture_name

    return architecture_name(hf_config) in ENCODER_ARCHITECTURES


def resolve_task(task: str, hf_config: Any) -> str:
    """``--task`` (auto, generate, embed or embedding) -> generate or embed for this model."""
    if task in _UNSUPPORTED_TASKS:
        raise ValueError(f"--task {task} is not supported: servelm serves generate and embed only")
    is_encoder = is_encoder_only(hf_config)
    if task == "auto":
        return "embed" if is_encoder else "generate"
    if task in ("embed", "embedding"):
        return "embed"
    if task == "generate" and is_encoder:
        raise ValueError(f"--task generate: {architecture_label(hf_config)} is an encoder-only "
                         "model with no language-model head; serve it with --task embed (or auto)")
    if task != "generate":
        raise ValueError(f"--task {task!r}: choose from auto, generate, embed")
    return task


def architecture_label(hf_config: Any) -> str:
    return str((getattr(hf_config, "architectures", None) or [getattr(hf_config, "model_type", "?")])[0])


# -- pooler config --------------------------------------------------------------------------------

def sentence_transformers_pooling(model_dir: Path) -> dict[str, Any]:
    """Pooling type and normalization from a sentence-transformers directory; {} when it is none."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return {}
    modules = json.loads(modules_file.read_text())
    found: dict[str, Any] = {"normalize": False}
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            config = json.loads((model_dir / module.get("path", "") / "config.json").read_text())
            modes = sorted(key for key, value in config.items()
                           if key.startswith("pooling_mode_") and value is True)
            if len(modes) != 1 or modes[0] not in _ST_POOLING_MODES:
                raise ValueError(f"{model_dir}: sentence-transformers pooling {modes} is not "
                                 "supported (exactly one of cls_token, mean_tokens, lasttoken)")
            found["pooling_type"] = _ST_POOLING_MODES[modes[0]]
        elif kind == "Normalize":
            found["normalize"] = True
        elif kind not in ("Transformer", "Pooling"):
            raise ValueError(f"{model_dir}: sentence-transformers module {module.get('type')!r} is "
                             "not supported (Transformer, Pooling and Normalize are)")
    return found


def resolve_pooler_config(model_path: str, hf_config: Any, override: str | None) -> PoolerConfig:
    """The pooling of an embedding model: model defaults, then the sentence-transformers files,
    then ``--override-pooler-config``."""
    values: dict[str, Any] = {"pooling_type": "mean" if is_encoder_only(hf_config) else "last",
                              "normalize": True}
    for key in ("is_matryoshka", "matryoshka_dimensions"):  # vLLM's --hf-overrides spelling
        if getattr(hf_config, key, None) is not None:
            values[key] = getattr(hf_config, key)
    path = Path(model_path) if model_path else None
    if path is not None and path.is_dir():
        values.update(sentence_transformers_pooling(path))
    values.update(parse_pooler_override(override))
    dims = values.get("matryoshka_dimensions")
    if dims is not None:
        values["matryoshka_dimensions"] = tuple(int(d) for d in dims)
        values.setdefault("is_matryoshka", True)
    return PoolerConfig(**values)


# -- pooling --------------------------------------------------------------------------------------

def pool(hidden: torch.Tensor, query_lens: list[int], config: PoolerConfig) -> torch.Tensor:
    """hidden ``[num_tokens, H]`` (whole prompts packed in order) -> float32 ``[num_seqs, H]``."""
    lens = torch.tensor(query_lens, dtype=torch.int64, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    if config.pooling_type == "last":
        pooled = hidden.index_select(0, ends - 1).float()
    elif config.pooling_type == "cls":
        pooled = hidden.index_select(0, ends - lens).float()
    else:
        seq_index = torch.repeat_interleave(torch.arange(len(query_lens), device=hidden.device), lens)
        sums = torch.zeros(len(query_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seq_index, hidden.float())
        pooled = sums / lens[:, None].float()
    if config.normalize:
        pooled = F.normalize(pooled, p=2, dim=-1)
    return pooled
