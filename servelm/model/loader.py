"""Builds our nn.Module for an HF config and fills it with HF-named weights or seeded random ones.

Invariants:
- Parameters are created directly on the target device in the target dtype (the default dtype and
  device are switched only while the module is constructed).
- Random (dummy) weights depend only on the seed and parameter shapes/order, not on the device:
  they are drawn on the CPU in float32 and then copied.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from tqdm import tqdm

from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.common import STACKED_PARAMS
from servelm.model.layers.moe import FusedMoE
from servelm.model.registry import ENCODER_ARCHITECTURES, architecture_name, get_model_class

logger = logging.getLogger(__name__)

DTYPES = {"half": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16,
           "float": torch.float32, "float32": torch.float32,
           "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp8_e4m3": torch.float8_e4m3fn}
DUMMY_WEIGHT_STD = 0.02
"""Std of random weights: small enough that activations and logits stay finite in float16."""


def resolve_device(name: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_flags() -> set[str]:
    """The CPU feature flags of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next((line for line in cpuinfo if line.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


BF16_CPU_FEATURES = (("amx_bf16", "AMX tiles"), ("avx512_bf16", "AVX512-BF16 dot-product instructions"))
"""CPU features that give oneDNN a native bf16 GEMM, strongest first. Without one, bf16 matmuls
convert to float32 inside the kernel and run slower than float32 itself (measured ~3.5x slower, 2
threads, Intel Cascade Lake). With AVX512-BF16 (AMD EPYC, 1 thread, oneDNN both ways) a bf16
linear at M=32..256 is 1.9-2.4x faster than float32 on Gemma 3 / Qwen2 shapes and even at M=1
(0.7-1.35x per shape, the 262k-row LM head 1.07x): benchmarks/linear_kernels.py."""


def cpu_bf16_feature(flags: set[str] | None = None) -> str | None:
    """The first of ``BF16_CPU_FEATURES`` this CPU has, described; None without one."""
    present = cpu_flags() if flags is None else flags
    return next((description for flag, description in BF16_CPU_FEATURES if flag in present), None)


def dtype_reason(name: str, device: torch.device, flags: set[str] | None = None) -> str:
    """Why ``resolve_dtype`` picks what it picks, with its evidence, for the start-up log."""
    if name != "auto":
        return f"--dtype {name}"
    if device.type != "cpu":
        return "auto on CUDA: the checkpoint's dtype"
    feature = cpu_bf16_feature(flags)
    if feature is not None:
        return (f"auto: this CPU has {feature}, so oneDNN runs bf16 GEMMs natively (about 2x "
                "float32 at batch >= 32); --dtype float32 keeps full precision")
    return ("auto: this CPU has neither AMX nor AVX512-BF16, so bf16 matmuls would be emulated "
            "and slower than float32 (fp16 has no fast path either)")


def resolve_dtype(name: str, hf_config: Any, device: torch.device,
                  flags: set[str] | None = None) -> torch.dtype:
    """``auto``: on CPU bfloat16 where the CPU has a native bf16 GEMM (``cpu_bf16_feature``),
    else float32; on CUDA the checkpoint's dtype (bfloat16 when it names none). ``flags``
    replaces the CPU's own feature flags (tests force each branch with it)."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_bf16_feature(flags) is not None else torch.float32
    text_config = getattr(hf_config, "text_config", None) or hf_config
    configured = getattr(text_config, "dtype", None) or getattr(text_config, "torch_dtype", None)
    if isinstance(configured, str):
        configured = getattr(torch, configured, None)
    return configured if isinstance(configured, torch.dtype) else torch.bfloat16


def resolve_residual_dtype(name: str, dtype: torch.dtype, device: torch.device) -> tuple[torch.dtype, str]:
    """``--residual-dtype``: the residual stream's dtype for a model running in ``dtype``, and why."""
    if dtype == torch.float32 or name == "model":
        return dtype, "the model dtype" if name != "float32" else "--residual-dtype float32 (the model dtype)"
    if name == "float32":
        return torch.float32, "--residual-dtype float32"
    if device.type == "cpu":
        return torch.float32, ("auto on CPU: a float32 sum of each layer's update keeps what a 16-bit sum "
                               "rounds away (--residual-dtype model: the model dtype)")
    return dtype, "auto off CPU: the model dtype"


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside create their parameters in ``dtype``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(hf_config: Any, dtype: torch.dtype, device: torch.device,
                parallel: ParallelContext | None = None) -> nn.Module:
    """Our module for ``hf_config`` (this rank's shard of it) with uninitialised parameters on
    ``device`` in ``dtype``."""
    parallel = parallel or ParallelContext.single()
    model_class = get_model_class(hf_config)
    is_encoder = architecture_name(hf_config) in ENCODER_ARCHITECTURES
    if is_encoder and parallel.tp_size > 1:
        raise ValueError(f"--tp-size {parallel.tp_size}: encoder (embedding) models run on one rank; "
                         "use --tp-size 1")
    if is_encoder and parallel.pp_size > 1:
        raise ValueError(f"--pipeline-parallel-size {parallel.pp_size}: encoder (embedding) models run "
                         "on one rank; use --pipeline-parallel-size 1")
    with default_dtype(dtype), torch.device(device):
        model = model_class(hf_config) if is_encoder else model_class(hf_config, parallel)
    return model.eval()


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Deterministic random weights: N(0, DUMMY_WEIGHT_STD), norms at their identity value."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            owner = model.get_submodule(name.rsplit(".", 1)[0])
            fill = getattr(owner, "dummy_fill", None)
            if fill is not None:
                param.fill_(fill)
            else:
                values = torch.randn(param.shape, generator=generator) * DUMMY_WEIGHT_STD
                param.copy_(values)


def expected_checkpoint_tensors(model: nn.Module) -> int:
    """How many HF tensors a full checkpoint has for ``model`` (fused parameters count per shard)."""
    shards_per_fused: dict[str, int] = {}
    for fused, _, _ in STACKED_PARAMS:
        shards_per_fused[fused] = shards_per_fused.get(fused, 0) + 1
    total = 0
    for name, _ in model.named_parameters():
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        if isinstance(owner, FusedMoE):   # per-expert tensors: gate and up, or down, of each expert
            total += owner.num_experts * (2 if name.endswith("gate_up_proj") else 1)
            continue
        module_name = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else ""
        total += shards_per_fused.get(module_name, 1)
    return total


def load_model(hf_config: Any, weights: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None,
               dtype: torch.dtype, device: torch.device, seed: int = 0,
               parallel: ParallelContext | None = None) -> nn.Module:
    """Build the module and load ``weights()`` into it (random weights when ``weights`` is None).

    Each tensor-parallel rank loads its own shard from the full checkpoint, each pipeline stage only
    its own layers. Dummy weights are drawn per shard, so a dummy model at tp or pp > 1 is not the
    tp 1 model (compare TP and PP with real weights)."""
    model = build_model(hf_config, dtype, device, parallel)
    if weights is None:
        init_dummy_weights(model, seed)
        logger.info("initialised dummy weights (seed %d)", seed)
        return model
    with torch.no_grad(), tqdm(total=expected_checkpoint_tensors(model), desc="Loading weights",
                               unit="tensor", leave=False) as progress:
        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            for item in weights():
                yield item
                progress.update(1)
        model.load_weights(counted())
    return model
