"""Builds and loads the int8 x int8 GEMM on GGUF block codes: gguf_i8gemm.cpp (AVX512-VNNI) and
gguf_i8gemm_avx2.cpp (AVX2 + FMA, vpmaddubsw), the same arithmetic and floats.

``load_gemm()`` returns the first build this CPU runs (``GEMM_BUILDS``: VNNI, else AVX2), or None with a
reason (``gemm_status()``) when the CPU has neither (read from /proc/cpuinfo, never assumed), there is
no compiler, or the build fails: callers then keep their other paths. ``load_kernel()`` is the VNNI
build alone. A module has ``i8_gemm(x, codes, scales, offsets, block, bf16_out, n, out, bias)`` on the
copy ``pack_for`` makes for it at load (the AVX2 build also takes the copy's ``code_bias`` and
``code_span``: ``gemm`` passes them), ``quantize(x, block)``, the activation rounding it applies (int8
per block of the weight's scales, absmax / 127, nearest even), and the LM head's ``i8_screen`` on the
copy ``screen_pack`` makes (the AVX2 build rounds the screen's activations to fewer levels:
``AVX2_SCREEN_LEVELS``).

``reference`` is the same arithmetic in torch (tests and benchmarks): the integer dots are exact,
the float sums agree to float32 rounding.
"""

from __future__ import annotations

import torch

from servelm.model.cpp_kernel import CppKernel, KernelBuilds
from servelm.model.gguf.gguf_blocks import BlockWeight, tile_outputs
from servelm.model.huge_pages import on_huge_pages

