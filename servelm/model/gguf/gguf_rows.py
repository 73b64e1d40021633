"""Builds and loads the AVX512-BF16 block kernels for a bf16 model's rows (gguf_rows.cpp).

``load_kernel()`` returns the compiled module, or None with a reason (``kernel_status()``) when this
CPU lacks AVX512-BF16 (read from /proc/cpuinfo, never assumed), there is no compiler, or the build
fails: callers then keep today's paths (the VNNI kernel, the dense bf16 copy). Cached like every
``CppKernel``'s. The module has ``rows_gemm(x_bf16, codes, scales, offsets, block, bf16_out, n)``, the
GEMM micro-kernel the layers route to, on the copy ``pack`` makes at load (``GEMM_COLS``: its tile
width in vectors of 16 outputs; Q4-Q6 codes biased to uint8, which widen to bf16 in two instructions
instead of five; the ``packed`` route's copy at 4 or 5 bits, ``pack(..., bits=True)``), and
``rows_linear(x_bf16, codes, scales, offsets, block,
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
NIBBLE_CODES = (0, 15)
"""Codes in this range (Q4_K, Q4_1) are packed two to a byte (``pack(..., bits=True)``)."""
FIVE_BIT_CODES = (-16, 15)
"""Codes in this range (Q5_0, Q4_0) are packed as nibbles of code + 16 and a bit plane of its fifth bit."""


def _packed_step(tiled: torch.Tensor, offset: int, five: bool) -> torch.Tensor:
    """Tiled codes [tiles, K / 2, 2, 16, 2] -> uint8 [tiles, K / 2, 32 (+ 8 with ``five``)]: u = code +
    ``offset``; byte j of a step holds vector 0's u & 15 (element j) in its low nibble and vector
    1's in its high one; with ``five``, then vector 0's and vector 1's u >> 4 as 32-bit masks."""
    tiles, steps = tiled.shape[:2]
    u = (tiled.to(torch.int16) + offset).view(tiles, steps, 2, 32)
    nibbles = ((u[:, :, 0] & 15) | ((u[:, :, 1] & 15) << 4)).to(torch.uint8)
    if not five:
        return nibbles.contiguous()
    bits = ((u >> 4) & 1).view(tiles, steps, 2, 4, 8)
    masks = (bits << torch.arange(8, dtype=torch.int16)).sum(-1).to(torch.uint8).view(tiles, steps, 8)
    return torch.cat([nibbles, masks], dim=2).contiguous()


PACKED_KINDS = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_0"})
"""GGUF types whose codes fit ``NIBBLE_CODES`` or ``FIVE_BIT_CODES``: the ``packed`` route's copy."""


def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, cols: int = 2,
         bits: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A BlockWeight's codes [N, K] and scales/offsets [N, K / B] in ``rows_gemm``'s order: tiles of
    ``cols`` x 16 outputs (the kernel's ``GEMM_COLS``), N padded with zero codes and scales to whole
    tiles; scales and offsets [tiles, K / B, cols, 16] (``tile_outputs``); codes a byte each, uint8
    code + 64 [tiles, K / 2, cols, 16, 2] where every code is in ``BIASED_CODES``, else int8; with
    ``bits`` (the ``packed`` route's copy, ``cols`` 2) at their bit width: nibbles [tiles, K / 2, 32]
    (``NIBBLE_CODES``) or five bits [tiles, K / 2, 40] (``FIVE_BIT_CODES``)."""
    packed, tiled_scales, tiled_offsets = tile_outputs(codes, scales, offsets, cols, group=2)
    low, high = (int(v) for v in torch.aminmax(codes)) if codes.numel() else (0, 0)

    def within(bounds: tuple[int, int]) -> bool:
        return bounds[0] <= low and high <= bounds[1]

    if bits:
        assert cols == 2 and (within(FIVE_BIT_CODES) or within(NIBBLE_CODES)), "codes wider than five bits"
        offset = -NIBBLE_CODES[0] if within(NIBBLE_CODES) else -FIVE_BIT_CODES[0]
        packed = _packed_step(packed, offset, five=not within(NIBBLE_CODES))
    elif within(BIASED_CODES):
        packed = (packed.to(torch.int16) - BIASED_CODES[0]).to(torch.uint8)
    return packed, tiled_scales, tiled_offsets


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """``pack``'s codes in any form back to int8 [tiles, K / 2, 2, 16, 2] (tests, torch references)."""
    if packed.dtype == torch.int8:
        return packed
    if packed.dim() == 5:   # biased bytes
        return (packed.to(torch.int16) + BIASED_CODES[0]).to(torch.int8)
    tiles, steps, width = packed.shape
    nibbles = packed[:, :, :32].to(torch.int16)
    u = torch.stack([nibbles & 15, nibbles >> 4], dim=2)   # [tiles, steps, 2, 32]
    low = NIBBLE_CODES[0]
    if width == 40:
        bits = (packed[:, :, 32:].to(torch.int16).view(tiles, steps, 2, 4, 1) >> torch.arange(8, dtype=torch.int16)) & 1
        u = u + 16 * bits.reshape(tiles, steps, 2, 32)
        low = FIVE_BIT_CODES[0]
    return (u + low).to(torch.int8).view(tiles, steps, 2, 16, 2)
