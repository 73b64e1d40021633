"""GGUF quantized tensors as int8 codes with a float scale (and offset) per block: a lossless repack.

Every GGUF type this module reads stores, per block of B inputs of one row, small integers and a
scale (some also an offset), so its dequantized weight is exactly
``codes[n, k] * scales[n, k // B] + offsets[n, k // B]`` with int8 ``codes``:

    type   B   codes      scale            offset
    Q8_0   32  -128..127  d                -
    Q4_0   32  -8..7      d                -
    Q5_0   32  -16..15    d                -
    Q4_1   32  0..15      d                m
    Q5_1   32  0..31      d                m
    Q4_K   32  0..15      d * sc[j]        -dmin * m[j]
    Q5_K   32  0..31      d * sc[j]        -dmin * m[j]
    Q6_K   16  -32..31    d * sc[j]        -

Scales and offsets come from the block headers (``gguf`` parses the K-quant 6-bit scales). The
codes of Q8_0, Q4_0, Q4_1 and Q4_K are the stored bytes (or nibbles) themselves; those of the other types
come from the ``gguf`` package's own float32 dequantization divided by the scales, and ``repack``
checks that they are integers and rebuild the dequantized tensor exactly (else it raises). Other types
(Q2_K, Q3_K, IQ*, float) have no repack here: those tensors stay dequantized.

Invariants: ``codes`` is int8 ``[N, K]``; ``scales`` (and ``offsets``) float32 ``[N, K // block]``.
``BlockWeight.compact`` holds the same scales and offsets in fewer bytes for the AVX2 block kernel
(fp16 where every value is one, the K-quants' 6-bit sub-scales times a float32 per 256 inputs), each
checked to widen back to the float32 values bit for bit.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import numpy as np
import torch

REPACK_ROWS = 4096
"""Rows repacked at a time: the float32 temporaries of a 262,144-row embedding (gguf's
dequantization, the division, the rebuild check; ~0.6 GiB each) would otherwise all be alive at
once, for a peak of several times the finished model at start-up."""

# ggml type name -> block size of the scales
REPACKABLE = {"Q8_0": 32, "Q4_0": 32, "Q5_0": 32, "Q4_1": 32, "Q5_1": 32, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}


PACKED_BITS = (4, 5, 6)
"""Bit widths ``PackedCodes`` stores codes at (wider codes, Q8_0's, stay int8 bytes)."""


@dataclass(frozen=True)
class PackedCodes:
    """A weight's int8 codes at their own bit width, 4 * ``bits`` bytes per 32 inputs of a row (the
    layout the AVX2 kernel's ``packed_*`` functions read; gguf_kernel_avx2.cpp ``PackedCodes``):
    16 bytes of nibbles (byte j: code j's low 4 bits, code j + 16's in the high nibble), then (5 and
    6 bits) the high bits of the 32 codes as one little-endian integer of 4 or 8 bytes, at the bit
    positions ``_plane_positions`` gives. Stored is u = code (``centered`` False) or
    code + 2^(bits - 1) (``centered``: signed codes). Lossless: ``unpack`` gives the codes back.

    The narrowest width the codes' range fits (any GGUF type's: Q4_0/Q4_1/Q4_K 4 bits, Q5_* 5, Q6_K
    6, a fused Q4_K+Q6_K weight 6): ``of`` reads the codes, not the type names."""

    data: torch.Tensor   # [N, K * bits / 8] uint8
    bits: int
    centered: bool

    @property
    def in_features(self) -> int:
        return self.data.shape[1] * 8 // self.bits

    @classmethod
    def of(cls, codes: torch.Tensor) -> PackedCodes | None:
        """``codes`` [N, K] int8 packed at the narrowest of ``PACKED_BITS`` that holds them, or None
        (wider codes, K not a multiple of 32, no rows)."""
        n, k = codes.shape
        if n == 0 or k == 0 or k % 32:
            return None
        low, high = (int(value) for value in torch.aminmax(codes))
        for bits in PACKED_BITS:
            for centered in (False, True):
                bias = 1 << (bits - 1) if centered else 0
                if low + bias >= 0 and high + bias < 1 << bits:
                    data = torch.empty(n, k * bits // 8, dtype=torch.uint8)
                    for start in range(0, n, REPACK_ROWS):
                        _pack_rows(codes[start:start + REPACK_ROWS], bits, bias, data[start:start + REPACK_ROWS])
                    return cls(data, bits, centered)
        return None

    def unpack(self, rows: torch.Tensor | slice | None = None) -> torch.Tensor:
        """The int8 codes [N, K] (or those of ``rows``: indices or a slice)."""
        data = self.data if rows is None else self.data[rows]
        n = data.shape[0]
        steps = data.view(n, -1, 4 * self.bits)
        nibbles = steps[..., :16].to(torch.int16)
        u = torch.cat([nibbles & 15, nibbles >> 4], dim=-1)   # [n, K / 32, 32]
        if self.bits > 4:
            plane = _plane_integer(steps[..., 16:])            # [n, K / 32] int64
            u = u | (((plane[..., None] >> _plane_positions(self.bits)) & ((1 << (self.bits - 4)) - 1)) << 4).to(torch.int16)
        codes = u - ((1 << (self.bits - 1)) if self.centered else 0)
        return codes.to(torch.int8).reshape(n, -1)


@functools.cache
def _plane_positions(bits: int) -> torch.Tensor:
    """[32] int64: where code i's high bits (bit 4, or bits 4-5) start in a 5- or 6-bit step's plane
    integer: with i' = i % 16 and h = i // 16, 16 (i' % 2) + 8 h + i' // 2 for 5 bits,
    16 (i' % 4) + 8 h + 2 (i' // 4) for 6 (the kernel's variable shifts per 32/64-bit lane).
    Built once per width (an embedding lookup unpacks a row every step); callers never write to it."""
    i = torch.arange(32)
    low, h = i % 16, i // 16
    if bits == 5:
        return 16 * (low % 2) + 8 * h + low // 2
    return 16 * (low % 4) + 8 * h + 2 * (low // 4)


def _plane_integer(plane: torch.Tensor) -> torch.Tensor:
    """[..., 4 or 8] uint8 little-endian bytes -> [...] int64 (8 bytes: bit 63 is the sign bit, as the
    bytes shifted into place give it): the bytes read as one integer (x86 and Arm are little-endian),
    not a shift and an or per byte (a few microseconds each, per embedding lookup)."""
    assert sys.byteorder == "little"
    whole = plane.contiguous()
    if plane.shape[-1] == 4:
        return whole.view(torch.int32).squeeze(-1).to(torch.int64) & 0xFFFFFFFF
    return whole.view(torch.int64).squeeze(-1)


def _pack_rows(codes: torch.Tensor, bits: int, bias: int, out: torch.Tensor) -> None:
    """``PackedCodes``' bytes of ``codes`` [n, K] int8 (each code + ``bias`` in 0 .. 2^bits - 1) into
    ``out`` [n, K * bits / 8] uint8. Worked in uint8 throughout (the sum code + bias wraps to itself,
    a shift left drops the bits a nibble does not hold): no int16 or int64 copy of the codes, a
    few-fold less start-up time than widening them (the same bytes: test_gguf_blocks)."""
    n, k = codes.shape
    u = codes.view(torch.uint8).view(n, k // 32, 32)
    if bias:
        u = u + bias
    steps = out.view(n, k // 32, 4 * bits)
    torch.bitwise_or(u[..., :16] & 15, u[..., 16:] << 4, out=steps[..., :16])
    if bits > 4:
        # ``_plane_positions`` as bytes: the plane's byte 2 r + h holds the high bits of codes
        # 16 h + lanes s + r at its bits width s (s = 0 .. per_byte - 1)
        width = bits - 4   # high bits per code
        per_byte = 8 // width
        lanes = 16 // per_byte
        high = (u >> 4).view(n, k // 32, 2, per_byte, lanes).permute(0, 1, 4, 2, 3)   # [.., r, h, r']
        plane = steps[..., 16:].view(n, k // 32, lanes, 2)
        plane.copy_(high[..., 0])
        for slot in range(1, per_byte):
            plane |= high[..., slot] << (width * slot)


SUPER_INPUTS = 256
"""Inputs per K-quant super-block: one fp16 d (and dmin) each."""


@dataclass(frozen=True)
class SubScaled:
    """Block values [N, K // block] (a K-quant's scales or offsets) as int8 ``sub`` [N, K // block]
    times one float32 ``multipliers`` [N, K // 256] per super-block: scale = sc * d, offset = m * -dmin
    (sc, m: the 6-bit sub-scales; Q6_K's signed 8-bit sc), each an exact float32 product, so
    ``values`` is bit for bit the float32 array ``_headers`` computes."""

    sub: torch.Tensor           # [N, K // block] int8
    multipliers: torch.Tensor   # [N, K // 256] float32

    def values(self) -> torch.Tensor:
        """[N, K // block] float32."""
        per_super = self.sub.shape[1] // max(self.multipliers.shape[1], 1)
        return self.sub.float() * self.multipliers.repeat_interleave(per_super, dim=1)

    def rows(self, ids: torch.Tensor | slice) -> SubScaled:
        return SubScaled(self.sub[ids].contiguous(), self.multipliers[ids].contiguous())

    def repeat_blocks(self, repeat: int) -> SubScaled:
        """The same values per ``block / repeat`` inputs (``BlockWeight.with_block``)."""
        return SubScaled(self.sub.repeat_interleave(repeat, dim=1), self.multipliers)

    def kernel_layout(self) -> torch.Tensor:
        """int8 [N, K // block + 4 * K // 256]: each row's sub-scales, then its multipliers' float32
        bytes (gguf_kernel_avx2.cpp ``BlockValues``)."""
        return torch.cat([self.sub, self.multipliers.contiguous().view(torch.int8)], dim=1).contiguous()

    @staticmethod
    def cat(parts: list[SubScaled]) -> SubScaled:
        return SubScaled(torch.cat([part.sub for part in parts]), torch.cat([part.multipliers for part in parts]))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Float32 tensors equal bit for bit (signed zeros and NaN payloads too)."""
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.int32), b.contiguous().view(torch.int32))


def factors_give(factors: SubScaled | None, values: torch.Tensor) -> bool:
    """Whether ``factors`` give ``values`` (float32 [N, K // block]) bit for bit."""
    return factors is not None and same_bits(factors.values(), values)


def fp16_exact(values: torch.Tensor) -> bool:
    """Whether every float32 value is an fp16 value (a GGUF type's fp16 d, m: Q8_0, Q4_0, Q5_0, Q4_1),
    so that a copy in fp16 widens back to the same floats."""
    return same_bits(values.half().float(), values)


def compact_values(values: torch.Tensor, factors: SubScaled | None) -> torch.Tensor:
    """``values`` (float32 scales or offsets [N, K // block]) in the fewest bytes the AVX2 block kernel
    widens back to exactly these floats: ``factors``' int8 layout, else fp16, else ``values`` itself."""
    if factors_give(factors, values):
        assert factors is not None
        return factors.kernel_layout()
    return values.half() if fp16_exact(values) else values


@dataclass
class BlockWeight:
    """One weight as int8 codes plus a float32 scale (and offset) per ``block`` inputs of a row.

    The codes live in ``stored_codes`` (int8), in ``packed`` (their bit width), or both; ``drop_codes``
    frees the int8 copy where ``packed`` holds them, and ``codes`` then unpacks them (a new tensor per
    read: for load-time work, checks and tools, never a decode step)."""

    stored_codes: torch.Tensor | None   # [N, K] int8, or None once dropped
    scales: torch.Tensor           # [N, K // block] float32
    offsets: torch.Tensor | None   # [N, K // block] float32, or None (symmetric types)
    block: int
    kind: str                      # the GGUF type(s) it came from, e.g. "Q8_0" or "Q5_0+Q8_0"
    packed: PackedCodes | None = None
    scale_factors: SubScaled | None = None    # the K-quants' scales as sub-scales x d (from the file)
    offset_factors: SubScaled | None = None   # their offsets as sub-scales x -dmin
    compact: tuple[torch.Tensor, torch.Tensor | None] | None = None
    """``(scales, offsets)`` in the AVX2 block kernel's compact layouts (``compact_values``), made
    once by ``with_compact``."""

    @property
    def codes(self) -> torch.Tensor:
        """[N, K] int8."""
        if self.stored_codes is not None:
            return self.stored_codes
        assert self.packed is not None, "a block weight holds its codes in one form at least"
        return self.packed.unpack()

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the weight."""
        scales_rows = self.scales.shape[0]
        if self.stored_codes is not None:
            return scales_rows, self.stored_codes.shape[1]
        assert self.packed is not None
        return scales_rows, self.packed.in_features

    def row_codes(self, ids: torch.Tensor | slice) -> torch.Tensor:
        """The int8 codes [len(ids), K] of rows ``ids`` (unpacked from ``packed`` where dropped)."""
        if self.stored_codes is not None:
            return self.stored_codes[ids]
        assert self.packed is not None
        return self.packed.unpack(ids)

    def with_packed(self) -> PackedCodes | None:
        """``packed``, made (once) from the codes where they fit ``PACKED_BITS``."""
        if self.packed is None:
            self.packed = PackedCodes.of(self.codes)
        return self.packed

    def with_compact(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``compact``, made (once) from the float32 scales and offsets and the file's factors."""
        if self.compact is None:
            self.compact = (compact_values(self.scales, self.scale_factors),
                            None if self.offsets is None else compact_values(self.offsets, self.offset_factors))
        return self.compact

    def drop_codes(self) -> int:
        """Free the int8 codes where ``packed`` holds them; the bytes freed."""
        if self.packed is None or self.stored_codes is None:
            return 0
        freed = self.stored_codes.nbytes
        self.stored_codes = None
        return freed

    @property
    def nbytes(self) -> int:
        compact = [t for t in self.compact or () if t is not None and t is not self.scales and t is not self.offsets]
        return ((self.stored_codes.nbytes if self.stored_codes is not None else 0)
                + (self.packed.data.nbytes if self.packed is not None else 0) + self.scales.nbytes
                + (self.offsets.nbytes if self.offsets is not None else 0) + sum(t.nbytes for t in compact))

    def dequantize(self, rows: slice | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight ``[N, K]`` (or its ``rows``), in float32 then cast to ``dtype``; the whole
        weight in another dtype is built ``REPACK_ROWS`` rows at a time (no float32 copy of a
        262k-row LM head alive at start-up)."""
        if rows is None and (dtype != torch.float32 or self.stored_codes is None) and self.shape[0] > REPACK_ROWS:
            out = torch.empty(self.shape, dtype=dtype)
            for start in range(0, self.shape[0], REPACK_ROWS):
                part = slice(start, start + REPACK_ROWS)
                out[part] = self.dequantize(part, dtype)
            return out
        codes = self.codes if rows is None else self.row_codes(rows)
        scales = self.scales if rows is None else self.scales[rows]
        n, k = codes.shape
        values = codes.view(n, k // self.block, self.block).float().mul_(scales[..., None])
        if self.offsets is not None:
            values.add_((self.offsets if rows is None else self.offsets[rows])[..., None])
        return values.reshape(n, k).to(dtype)

    def with_block(self, block: int) -> BlockWeight:
        """The same weight with scales per ``block`` (only a smaller divisor of the own block)."""
        if block == self.block:
            return self
        assert self.block % block == 0, (self.block, block)
        repeat = self.block // block
        return BlockWeight(self.stored_codes, self.scales.repeat_interleave(repeat, dim=1),
                           None if self.offsets is None else self.offsets.repeat_interleave(repeat, dim=1),
                           block, self.kind, self.packed,
                           None if self.scale_factors is None else self.scale_factors.repeat_blocks(repeat),
                           None if self.offset_factors is None else self.offset_factors.repeat_blocks(repeat))

    def narrow(self, dim: int, start: int, size: int) -> BlockWeight:
        """Outputs (``dim`` 0) or inputs (``dim`` 1) ``start .. start + size``: the same codes,
        scales and offsets. Inputs only along whole blocks (ValueError otherwise)."""
        if dim == 0:
            return self._rows(slice(start, start + size))
        if start % self.block or size % self.block:
            raise ValueError(f"inputs {start}..{start + size} cut {self.kind}'s blocks of {self.block}")
        blocks = slice(start // self.block, (start + size) // self.block)
        supers = slice(start // SUPER_INPUTS, (start + size) // SUPER_INPUTS)

        def cut(factors: SubScaled | None) -> SubScaled | None:   # whole super-blocks only
            if factors is None or start % SUPER_INPUTS or size % SUPER_INPUTS:
                return None
            return SubScaled(factors.sub[:, blocks].contiguous(), factors.multipliers[:, supers].contiguous())

        return BlockWeight(self.codes[:, start:start + size].contiguous(), self.scales[:, blocks].contiguous(),
                           None if self.offsets is None else self.offsets[:, blocks].contiguous(),
                           self.block, self.kind, None, cut(self.scale_factors), cut(self.offset_factors))

    def permute_rows(self, order: torch.Tensor) -> BlockWeight:
        return self._rows(order)

    def _rows(self, ids: torch.Tensor | slice) -> BlockWeight:
        """Rows ``ids`` (indices or a slice) as a weight of their own, in int8 codes (only those rows
        unpacked where the int8 copy was dropped)."""
        return BlockWeight(self.row_codes(ids).contiguous(), self.scales[ids].contiguous(),
                           None if self.offsets is None else self.offsets[ids].contiguous(),
                           self.block, self.kind, None,
                           None if self.scale_factors is None else self.scale_factors.rows(ids),
                           None if self.offset_factors is None else self.offset_factors.rows(ids))


def tile_outputs(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None, cols: int,
                 group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Codes [N, K] and scales/offsets [N, K / B] in the GEMM kernels' tile order (gguf_rows.pack,
    gguf_i8gemm.pack): tiles of ``cols`` x 16 outputs, N padded with zero codes, scales and offsets to
    whole tiles; codes [tiles, K / group, cols, 16, group] (``group`` consecutive inputs of an output
    together), scales and offsets [tiles, K / B, cols, 16]; all contiguous."""
    n, k = codes.shape
    width = 16 * cols
    tiles = -(-n // width)
    pad = tiles * width - n
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, k)])
    packed = codes.view(tiles, cols, 16, k // group, group).permute(0, 3, 1, 2, 4).contiguous()
    return packed, tile_blocks(scales, cols), None if offsets is None else tile_blocks(offsets, cols)


def tile_blocks(values: torch.Tensor, cols: int) -> torch.Tensor:
    """Per-row values [N, J] (scales, offsets, sub-scales: any dtype) in the tile order of
    ``tile_outputs``: [tiles, J, cols, 16], N padded with zeros to whole tiles of ``cols`` x 16 rows;
    contiguous."""
    width = 16 * cols
    tiles = -(-values.shape[0] // width)
    pad = tiles * width - values.shape[0]
    if pad:
        values = torch.cat([values, values.new_zeros(pad, values.shape[1])])
    return values.view(tiles, cols, 16, -1).permute(0, 3, 1, 2).contiguous()


def concat_rows(parts: list[BlockWeight]) -> BlockWeight:
    """Stack weights over rows (a fused QKV or gate_up); scales go to the smallest block size."""
    block = min(part.block for part in parts)
    parts = [part.with_block(block) for part in parts]
    has_offsets = any(part.offsets is not None for part in parts)
    offsets = (torch.cat([part.offsets if part.offsets is not None else torch.zeros_like(part.scales)
                          for part in parts]) if has_offsets else None)
    kinds = "+".join(dict.fromkeys(part.kind for part in parts))
    scale_factors = (SubScaled.cat([part.scale_factors for part in parts])  # type: ignore[misc]
                     if all(part.scale_factors is not None for part in parts) else None)
    offset_factors = None
    if has_offsets and scale_factors is not None:
        # a part without offsets (Q6_K beside Q4_K): zero sub-scales times 0.0, the zeros above
        offset_parts = [part.offset_factors if part.offsets is not None else
                        SubScaled(torch.zeros_like(part.scales, dtype=torch.int8),
                                  torch.zeros_like(part.scale_factors.multipliers))  # type: ignore[union-attr]
                        for part in parts]
        if all(factors is not None for factors in offset_parts):
            offset_factors = SubScaled.cat(offset_parts)  # type: ignore[arg-type]
    return BlockWeight(torch.cat([part.codes for part in parts]), torch.cat([part.scales for part in parts]),
                       offsets, block, kinds, None, scale_factors, offset_factors)


def _f16(column: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(column).view(np.float16).astype(np.float32)


def _headers(kind: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-block ``(scales, offsets)`` of ``blocks`` [num_blocks, block_bytes] uint8, one value per
    ``REPACKABLE[kind]`` inputs, in float32 exactly as gguf's dequantization computes them."""
    from gguf.quants import Q4_K

    if kind in ("Q8_0", "Q4_0", "Q5_0"):
        return _f16(blocks[:, 0:2]), None
    if kind in ("Q4_1", "Q5_1"):
        return _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))
        return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
    if kind == "Q6_K":
        d = _f16(blocks[:, 208:210])
        sc = np.ascontiguousarray(blocks[:, 192:208]).view(np.int8).astype(np.float32)
        return d * sc, None
    raise ValueError(f"no repack for GGUF type {kind}")


def _factors(kind: str, blocks: np.ndarray, rows: int, cols: int) -> tuple[SubScaled | None, SubScaled | None]:
    """The K-quants' ``(scale_factors, offset_factors)`` of ``blocks`` [num_blocks, block_bytes] (one
    block per 256 inputs of ``rows`` rows of ``cols``): the sub-scales ``_headers`` multiplies, with d
    (and -dmin) as multipliers; (None, None) for the other types (their scales are fp16 already)."""
    from gguf.quants import Q4_K

    def sub_scaled(sub: np.ndarray, multipliers: np.ndarray) -> SubScaled:
        return SubScaled(torch.from_numpy(np.ascontiguousarray(sub.astype(np.int8).reshape(rows, -1))),
                         torch.from_numpy(np.ascontiguousarray(multipliers.reshape(rows, cols // SUPER_INPUTS))))

    if kind in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blocks[:, 0:2]), _f16(blocks[:, 2:4])
        sc, m = Q4_K.get_scale_min(np.ascontiguousarray(blocks[:, 4:16]))   # 6-bit: 0..63
        return sub_scaled(sc, d), sub_scaled(m, -dmin)
    if kind == "Q6_K":
        return sub_scaled(np.ascontiguousarray(blocks[:, 192:208]).view(np.int8), _f16(blocks[:, 208:210])), None
    return None, None


def repack(raw: np.ndarray, shape: tuple[int, int], kind: str) -> BlockWeight:
    """GGUF bytes of one ``[N, K]`` tensor of type ``kind`` -> its lossless BlockWeight, in chunks
    of ``REPACK_ROWS`` rows.

    Raises ValueError when ``kind`` has no repack or the codes would not rebuild the tensor exactly.
    """
    if kind not in REPACKABLE:
        raise ValueError(f"no repack for GGUF type {kind}")
    rows, cols = shape
    by_row = raw.reshape(rows, -1)
    parts = [_repack_rows(by_row[start:start + REPACK_ROWS], cols, kind) for start in range(0, rows, REPACK_ROWS)]
    if len(parts) == 1:
        return parts[0]
    scale_factors = [part.scale_factors for part in parts]
    offset_factors = [part.offset_factors for part in parts]
    return BlockWeight(torch.cat([part.codes for part in parts]), torch.cat([part.scales for part in parts]),
                       None if parts[0].offsets is None else torch.cat([part.offsets for part in parts]),
                       parts[0].block, kind, None,
                       SubScaled.cat(scale_factors) if scale_factors[0] is not None else None,  # type: ignore[arg-type]
                       SubScaled.cat(offset_factors) if offset_factors[0] is not None else None)  # type: ignore[arg-type]


_WHOLE_ARRAY_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q4_K")
"""Types whose int8 codes are their bytes (or nibbles) as stored: ``dequantize_raw`` and ``repack``
read them over the whole array at once. The ``gguf`` package's numpy code works a few rows at a
time and ``repack`` then divided its floats back into codes: together several seconds of every
start-up of a Q4_1 model, for the same values bit for bit."""


def _stored_codes(blocks: np.ndarray, kind: str) -> np.ndarray:
    """The int8 codes [num_blocks, inputs per block] of ``blocks`` [num_blocks, block_bytes] of a
    ``_WHOLE_ARRAY_TYPES`` type. 4-bit codes: each 32 bytes hold 64 inputs, the low nibbles the
    first 32, the high nibbles the next (one such group in Q4_0/Q4_1, four in Q4_K)."""
    head = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4, "Q4_K": 16}[kind]   # f16 d (m, dmin; Q4_K's 6-bit scales)
    quants = blocks[:, head:]
    if kind == "Q8_0":
        return np.ascontiguousarray(quants).view(np.int8)
    groups = quants.reshape(len(quants), -1, 1, min(32, quants.shape[1]))
    codes = np.concatenate([groups & 15, groups >> 4], axis=2).reshape(len(quants), -1).view(np.int8)
    return codes - 8 if kind == "Q4_0" else codes


def dequantize_raw(raw: np.ndarray, kind: str) -> np.ndarray:
    """GGUF bytes of type ``kind`` (uint8, whole blocks) -> their float32 values, flat."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    if kind not in _WHOLE_ARRAY_TYPES:
        from gguf.quants import dequantize

        return dequantize(raw, GGMLQuantizationType[kind]).astype(np.float32, copy=False).reshape(-1)
    blocks = np.asarray(raw, dtype=np.uint8).reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType[kind]][1])
    scales, offsets = _headers(kind, blocks)
    values = _stored_codes(blocks, kind).reshape(scales.size, -1).astype(np.float32) * scales.reshape(-1, 1)
    if offsets is not None:
        values += offsets.reshape(-1, 1)
    return values.reshape(-1)


def _repack_rows(raw: np.ndarray, cols: int, kind: str) -> BlockWeight:
    """``repack`` of ``raw`` [rows, bytes per row]."""
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    rows = raw.shape[0]
    ggml_type = GGMLQuantizationType[kind]
    _, block_bytes = GGML_QUANT_SIZES[ggml_type]
    block = REPACKABLE[kind]
    blocks = np.ascontiguousarray(raw).reshape(-1, block_bytes)
    scales, offsets = _headers(kind, blocks)
    scales = scales.reshape(rows, cols // block)
    scale_factors, offset_factors = _factors(kind, blocks, rows, cols)
    if kind in _WHOLE_ARRAY_TYPES:  # codes as stored: dequantize() computes gguf's values exactly
        return BlockWeight(torch.from_numpy(_stored_codes(blocks, kind).reshape(rows, cols)),
                           torch.from_numpy(np.ascontiguousarray(scales)),
                           None if offsets is None else torch.from_numpy(offsets.reshape(rows, cols // block)),
                           block, kind, None, scale_factors, offset_factors)
    values = dequantize_raw(raw, kind).reshape(rows, cols)
    grouped = values.reshape(rows, cols // block, block)
    shifted = grouped - offsets.reshape(rows, cols // block, 1) if offsets is not None else grouped
    safe = np.where(scales == 0, 1.0, scales)[..., None]
    codes = np.rint(shifted / safe)
    if codes.size and (codes.min() < -128 or codes.max() > 127):
        raise ValueError(f"{kind}: codes out of int8 range")
    result = BlockWeight(torch.from_numpy(codes.astype(np.int8).reshape(rows, cols)),
                         torch.from_numpy(np.ascontiguousarray(scales)),
                         None if offsets is None else torch.from_numpy(
                             np.ascontiguousarray(offsets.reshape(rows, cols // block))),
                         block, kind, None, scale_factors, offset_factors)
    rebuilt = result.dequantize().numpy()
    if not np.array_equal(rebuilt, values):
        error = float(np.abs(rebuilt - values).max())
        scale = float(np.abs(values).max())
        if error > 1e-6 * max(scale, 1e-30):   # float rounding of scale * code + offset only
            raise ValueError(f"{kind}: repack does not rebuild the tensor (max error {error:g})")
    return result
