"""Decode attention read in place from the paged KV pool (paged_decode.cpp), built once per machine.

The torch path of a decode group gathers every context row of every sequence into a padded copy
(``index_select``, ~5 MB per layer at 32 streams x 80 tokens of Gemma 3 270M's float32 K/V), then SDPA
reads the copy again. The kernel reads each K and V row once from the pool, for all query heads
sharing its KV head, one task per (sequence, KV head) across torch's threads.

``load_kernel()`` returns the compiled module or None (``kernel_status()`` says why: no AVX-512F in
/proc/cpuinfo, no compiler or ninja, a failed build); the backend then keeps the gather + SDPA
path. The build is cached under ``~/.cache/servelm/kernels/<hash>`` (source, torch version,
flags), so only the first start on a machine compiles it (about a minute on 2 cores).
``supports`` limits it to what it computes: a float32 or bfloat16 pool (bf16 rows are widened in
registers, arithmetic in float32; q of either dtype), head_dim a multiple of 16, CPU.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from types import ModuleType

import torch

from servelm.model.loader import cpu_flags

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("paged_decode.cpp")
COMPILE_FLAGS = ["-O3", "-mavx512f"]
CACHE_DIR = Path(os.path.expanduser("~/.cache/servelm/kernels"))

_state: dict[str, object] = {}


def _build_key() -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(torch.__version__.encode())
    digest.update(" ".join(COMPILE_FLAGS).encode())
    return digest.hexdigest()[:16]


def load_kernel() -> ModuleType | None:
    """The compiled module, or None (the reason is ``kernel_status()``); built at most once."""
    if "module" not in _state:
        module, reason = _load()
        _state["module"], _state["reason"] = module, reason
        if module is None:
            logger.info("paged decode attention kernel unavailable (gather + SDPA instead): %s", reason)
        else:
            logger.info("paged decode attention: %s", reason)
    return _state["module"]  # type: ignore[return-value]


def kernel_status() -> str:
    load_kernel()
    return str(_state["reason"])


def _load() -> tuple[ModuleType | None, str]:
    if "avx512f" not in cpu_flags():
        return None, "this CPU lacks avx512f"
    if shutil.which(os.environ.get("CXX") or "c++") is None and shutil.which("g++") is None:
        return None, "no C++ compiler (c++/g++) on PATH to build it"
    from torch.utils import cpp_extension
    if not cpp_extension.is_ninja_available():
        return None, "ninja (needed by torch.utils.cpp_extension) is not installed"
    build_dir = CACHE_DIR / f"paged_decode_{_build_key()}"
    build_dir.mkdir(parents=True, exist_ok=True)
    cached = any(build_dir.glob("*.so"))
    try:
        module = cpp_extension.load(name=f"servelm_paged_decode_{_build_key()}", sources=[str(SOURCE)],
                                    extra_cflags=COMPILE_FLAGS, build_directory=str(build_dir),
                                    verbose=False)
    except Exception as e:  # a compiler error, a missing header: serve without the kernel
        text = str(e).strip()
        return None, f"building {SOURCE.name} failed: {text.splitlines()[-1] if text else repr(e)}"
    return module, f"AVX-512 kernel {'loaded from' if cached else 'built in'} {build_dir}"


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether ``attend`` computes this layer's decodes: CPU, float32/bf16 q and pool, D % 16 == 0."""
    return (q.device.type == "cpu" and q.dtype in _DTYPES and k_cache.dtype in _DTYPES
            and q.shape[-1] % 16 == 0 and load_kernel() is not None)


_DTYPES = (torch.float32, torch.bfloat16)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
           spans: torch.Tensor, scale: float) -> torch.Tensor:
    """q ``[b, H, D]``; pools ``[slots, Hkv, D]``; ``slots`` ``[b, columns]`` int64 (column c of
    sequence i), ``spans`` ``[b]`` valid columns (every one visible to the query) -> ``[b, H, D]``
    in q's dtype."""
    module = load_kernel()
    assert module is not None
    return module.decode_attention(q.float().contiguous(), k_cache, v_cache, slots, spans, scale).to(q.dtype)
