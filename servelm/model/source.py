"""Model sources: turn ``--model`` into a config, a lazy weight stream, a tokenizer path and limits.

Accepted ``--model`` values, in the order they are tried:
1. an existing path: a ``.gguf`` file, a Hugging Face directory (config.json + *.safetensors,
   sharded or not, or pytorch_model*.bin), or a directory holding a single ``.gguf``;
2. a packaged short name (``servelm.model.packaged``);
3. a hub id, found only in a local cache (``--download-dir`` or ~/.cache/huggingface/hub): the hub
   is never contacted, so an uncached id fails at once with a clear ModelSourceError.

Invariants:
- Weights are yielded lazily, one tensor at a time, HF-named and in HF layout; the source holds no
  tensor itself. ``weights`` is None for ``--load-format dummy``.
- ``hf_config`` has ``--hf-overrides`` applied; the legacy rope keys (``rope_theta``,
  ``rope_scaling``, ``rope_local_base_freq``) are merged into transformers 5's
  ``rope_parameters`` as transformers 4 read them (theta and scaling of the global layers, the
  local base frequency of sliding layers), since transformers 5 ignores them next to
  ``rope_parameters``; ``context_length`` is the effective limit
  (``--context-length`` if given, else the model's ``max_position_embeddings``). Asking for more
  than the model's maximum is a ValueError: we never extend RoPE silently.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from servelm.config import ModelConfig, parse_json_object_flag
from servelm.model.gguf.gguf_file import GGUFFile
from servelm.model.packaged import PACKAGED_MODELS, GENERATIVE_MODEL_NAMES, packaged_model_path

_HF_HUB_CACHE = Path.home() / ".cache" / "huggingface" / "hub"
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
# Extra stop tokens for families whose GGUF lists fewer than upstream's generation_config.
_EXTRA_EOS_TOKENS = {"qwen2": ("<|endoftext|>",), "qwen3": ("<|endoftext|>",)}


class ModelSourceError(ValueError):
    """``--model`` (with its flags) names nothing we can load; the message says what to do."""


@dataclass
class ModelSource:
    """Everything the runner and tokenizer need from a checkpoint, with nothing loaded yet."""

    hf_config: PretrainedConfig   # with --hf-overrides applied
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None  # HF-named tensors; None = dummy
    tokenizer_path: str | None    # HF dir, or a .gguf file (load it with load_tokenizer); None: none
    eos_token_ids: list[int]      # all ids that end generation
    context_length: int           # effective max context in tokens
    description: str              # e.g. "qwen2.5-coder-0.5b (GGUF Q4_K_M, /path/file.gguf)"
    model_path: str = ""          # the local file or directory the model came from
    gguf_path: str | None = None  # set when the weights are a GGUF file
    select_weights: Callable[[Callable[[str], bool]], Iterator[tuple[str, torch.Tensor]]] | None = None
    """The HF-named tensors whose names pass a test, reading only those from safetensors (a
    model's multi-token-prediction layer, model/mtp.py); None where ``weights`` is None or GGUF."""


def resolve_model_source(config: ModelConfig, hub_cache_dir: str | Path | None = None) -> ModelSource:
    """Resolve ``config.model`` to a ModelSource; raises ModelSourceError with what to do."""
    overrides = parse_json_object_flag("--hf-overrides", config.hf_overrides)
    path, label = _locate(config, Path(hub_cache_dir) if hub_cache_dir else _HF_HUB_CACHE)
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    if path.suffix == ".gguf":
        source = _gguf_source(config, path, label, overrides)
    else:
        source = _hf_dir_source(config, path, label, overrides)
    if config.tokenizer is not None:
        source.tokenizer_path = str(Path(config.tokenizer).expanduser())
    if config.skip_tokenizer_init:
        source.tokenizer_path = None
    if config.disable_mla:
        _disable_latent_attention(source.hf_config)
    return source


def _disable_latent_attention(hf_config: PretrainedConfig) -> None:
    """--disable-mla: the DeepSeek architectures read the flag from their config (every path that
    builds the model, rank workers included, resolves its source here)."""
    from servelm.model.architectures.deepseek import DISABLE_MLA, has_latent_attention

    if not has_latent_attention(hf_config):
        raise ModelSourceError(f"--disable-mla: {(getattr(hf_config, 'architectures', None) or ['this model'])[0]} "
                               "has no multi-head latent attention to disable (DeepSeek-V2/V3 have it)")
    setattr(hf_config, DISABLE_MLA, True)


def _locate(config: ModelConfig, hub_cache_dir: Path) -> tuple[Path, str]:
    """The local path of ``config.model`` and a short label for descriptions."""
    name = config.model
    path = Path(name).expanduser()
    if path.exists():
        _refuse_hub_options(config, "a local path")
        return path.resolve(), str(path)
    if name.lower() in PACKAGED_MODELS:
        _refuse_hub_options(config, "a packaged model")
        return packaged_model_path(name), name.lower()
    looks_like_path = name.startswith(("/", ".", "~")) or name.endswith(".gguf") or name.count("/") > 1
    if looks_like_path or not _HUB_ID_RE.match(name):
        raise ModelSourceError(f"--model {name!r}: no such file or directory")
    cached = _find_in_hub_cache(name, config.revision, config.download_dir, hub_cache_dir)
    if cached is not None:
        return cached, name
    noted = [flag for flag, value in (("--revision", config.revision), ("--download-dir", config.download_dir))
             if value]
    raise ModelSourceError(
        f"--model {name!r} looks like a Hugging Face hub id, but the hub is not reachable from "
        f"servelm (no downloads) and no local copy was found in "
        f"{config.download_dir or hub_cache_dir}"
        + (f" ({' and '.join(noted)} noted)" if noted else "")
        + f". Pass a local path (a .gguf file or a Hugging Face directory) or a packaged model: "
        f"{', '.join(GENERATIVE_MODEL_NAMES)}.")


def _refuse_hub_options(config: ModelConfig, what: str) -> None:
    """--revision and --download-dir only mean something for a hub id: refuse rather than ignore."""
    for flag, value in (("--revision", config.revision), ("--download-dir", config.download_dir)):
        if value is not None:
            raise ModelSourceError(f"{flag} {value} has no effect: --model {config.model!r} is "
                                   f"{what}, not a Hugging Face hub id; drop {flag}")


def _find_in_hub_cache(hub_id: str, revision: str | None, download_dir: str | None,
                       hub_cache_dir: Path) -> Path | None:
    """A snapshot of ``hub_id`` already on disk (HF hub cache layout, or download_dir/org/name)."""
    roots = [Path(download_dir).expanduser()] if download_dir else []
    roots.append(hub_cache_dir)
    for root in roots:
        plain = root / hub_id
        if (plain / "config.json").exists():
            return plain
        repo = root / ("models--" + hub_id.replace("/", "--"))
        if not repo.is_dir():
            continue
        ref = repo / "refs" / (revision or "main")
        commit = ref.read_text().strip() if ref.is_file() else revision
        snapshots = repo / "snapshots"
        if commit and (snapshots / commit / "config.json").exists():
            return snapshots / commit
        if revision is None and snapshots.is_dir():
            candidates = [s for s in sorted(snapshots.iterdir()) if (s / "config.json").exists()]
            if len(candidates) == 1:
                return candidates[0]
    return None


def _context_length(config: ModelConfig, hf_config: PretrainedConfig, label: str) -> int:
    text_config = hf_config.get_text_config()
    model_max = getattr(text_config, "max_position_embeddings", None)
    if model_max is not None and getattr(text_config, "model_type", None) == "mpnet":
        model_max -= text_config.pad_token_id + 1  # positions start after the padding id
    if config.context_length is None:
        if model_max is None:
            raise ModelSourceError(f"{label}: the model config has no max_position_embeddings; "
                                   "pass --context-length")
        return int(model_max)
    if model_max is not None and config.context_length > model_max:
        raise ValueError(f"--context-length={config.context_length} exceeds the maximum of {label} "
                         f"({model_max} tokens, max_position_embeddings); to go beyond it, change the "
                         f"RoPE settings with --hf-overrides")
    return config.context_length


def _unique_ids(*groups: Any) -> list[int]:
    ids: list[int] = []
    for group in groups:
        for token_id in ([group] if isinstance(group, int) else (group or [])):
            if isinstance(token_id, int) and token_id not in ids:
                ids.append(token_id)
    return ids


# -- GGUF ---------------------------------------------------------------------------------------

def _gguf_source(config: ModelConfig, path: Path, label: str, overrides: dict[str, Any]) -> ModelSource:
    if config.load_format not in ("auto", "gguf", "dummy"):
        raise ModelSourceError(f"--load-format {config.load_format} does not match {path} (a GGUF file)")
    gguf = GGUFFile.open(path)
    hf_config = gguf.hf_config(overrides)
    extra = [gguf.token_id(token) for token in _EXTRA_EOS_TOKENS.get(gguf.architecture, ())]
    eos = _unique_ids(hf_config.eos_token_id, [i for i in extra if i is not None])
    weights = None if config.load_format == "dummy" else (lambda: GGUFFile.open(path).tensors())
    return ModelSource(
        hf_config=hf_config,
        weights=weights,
        tokenizer_path=str(path),
        eos_token_ids=eos,
        context_length=_context_length(config, hf_config, label),
        description=f"{label} (GGUF {gguf.quantization}, {path})",
        model_path=str(path),
        gguf_path=str(path),
    )


# -- Hugging Face directories -------------------------------------------------------------------

def _hf_dir_source(config: ModelConfig, path: Path, label: str, overrides: dict[str, Any]) -> ModelSource:
    if not (path / "config.json").exists():
        raise ModelSourceError(f"{path} is not a model directory: it has no config.json and no single "
                               ".gguf file")
    if config.load_format == "gguf":
        raise ModelSourceError(f"--load-format gguf, but {path} is a Hugging Face directory")
    hf_config = _hf_dir_config(path, overrides)
    weights: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = None
    select_weights: Callable[[Callable[[str], bool]], Iterator[tuple[str, torch.Tensor]]] | None = None
    weight_format = "dummy weights"
    if config.load_format != "dummy":
        files, weight_format = _weight_files(path, config.load_format)
        read = _iter_safetensors if weight_format == "safetensors" else _iter_torch_bins
        weights = select_weights = functools.partial(read, files)
        weight_format = f"{weight_format}, {len(files)} file{'s' if len(files) > 1 else ''}"
    return ModelSource(
        hf_config=hf_config,
        weights=weights,
        select_weights=select_weights,
        tokenizer_path=str(path),
        eos_token_ids=_dir_eos_ids(path, hf_config),
        context_length=_sentence_transformers_limit(config, path, _context_length(config, hf_config, label)),
        description=f"{label} ({weight_format}, {path})",
        model_path=str(path),
    )


_LEGACY_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_local_base_freq")
_GLOBAL_LAYERS = "full_attention"
_SLIDING_LAYERS = "sliding_attention"


def _hf_dir_config(path: Path, overrides: dict[str, Any]) -> PretrainedConfig:
    """AutoConfig of ``path`` with ``overrides``; legacy rope keys land in ``rope_parameters``."""
    from transformers import AutoConfig

    rope = {key: overrides[key] for key in _LEGACY_ROPE_KEYS if key in overrides}
    plain = {key: value for key, value in overrides.items() if key not in rope}
    hf_config: PretrainedConfig = AutoConfig.from_pretrained(path, **plain)
    current = getattr(hf_config, "rope_parameters", None)
    if not rope:
        return hf_config
    if not isinstance(current, dict) or "rope_parameters" in plain:
        # transformers 4 reads the legacy keys itself; an explicit rope_parameters wins (as in 5)
        hf_config = AutoConfig.from_pretrained(path, **overrides)
    else:
        merged = merge_rope_overrides(current, rope)
        hf_config = AutoConfig.from_pretrained(path, **plain, rope_parameters=merged)
    return hf_config


def merge_rope_overrides(rope_parameters: dict[str, Any], rope: dict[str, Any]) -> dict[str, Any]:
    """``rope_parameters`` (flat, or per layer type) with legacy ``rope_theta`` / ``rope_scaling`` /
    ``rope_local_base_freq`` overrides applied; ValueError naming the key when one is malformed."""
    scaling = rope.get("rope_scaling", ...)
    if scaling is not ... and scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"--hf-overrides: rope_scaling must be a JSON object or null, got {scaling!r}")
    for key in ("rope_theta", "rope_local_base_freq"):
        value = rope.get(key)
        if key in rope and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ValueError(f"--hf-overrides: {key} must be a positive number, got {value!r}")

    def apply(params: dict[str, Any], theta: float | None) -> dict[str, Any]:
        result = dict(params)
        if scaling is not ...:  # replaces the scaling (None: back to plain rope), keeps theta
            result = {"rope_type": "default", "rope_theta": params.get("rope_theta")}
            if scaling:
                result.update({k: v for k, v in scaling.items() if k != "type"})
                result["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        if theta is not None:
            result["rope_theta"] = float(theta)
        return result

    if _GLOBAL_LAYERS in rope_parameters or _SLIDING_LAYERS in rope_parameters:
        merged = dict(rope_parameters)
        if _GLOBAL_LAYERS in merged:
            merged[_GLOBAL_LAYERS] = apply(merged[_GLOBAL_LAYERS], rope.get("rope_theta"))
        if _SLIDING_LAYERS in merged and "rope_local_base_freq" in rope:
            merged[_SLIDING_LAYERS] = {**merged[_SLIDING_LAYERS],
                                       "rope_theta": float(rope["rope_local_base_freq"])}
        return merged
    if "rope_local_base_freq" in rope:
        raise ValueError("--hf-overrides: rope_local_base_freq applies only to models with "
                         "sliding-window layers (per-layer-type rope parameters)")
    return apply(rope_parameters, rope.get("rope_theta"))


def _sentence_transformers_limit(config: ModelConfig, path: Path, context_length: int) -> int:
    """A sentence-transformers model's ``max_seq_length`` caps the default context: it was
    trained (and its reference truncates) at that length, below the encoder's position table."""
    st_config = path / "sentence_bert_config.json"
    if config.context_length is not None or not st_config.is_file():
        return context_length
    try:
        max_seq_length = json.loads(st_config.read_text()).get("max_seq_length")
    except ValueError:
        return context_length
    return min(context_length, int(max_seq_length)) if isinstance(max_seq_length, int) else context_length


def _weight_files(path: Path, load_format: str) -> tuple[list[Path], str]:
    """The checkpoint files in load order and their format (safetensors preferred under auto)."""
    candidates = {
        "safetensors": ("model.safetensors.index.json", "*.safetensors"),
        "pt": ("pytorch_model.bin.index.json", "pytorch_model*.bin"),
    }
    formats = ["safetensors", "pt"] if load_format in ("auto", "bitsandbytes") else [load_format]
    for weight_format in formats:
        index_name, pattern = candidates[weight_format]
        index = path / index_name
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [path / name for name in sorted(set(weight_map.values()))], weight_format
        files = sorted(path.glob(pattern))
        if files:
            return files, weight_format
    raise ModelSourceError(f"{path} has no weights for --load-format {load_format} (looked for "
                           "*.safetensors and pytorch_model*.bin); use --load-format dummy for random "
                           "weights")


def _keep_all(name: str) -> bool:
    return True


def _iter_safetensors(files: list[Path], keep: Callable[[str], bool] = _keep_all
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if keep(name):
                    yield name, f.get_tensor(name)


def _iter_torch_bins(files: list[Path], keep: Callable[[str], bool] = _keep_all
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
        yield from ((name, tensor) for name, tensor in state.items() if keep(name))
        del state


def _dir_eos_ids(path: Path, hf_config: PretrainedConfig) -> list[int]:
    """generation_config.json's eos ids, then the config's, then the tokenizer's eos token."""
    generation: Any = None
    generation_file = path / "generation_config.json"
    if generation_file.exists():
        generation = json.loads(generation_file.read_text()).get("eos_token_id")
    tokenizer_eos = _tokenizer_eos_id(path)
    return _unique_ids(generation, getattr(hf_config.get_text_config(), "eos_token_id", None),
                       tokenizer_eos)


def _tokenizer_eos_id(path: Path) -> int | None:
    """The tokenizer's eos id from tokenizer_config.json + tokenizer.json, without loading it."""
    try:
        eos = json.loads((path / "tokenizer_config.json").read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if not isinstance(eos, str):
            return None
        tokenizer = json.loads((path / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    for added in tokenizer.get("added_tokens", []):
        if added.get("content") == eos:
            return int(added["id"])
    vocab = tokenizer.get("model", {}).get("vocab")
    if isinstance(vocab, dict) and eos in vocab:
        return int(vocab[eos])
    return None
