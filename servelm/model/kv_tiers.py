"""The host tier's K/V buffer and the block copies between it, the device pool and the bytes the
storage tier keeps (the tensor side of servelm.cache.hicache).

Host layout, one block = every layer's planes for ``block_size`` tokens, a plane being K and V
(``planes`` 2) or, for a latent pool (DeepSeek's MLA, ``LatentKVCache``), the one latent row per
token (``planes`` 1: V is a view of it, so the host tier stores exactly the latent rows). Every
plane is ``width`` values wide per head: the widest of K and V. A pool whose V is narrower than K
(DeepSeek under ``--disable-mla``: K 192, V 128 per head at V2/V3's shapes) keeps V zero-padded to
K's width on the host (there, 1.2x the pool's bytes per block)::

    page_first:  data[slot, layer, plane, token, head, dim]   (a block is contiguous)
    layer_first: data[layer, plane, slot, token, head, dim]   (a layer is contiguous, as on device)

Invariants:
- ``host_dtype="auto"`` (the default) stores the pool's own dtype: a block comes back bit for bit.
  ``"int8"`` (asked for) stores int8 with one float32 scale per (block, layer, plane, head): the
  absolute maximum over the block's tokens and head_dim maps to 127, so a value is off by at most
  half a step (scale / 2) after ``from_host``.
  A pool that already stores one byte per value (fp8 KV) is kept as is.
- ``read_exact``/``write_exact`` move the pool's bytes unchanged (the storage payload).
- Only plain tensor copies (``--hicache-io-backend direct``): on CPU the pool is host memory.
"""

from __future__ import annotations

import torch

from servelm.model.kv_cache import KVCache

HOST_DTYPES = ("auto", "int8")
MEM_LAYOUTS = ("layer_first", "page_first")


def planes(kv: KVCache) -> int:
    """Tensors per layer the pool stores: K and V, or a latent pool's one row (no ``v_caches``)."""
    return 2 if kv.v_caches else 1


def plane_widths(kv: KVCache) -> tuple[int, ...]:
    """Each stored plane's values per head: ``(head_dim, v_head_dim)``, or the latent row's width."""
    return (kv.head_dim, kv.v_head_dim) if kv.v_caches else (kv.head_dim,)


def layer_planes(kv: KVCache) -> list[tuple[torch.Tensor, ...]]:
    """Each layer's stored tensors: ``(k, v)``, or ``(latent,)`` for a latent pool."""
    if not kv.v_caches:
        return [(k,) for k in kv.k_caches]
    return list(zip(kv.k_caches, kv.v_caches, strict=True))


class HostKVTier:
    """A host buffer of ``num_slots`` blocks beside ``kv`` (implements hicache's BlockMover)."""

    def __init__(self, kv: KVCache, num_slots: int, host_dtype: str = "auto",
                 layout: str = "layer_first") -> None:
        assert host_dtype in HOST_DTYPES and layout in MEM_LAYOUTS
        self.kv = kv
        self.layout = layout
        self.is_quantized = host_dtype == "int8" and kv.dtype.itemsize > 1
        self._raw_dtype = torch.uint8 if kv.dtype.itemsize == 1 and kv.dtype.is_floating_point else kv.dtype
        self.planes = planes(kv)
        self.widths = plane_widths(kv)
        self.width = max(self.widths)
        block = (kv.block_size, kv.num_kv_heads, self.width)
        store = torch.int8 if self.is_quantized else self._raw_dtype
        shape = ((num_slots, kv.num_layers, self.planes, *block) if layout == "page_first"
                 else (kv.num_layers, self.planes, num_slots, *block))
        self.data = torch.zeros(shape, dtype=store)
        self.scales = (torch.ones((num_slots, kv.num_layers, self.planes, kv.num_kv_heads), dtype=torch.float32)
                       if self.is_quantized else None)
        self._block_numel = kv.num_layers * self.planes * kv.block_size * kv.num_kv_heads * self.width

    @staticmethod
    def bytes_per_block(kv: KVCache, host_dtype: str) -> int:
        """Host bytes per block (data and scales): sizes the tier from --hicache-size."""
        numel = kv.num_layers * planes(kv) * kv.block_size * kv.num_kv_heads * max(plane_widths(kv))
        if host_dtype == "int8" and kv.dtype.itemsize > 1:
            return numel + kv.num_layers * planes(kv) * kv.num_kv_heads * 4
        return numel * kv.dtype.itemsize

    @property
    def exact_nbytes(self) -> int:
        return self._block_numel * self.kv.dtype.itemsize

    @property
    def host_nbytes(self) -> int:
        return self.bytes_per_block(self.kv, "int8" if self.is_quantized else "auto")

    @property
    def nbytes(self) -> int:
        scales = self.scales.numel() * 4 if self.scales is not None else 0
        return self.data.numel() * self.data.element_size() + scales

    # -- device block <-> one tensor ---------------------------------------------------------
    def _gather(self, block_id: int) -> torch.Tensor:
        """The block's planes ``[layers, planes, block_size, heads, width]`` in the pool's raw dtype
        (a narrower plane zero-padded to ``width``)."""
        start = block_id * self.kv.block_size
        end = start + self.kv.block_size
        rows = [torch.stack([torch.nn.functional.pad(plane[start:end].view(self._raw_dtype),
                                                     (0, self.width - plane.shape[-1]))
                             for plane in layer]) for layer in layer_planes(self.kv)]
        return torch.stack(rows)

    def _scatter(self, block_id: int, block: torch.Tensor) -> None:
        start = block_id * self.kv.block_size
        end = start + self.kv.block_size
        for layer, stored in enumerate(layer_planes(self.kv)):
            for plane, cache in enumerate(stored):
                cache.view(self._raw_dtype)[start:end].copy_(block[layer, plane, ..., :cache.shape[-1]])

    def _slot(self, slot: int) -> torch.Tensor:
        return self.data[slot] if self.layout == "page_first" else self.data[:, :, slot]

    # -- BlockMover ------------------------------------------------------------------------------
    def to_host(self, block_id: int, slot: int) -> None:
        block = self._gather(block_id)
        if self.scales is None:
            self._slot(slot).copy_(block)
            return
        values = block.float()
        # [layers, planes, 1, heads, 1]: absmax over the block's tokens and head_dim
        scale = values.abs().amax(dim=(2, 4), keepdim=True).clamp_min(1e-8) / 127.0
        self._slot(slot).copy_(torch.round(values / scale).clamp_(-127, 127).to(torch.int8))
        self.scales[slot].copy_(scale.view(self.scales.shape[1:]))

    def from_host(self, slot: int, block_id: int) -> None:
        stored = self._slot(slot)
        if self.scales is None:
            self._scatter(block_id, stored)
            return
        scale = self.scales[slot].view(self.kv.num_layers, self.planes, 1, self.kv.num_kv_heads, 1)
        self._scatter(block_id, (stored.float() * scale).to(self.kv.dtype))

    def read_exact(self, block_id: int) -> bytes:
        return self._gather(block_id).contiguous().view(torch.uint8).numpy().tobytes()

    def write_exact(self, block_id: int, payload: bytes) -> None:
        raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self._raw_dtype)
        shape = (self.kv.num_layers, self.planes, self.kv.block_size, self.kv.num_kv_heads, self.width)
        self._scatter(block_id, raw.view(shape))
