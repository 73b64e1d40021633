"""Builds and loads the int8 x int8 GEMM on GGUF block codes (gguf_i8gemm.cpp, AVX512-VNNI).

``load_kernel()`` returns the compiled module, or None with a reason (``kernel_status()``) when this
CPU lacks AVX512 F/BW/VL + VNNI (read from /proc/cpuinfo, never assumed; AVX512-BF16 is not
needed), there is no compiler, or the build fails: callers then keep their other paths. The module
has ``i8_gemm(x, codes, scales, offsets, block, bf16_out, n, out)`` on the copy ``pack`` makes at
load (``GEMM_COLS`` vectors of 16 outputs per tile) and ``quantize(x, block)``, the activation
rounding it applies (int8 per block of the weight's scales, absmax / 127, nearest even).

``reference`` is the same arithmetic in torch (tests and benchmarks): the integer dots are exact,
the float sums agree to float32 rounding.
"""

from __future__ import annotations

import torch

from servelm.model.cpp_kernel import CppKernel
from servelm.model.gguf.gguf_blocks import BlockWeight, tile_outputs
from servelm.model.huge_pages import on_huge_pages

KERNEL = CppKernel.beside(__file__, "gguf_i8gemm.cpp", "gguf_i8gemm", "GGUF int8 GEMM (AVX512-VNNI)",
                          ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))
load_kernel, kernel_status, missing_cpu_flags = KERNEL.load, KERNEL.status, KERNEL.missing_cpu_flags

GEMM_COLS = 2
"""16-output vectors per tile (the kernel's ``kCols``): tiles of 32 outputs."""


def pack(weight: BlockWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A BlockWeight in ``i8_gemm``'s order: codes + 128 as uint8 [tiles, K / 4, GEMM_COLS, 16, 4]
    (N padded with zero codes to whole tiles of 32 outputs), scales and offsets [tiles, K / B,
    GEMM_COLS, 16] (zero for padded outputs). 1 byte per weight + 4 per block: the size of the
    BlockWeight itself (``tile_outputs``); codes as large as an LM head's on huge pages (``on_huge_pages``)."""
    codes, scales, offsets = tile_outputs(weight.codes, weight.scales, weight.offsets, GEMM_COLS, group=4)
    return on_huge_pages(codes.view(torch.uint8).bitwise_xor(0x80)), scales, offsets   # code + 128, as a byte


def quantize_reference(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8 codes [M, K] and float32 scales [M, K / block], as the kernel rounds."""
    m, k = x.shape
    xb = x.float().view(m, k // block, block)
    d = xb.abs().amax(-1) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-127, 127)
    return q.to(torch.int8).view(m, k), d


def reference(x: torch.Tensor, weight: BlockWeight) -> torch.Tensor:
    """``i8_gemm``'s arithmetic in torch, float32 [M, N]: exact int64 block dots, then float32."""
    m, k = x.shape
    n, block = weight.codes.shape[0], weight.block
    q, d = quantize_reference(x, block)
    dots = torch.einsum("mbi,nbi->mnb", q.long().view(m, -1, block), weight.codes.long().view(n, -1, block))
    out = (dots.float() * (weight.scales[None] * d[:, None])).sum(-1)
    if weight.offsets is not None:
        sums = d * q.view(m, -1, block).long().sum(-1).float()
        out = out + (weight.offsets[None] * sums[:, None]).sum(-1)
    return out
