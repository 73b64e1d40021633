"""Tokenizer loading, with GGUF tokenizers converted once and cached on disk.

transformers rebuilds a GGUF's tokenizer from the token and merge lists on every load (5-30 s).
We do that once, ``save_pretrained`` the result under
``~/.cache/servelm/tokenizers/<file stem>-<key>``, and load that folder afterwards (well under a
second).

Invariants:
- The cache key covers the GGUF's resolved path, size and mtime and the transformers version, so
  a replaced file or an upgraded converter never reuses a stale tokenizer.
- The cache folder appears complete or not at all (saved to a temp folder, then renamed).
- The GGUF's ``tokenizer.chat_template`` is kept in the saved tokenizer.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from servelm.config import ModelConfig
from servelm.model.packaged import DEFAULT_CACHE_DIR

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from servelm.model.source import ModelSource


def load_tokenizer(config: ModelConfig, source: ModelSource | None = None,
                   cache_dir: str | Path | None = None) -> PreTrainedTokenizerBase | None:
    """The tokenizer for ``config`` (``--tokenizer`` first, else the model's); None when skipped."""
    if config.skip_tokenizer_init:
        return None
    if config.tokenizer is not None:
        path = Path(config.tokenizer).expanduser()
    else:
        if source is None:
            from servelm.model.source import resolve_model_source
            import dataclasses
            source = resolve_model_source(dataclasses.replace(config, load_format="dummy"))
        if source.tokenizer_path is None:
            return None
        path = Path(source.tokenizer_path)
    use_fast = config.tokenizer_mode != "slow"
    if path.is_dir() and not (path / "tokenizer_config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            path = ggufs[0]
    if path.suffix == ".gguf":
        return _load_gguf_tokenizer(path, use_fast, Path(cache_dir or DEFAULT_CACHE_DIR) / "tokenizers")
    from transformers import AutoTokenizer
    if not path.exists():
        raise ValueError(f"--tokenizer {path}: no such file or directory")
    return AutoTokenizer.from_pretrained(path, use_fast=use_fast, trust_remote_code=False)


def tokenizer_cache_path(gguf_path: Path, cache_root: Path, use_fast: bool = True) -> Path:
    """Cache folder of the converted tokenizer of ``gguf_path``."""
    import transformers
    resolved = gguf_path.resolve()
    stat = resolved.stat()
    key = f"{resolved}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}|{use_fast}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root / f"{resolved.stem}-{digest}"


def _load_gguf_tokenizer(gguf_path: Path, use_fast: bool, cache_root: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer
    cached = tokenizer_cache_path(gguf_path, cache_root, use_fast)
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(cached, use_fast=use_fast)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, use_fast=use_fast)
    if not getattr(tokenizer, "chat_template", None):
        from servelm.model.gguf.gguf_file import GGUFFile
        template = GGUFFile.open(gguf_path).chat_template
        if template:
            tokenizer.chat_template = template
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=cache_root, prefix=cached.name + ".", suffix=".tmp"))
    try:
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(cached)
        except OSError:
            if not cached.is_dir():  # not a concurrent writer that won the race
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return AutoTokenizer.from_pretrained(cached, use_fast=use_fast)
