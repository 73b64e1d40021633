"""Builds and loads the AVX512-BF16 block kernels for a bf16 model's rows (gguf_rows.cpp).

``load_kernel()`` returns the compiled module, or None with a reason (``kernel_status()``) when this
CPU lacks AVX512-BF16 (read from /proc/cpuinfo, never assumed), there is no compiler, or the build
fails: callers then keep today's paths (the VNNI kernel, the dense bf16 copy). Cached like every
``CppKernel``'s. The module has ``rows_gemm(x_bf16, codes, scales, offsets, block, bf16_out, n)``, the
GEMM micro-kernel the layers route to, on the copy ``pack`` makes at load (``GEMM_COLS``: its tile
width in vectors of 16 outputs; Q4-Q6 codes biased to uint8, which widen to bf16 in two instructions
instead of five), and ``rows_linear(x_bf16, codes, scales, offsets, block,
bf16_out)``, the earlier kernel on the BlockWeight's own codes.
"""

from __future__ import annotations

import torch

from servelm.model.cpp_kernel import CppKernel
from servelm.model.gguf.gguf_blocks import tile_outputs

KERNEL = CppKernel.beside(__file__, "gguf_rows.cpp", "gguf_rows", "GGUF rows kernel (AVX512-BF16)",
                          ("avx512f", "avx512bw", "avx512vl", "avx512_bf16"))
load_kernel, kernel_status, missing_cpu_flags = KERNEL.load, KERNEL.status, KERNEL.missing_cpu_flags


BIASED_CODES = (-64, 63)
"""Codes in this range (every GGUF type but Q8_0) are packed biased: uint8 code + 64, which the kernel
widens to bf16 with a zero-extension and an OR (gguf_rows.cpp, "biased codes")."""


def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
         cols: int = 2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A BlockWeight's codes [N, K] and scales/offsets [N, K / B] in ``rows_gemm``'s order: tiles of
    ``cols`` x 16 outputs (the kernel's ``GEMM_COLS``), N padded with zero codes and scales to whole
    tiles; codes [tiles, K / 2, cols, 16, 2], uint8 code + 64 where every code is in
    ``BIASED_CODES``, else int8; scales and offsets [tiles, K / B, cols, 16] (``tile_outputs``)."""
    packed, tiled_scales, tiled_offsets = tile_outputs(codes, scales, offsets, cols, group=2)
    low, high = torch.aminmax(codes) if codes.numel() else (torch.tensor(0), torch.tensor(0))
    if BIASED_CODES[0] <= int(low) and int(high) <= BIASED_CODES[1]:
        packed = (packed.to(torch.int16) - BIASED_CODES[0]).to(torch.uint8)
    return packed, tiled_scales, tiled_offsets
