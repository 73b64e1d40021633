"""Builds and loads the AVX512-BF16 block kernels for a bf16 model's rows (gguf_rows.cpp).

``load_kernel()`` returns the compiled module, or None with a reason (``kernel_status()``) when this
CPU lacks AVX512-BF16 (read from /proc/cpuinfo, never assumed), there is no compiler, or the build
fails: callers then keep today's paths (the VNNI kernel, the dense bf16 copy). Cached like every
``CppKernel``'s. The module has ``rows_gemm(x_bf16, codes, scales, offsets, block, bf16_out, n, bias)``
(and ``rows_call``, the same in a prepared decode call's argument order; ``amx_gemm``, the same arguments
giving the dense bf16 copy's product on AMX tiles where ``amx_ready``), the
GEMM micro-kernel the layers route to, on the copy ``pack`` makes at load (``GEMM_COLS``: its tile
width in vectors of 16 outputs; Q4-Q6 codes biased to uint8, which widen to bf16 in two instructions
instead of five; the ``packed`` route's copy at 4, 5 or 6 bits, ``pack(..., bits=True)``; scales in fp16 where
they are fp16 values), and
``rows_linear(x_bf16, codes, scales, offsets, block,
bf16_out)``, the earlier kernel on the BlockWeight's own codes.
"""

from __future__ import annotations

import torch

from servelm.model.cpp_kernel import CppKernel
from servelm.model.gguf.gguf_blocks import SUPER_INPUTS, SubScaled, factors_give, fp16_exact, tile_blocks, tile_outputs
from servelm.model.huge_pages import on_huge_pages

KERNEL = CppKernel.beside(__file__, "gguf_rows.cpp", "gguf_rows", "GGUF rows kernel (AVX512-BF16)",
                          ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "fma"),
                          # rows_act's activation: the same code (servelm_activation.h) built as fused_ops is
                          ["-ffp-contract=off"])
load_kernel, kernel_status, missing_cpu_flags = KERNEL.load, KERNEL.status, KERNEL.missing_cpu_flags


def amx_ready(kernel: object) -> bool:
    """Whether ``kernel`` (this module's build, or a stand-in with its API) runs ``amx_gemm`` here: the
    CPU has AMX bf16 tiles (CPUID) and Linux granted the process their state (``amx_permitted``, asked once)."""
    permitted = getattr(kernel, "amx_permitted", None)
    return permitted is not None and hasattr(kernel, "amx_gemm") and bool(permitted())


BIASED_CODES = (-64, 63)
"""Codes in this range (every GGUF type but Q8_0) are packed biased: uint8 code + 64, which the kernel
widens to bf16 with a zero-extension and an OR (gguf_rows.cpp, "biased codes")."""
NIBBLE_CODES = (0, 15)
"""Codes in this range (Q4_K, Q4_1) are packed two to a byte (``pack(..., bits=True)``)."""
FIVE_BIT_CODES = (-16, 15)
"""Codes in this range (Q5_0, Q4_0) are packed as nibbles of code + 16 and a bit plane of its fifth bit."""
SIX_BIT_CODES = (-32, 31)
"""Codes in this range (Q6_K) are packed as nibbles of code + 32 and bit planes of its fifth and sixth bits."""
BIT_FORMS = ((NIBBLE_CODES, 4), (FIVE_BIT_CODES, 5), (SIX_BIT_CODES, 6))
"""The ``packed`` route's forms, narrowest first: the codes' range and the bits a code takes."""


def _packed_step(tiled: torch.Tensor, offset: int, width: int) -> torch.Tensor:
    """Tiled codes [tiles, K / 2, 2, 16, 2] -> uint8 [tiles, K / 2, 32 + 8 (width - 4)]: u = code +
    ``offset``; byte j of a step holds vector 0's u & 15 (element j) in its low nibble and vector
    1's in its high one; then per bit above the fourth (``width`` 5 or 6), vector 0's and vector 1's
    bit of u as 32-bit masks."""
    tiles, steps = tiled.shape[:2]
    u = (tiled.to(torch.int16) + offset).view(tiles, steps, 2, 32)
    nibbles = ((u[:, :, 0] & 15) | ((u[:, :, 1] & 15) << 4)).to(torch.uint8)
    planes = [nibbles]
    for bit in range(4, width):
        bits = ((u >> bit) & 1).view(tiles, steps, 2, 4, 8)
        planes.append((bits << torch.arange(8, dtype=torch.int16)).sum(-1).to(torch.uint8).view(tiles, steps, 8))
    return torch.cat(planes, dim=2).contiguous()


PACKED_KINDS = frozenset({"Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q6_K"})
"""GGUF types whose codes fit one of ``BIT_FORMS``: the ``packed`` route's copy."""