KERNEL = CppKernel.beside(__file__, "gguf_i8gemm.cpp", "gguf_i8gemm", "GGUF int8 GEMM (AVX512-VNNI)",
                          ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"))
load_kernel, kernel_status, missing_cpu_flags = KERNEL.load, KERNEL.status, KERNEL.missing_cpu_flags
AVX2_KERNEL = CppKernel.beside(__file__, "gguf_i8gemm_avx2.cpp", "gguf_i8gemm_avx2", "GGUF int8 GEMM (AVX2+FMA)",
                               ("avx2", "fma"))
KERNELS = (KERNEL, AVX2_KERNEL)
"""Every build, preferred first."""
GEMM_BUILDS = KernelBuilds(*KERNELS)
load_gemm, gemm_status, gemm_missing_flags = GEMM_BUILDS.load, GEMM_BUILDS.status, GEMM_BUILDS.missing_cpu_flags

AVX2_CODE_SPAN = 127
"""The widest codes the AVX2 build takes: u = code + bias in 0 .. 127 (vpmaddubsw's int16 pairs, 2 x 127 x 127,
do not saturate); wider codes (Q8_0's -127 .. 127) keep the layer's other routes."""

AVX2_SCREEN_CODE_SPAN = 254
"""The widest codes the AVX2 build's screen takes (Q8_0's u = code + 127), against activations rounded to
``AVX2_SCREEN_LEVELS`` steps each side of zero."""
AVX2_SCREEN_LEVELS = 64
"""The AVX2 build's activation levels in ``i8_screen`` (d = absmax / 64, |q| <= 64): a vpmaddubsw pair is at most
2 x 254 x 64 = 32,512, one vpmaddwd each. The screen's results only choose candidates; its bound counts the
coarser rounding (lm_head_screen.py ``i8_screen_coefficient``). 32 levels would add two pairs in int16 (the
GEMM 1.2x faster) but gave Gemma 3 ~30x the candidates, slower in all (RESULTS.md "Session 45")."""

GEMM_COLS = 2
"""16-output vectors per tile (the kernel's ``kCols``): tiles of 32 outputs."""


def pack(weight: BlockWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A BlockWeight in the VNNI build's order: codes + 128 as uint8 [tiles, K / 4, GEMM_COLS, 16, 4]
    (N padded with zero codes to whole tiles of 32 outputs), scales and offsets [tiles, K / B,
    GEMM_COLS, 16] (zero for padded outputs). 1 byte per weight + 4 per block: the size of the
    BlockWeight itself (``tile_outputs``); codes as large as an LM head's on huge pages (``on_huge_pages``)."""
    codes, scales, offsets = tile_outputs(weight.codes, weight.scales, weight.offsets, GEMM_COLS, group=4)
    return on_huge_pages(codes.view(torch.uint8).bitwise_xor(0x80)), scales, offsets   # code + 128, as a byte


def pack_avx2(weight: BlockWeight, span_limit: int = AVX2_CODE_SPAN) -> I8Weight | None:
    """A BlockWeight in the AVX2 build's order: u = code + bias as uint8 [tiles, K / 4, 1, 16, 4] (bias =
    -least code where that is negative, else 0; N padded to whole tiles of 16 outputs with zero codes),
    scales and offsets [tiles, K / B, 1, 16]; None where the codes span more than ``span_limit``."""
    bias, span = code_bias_span(*code_range(weight))
    if span > span_limit:
        return None
    codes, scales, offsets = tile_outputs(weight.codes, weight.scales, weight.offsets, 1, group=4)
    unsigned = on_huge_pages(codes.to(torch.int16).add_(bias).to(torch.uint8))
    return I8Weight.of((unsigned, scales, offsets), {"code_bias": bias, "code_span": span})


class I8Weight(tuple):  # type: ignore[type-arg]
    """``(codes, scales, offsets)``: a weight packed for one build of ``i8_gemm``, with the keyword
    arguments that build takes beside them (``call_kwargs``: the AVX2 build's code bias and span)."""

    call_kwargs: dict[str, int]

    @classmethod
    def of(cls, tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], call_kwargs: dict[str, int]) -> I8Weight:
        packed = cls(tensors)
        packed.call_kwargs = call_kwargs
        return packed


def is_avx2(kernel: object) -> bool:
    """Whether ``kernel`` is the AVX2 build's module (tiles of 16 outputs, ``pack_avx2``)."""
    return getattr(kernel, "GEMM_COLS", GEMM_COLS) == 1


def pack_for(kernel: object, weight: BlockWeight) -> I8Weight | None:
    """``weight`` packed for ``kernel``'s build, or None where that build cannot take its codes."""
    return pack_avx2(weight) if is_avx2(kernel) else I8Weight.of(pack(weight), {})


def screen_pack(kernel: object, weight: BlockWeight) -> I8Weight:
    """A Q8_0 LM head packed for ``kernel``'s ``i8_screen``, with the keyword arguments it takes (the AVX2
    build: the code bias and span, and its activation levels, ``AVX2_SCREEN_LEVELS``)."""
    if not is_avx2(kernel):
        return I8Weight.of(pack(weight), {})
    packed = pack_avx2(weight, AVX2_SCREEN_CODE_SPAN)
    assert packed is not None, "Q8_0 codes span at most 254"
    return I8Weight.of(packed, {**packed.call_kwargs, "levels": AVX2_SCREEN_LEVELS})


def activation_levels(packed: I8Weight) -> int:
    """The activation levels each side of zero that ``packed``'s calls round to (127 unless its arguments say)."""
    return packed.call_kwargs.get("levels", 127)


def code_range(*weights: BlockWeight) -> tuple[int, int]:
    """The least and greatest code of ``weights`` (a merged layer's parts)."""
    ranges = [torch.aminmax(weight.codes) for weight in weights]
    return min(int(low) for low, _ in ranges), max(int(high) for _, high in ranges)


def code_bias_span(low: int, high: int) -> tuple[int, int]:
    """The AVX2 build's bias for codes in [low, high] (u = code + bias >= 0) and the greatest u."""
    bias = max(0, -low)
    return bias, high + bias


def fits(kernel: object, *weights: BlockWeight) -> bool:
    """Whether ``kernel``'s build takes the codes of ``weights`` (a merged layer's parts) in one copy (the AVX2
    build: u spanning at most ``AVX2_CODE_SPAN``; the VNNI build takes any)."""
    return not is_avx2(kernel) or code_bias_span(*code_range(*weights))[1] <= AVX2_CODE_SPAN


def gemm(kernel: object, x: torch.Tensor, packed: I8Weight, block: int, bf16_out: bool = False, n: int = -1,
         out: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``kernel.i8_gemm`` on ``packed`` (``pack_for``'s copy for that kernel)."""
    return kernel.i8_gemm(x, *packed, block, bf16_out, n, out, bias, **packed.call_kwargs)  # type: ignore[attr-defined]


def quantize_reference(x: torch.Tensor, block: int, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8 codes [M, K] and float32 scales [M, K / block], as the kernel rounds (to ``levels``
    steps each side of zero: 127, or the AVX2 build's screen's fewer)."""
    m, k = x.shape
    xb = x.float().view(m, k // block, block)
    d = xb.abs().amax(-1) / levels
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    q = torch.round(xb * inv[..., None]).clamp(-levels, levels)
    return q.to(torch.int8).view(m, k), d


def reference(x: torch.Tensor, weight: BlockWeight, levels: int = 127) -> torch.Tensor:
    """``i8_gemm``'s arithmetic in torch, float32 [M, N]: exact int64 block dots, then float32."""
    m, k = x.shape
    n, block = weight.codes.shape[0], weight.block
    q, d = quantize_reference(x, block, levels)
    dots = torch.einsum("mbi,nbi->mnb", q.long().view(m, -1, block), weight.codes.long().view(n, -1, block))
    out = (dots.float() * (weight.scales[None] * d[:, None])).sum(-1)
    if weight.offsets is not None:
        sums = d * q.view(m, -1, block).long().sum(-1).float()
        out = out + (weight.offsets[None] * sums[:, None]).sum(-1)
    return out