def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, cols: int = 2,
         bits: bool = False, factors: tuple[SubScaled | None, SubScaled | None] = (None, None),
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A BlockWeight's codes [N, K] and scales/offsets [N, K / B] in ``rows_gemm``'s order: tiles of
    ``cols`` x 16 outputs (the kernel's ``GEMM_COLS``), N padded with zero codes and scales to whole
    tiles; scales and offsets [tiles, K / B, cols, 16] (``tile_outputs``), in fp16 where every one of
    them is an fp16 value (``fp16_exact``), else float32; codes a byte each, uint8
    code + 64 [tiles, K / 2, cols, 16, 2] where every code is in ``BIASED_CODES``, else int8; with
    ``bits`` (the ``packed`` route's copy, ``cols`` 2) at the narrowest of ``BIT_FORMS`` they fit:
    nibbles [tiles, K / 2, 32] (``NIBBLE_CODES``), five bits [tiles, K / 2, 40] (``FIVE_BIT_CODES``)
    or six [tiles, K / 2, 48] (``SIX_BIT_CODES``); and with ``factors`` (a K-quant's scale and offset
    factors, ``BlockWeight.scale_factors``/``offset_factors``) that give the scales and offsets bit
    for bit, its scales and offsets as their int8 sub-scales and float32 multipliers
    (``sub_scaled``: ~0.1 instead of 0.25 bytes a weight, where bytes are what a row costs). A copy of
    the codes as large as an LM head's lies on huge pages (``on_huge_pages``)."""
    packed, tiled_scales, tiled_offsets = tile_outputs(codes, scales, offsets, cols, group=2)
    low, high = (int(v) for v in torch.aminmax(codes)) if codes.numel() else (0, 0)

    def within(bounds: tuple[int, int]) -> bool:
        return bounds[0] <= low and high <= bounds[1]

    if bits:
        form = next(((bounds, width) for bounds, width in BIT_FORMS if within(bounds)), None)
        assert cols == 2 and form is not None, "codes wider than six bits"
        packed = _packed_step(packed, -form[0][0], form[1])
    elif within(BIASED_CODES):
        packed = (packed.to(torch.int16) - BIASED_CODES[0]).to(torch.uint8)
    scale_factors, offset_factors = factors
    if (bits and codes.shape[1] % SUPER_INPUTS == 0 and factors_give(scale_factors, scales)
            and (offsets is None or factors_give(offset_factors, offsets))):
        tiled_scales = sub_scaled(scale_factors, cols)
        tiled_offsets = sub_scaled(offset_factors, cols) if offsets is not None else None
    elif all(part is None or fp16_exact(part) for part in (tiled_scales, tiled_offsets)):
        tiled_scales = tiled_scales.half()
        tiled_offsets = tiled_offsets.half() if tiled_offsets is not None else None
    return on_huge_pages(packed), tiled_scales, tiled_offsets


def sub_scaled(factors: SubScaled | None, cols: int) -> torch.Tensor:
    """``factors`` in the rows kernel's tile order (``tile_blocks``): int8 [tiles, K / B + 4 K / 256,
    cols, 16], each tile's sub-scales [K / B, cols, 16] then the bytes of its float32 multipliers
    [K / 256, cols, 16] (gguf_rows.cpp ``block_scales``)."""
    assert factors is not None
    sub = tile_blocks(factors.sub.to(torch.int8), cols)
    multipliers = tile_blocks(factors.multipliers.float(), cols).view(torch.int8).view(sub.shape[0], -1, cols, 16)
    return torch.cat([sub, multipliers], dim=1).contiguous()


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """``pack``'s codes in any form back to int8 [tiles, K / 2, 2, 16, 2] (tests, torch references)."""
    if packed.dtype == torch.int8:
        return packed
    if packed.dim() == 5:   # biased bytes
        return (packed.to(torch.int16) + BIASED_CODES[0]).to(torch.int8)
    tiles, steps, width = packed.shape
    nibbles = packed[:, :, :32].to(torch.int16)
    u = torch.stack([nibbles & 15, nibbles >> 4], dim=2)   # [tiles, steps, 2, 32]
    bounds, _ = next(form for form in BIT_FORMS if 32 + 8 * (form[1] - 4) == width)
    for plane in range((width - 32) // 8):   # the fifth, then the sixth bit
        masks = packed[:, :, 32 + 8 * plane:40 + 8 * plane].to(torch.int16).view(tiles, steps, 2, 4, 1)
        bits = (masks >> torch.arange(8, dtype=torch.int16)) & 1
        u = u + (16 << plane) * bits.reshape(tiles, steps, 2, 32)
    low = bounds[0]
    return (u + low).to(torch.int8).view(tiles, steps, 2, 16, 2)
