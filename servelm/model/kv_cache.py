"""The paged KV pool: the K/V tensors behind the block ids the scheduler hands out.

Layout (per layer, K and V separately)::

    k[layer]: [num_blocks * block_size, num_kv_heads, head_dim]
    v[layer]: [num_blocks * block_size, num_kv_heads, v_head_dim]   (v_head_dim: head_dim unless set)
               slot = block_id * block_size + offset_in_block

``LatentKVCache`` (multi-head latent attention) holds one row per token and layer instead, V a view
of its first columns.

Invariants:
- Block ids come from the scheduler (servelm/cache); this module never allocates or frees blocks,
  it only stores what the attention layers write at the slots the ForwardBatch names.
- The stored dtype may be narrower than the compute dtype (float8 with ``--kv-cache-dtype fp8_*``):
  values are rounded on write and attention upcasts what it reads.
- ``layer_id`` is the model's layer index; a pipeline stage's pool starts at its first layer.
- The pool is zero-initialised: attention may gather slots it then masks out, and masked values
  must be finite (0 * NaN would poison the softmax-weighted sum).
"""

from __future__ import annotations

import mmap

import torch

from servelm.model.huge_pages import advise_huge_pages


class KVCache:
    """K and V tensors of every layer, indexed by slot."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, first_layer: int = 0,
                 v_head_dim: int | None = None) -> None:
        self.num_layers = num_layers
        self.first_layer = first_layer
        """Model index of this pool's first layer: a pipeline stage holds K/V for its layers
        ``first_layer .. first_layer + num_layers - 1`` only."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        """V's width per head (DeepSeek's expanded K/V: 192-wide K, 128-wide V); K's elsewhere."""
        self.dtype = dtype
        self.k_caches, self.v_caches = self._allocate(device)

    def _allocate(self, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The K and the V tensor of every layer."""
        slots, num_layers = self.num_blocks * self.block_size, self.num_layers
        if self.v_head_dim == self.head_dim:
            pools = _zeroed_pools(2 * num_layers, (slots, self.num_kv_heads, self.head_dim), self.dtype, device)
            return pools[:num_layers], pools[num_layers:]
        return (_zeroed_pools(num_layers, (slots, self.num_kv_heads, self.head_dim), self.dtype, device),
                _zeroed_pools(num_layers, (slots, self.num_kv_heads, self.v_head_dim), self.dtype, device))

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k_caches, *self.v_caches))

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        v_head_dim: int | None = None) -> int:
        """Bytes one token's K and V take across all layers."""
        width = head_dim + (head_dim if v_head_dim is None else v_head_dim)
        return num_layers * num_kv_heads * width * torch.empty((), dtype=dtype).element_size()

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ``[num_tokens, num_kv_heads, head_dim]`` at ``slots`` ``[num_tokens]``."""
        k_cache, v_cache = self.layer(layer_id)
        k, v = k.to(self.dtype), v.to(self.dtype)
        if self.dtype.itemsize == 1 and self.dtype.is_floating_point:
            # index_copy_ has no float8 kernel on CPU; the bytes are what we store
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
            k, v = k.view(torch.uint8), v.view(torch.uint8)
        elif self.dtype.itemsize == 2 and _pairs_as_words(k) and _pairs_as_words(v):
            # bf16/fp16 rows copied as int32 words: CPU index_copy_ moves 2x the bytes per element
            # (0.021 against 0.046 ms for 512 rows of Gemma 3's 256-dim head, one thread)
            k_cache, v_cache = k_cache.view(torch.int32), v_cache.view(torch.int32)
            k, v = k.view(torch.int32), v.view(torch.int32)
        k_cache.index_copy_(0, slots, k)
        v_cache.index_copy_(0, slots, v)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy every slot of each (source, destination) block, in every layer of this pool."""
        size = self.block_size
        device = self.k_caches[0].device if self.k_caches else None
        offsets = torch.arange(size, device=device)
        sources = (torch.tensor([s for s, _ in copies], device=device)[:, None] * size + offsets).flatten()
        destinations = (torch.tensor([d for _, d in copies], device=device)[:, None] * size + offsets).flatten()
        for cache in (*self.k_caches, *self.v_caches):
            view = cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache
            view.index_copy_(0, destinations, view.index_select(0, sources))

    def copy_slots(self, copies: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) slot's K/V in every layer; all sources are read before
        any destination is written."""
        device = self.k_caches[0].device if self.k_caches else None
        sources = torch.tensor([s for s, _ in copies], device=device)
        destinations = torch.tensor([d for _, d in copies], device=device)
        for cache in (*self.k_caches, *self.v_caches):
            view = cache.view(torch.uint8) if cache.dtype.itemsize == 1 else cache
            view.index_copy_(0, destinations, view.index_select(0, sources))

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, ``[num_slots, num_kv_heads, head_dim]`` each."""
        index = layer_id - self.first_layer
        return self.k_caches[index], self.v_caches[index]

    # -- whole blocks as bytes (prefill/decode disaggregation) ---------------------------------
    def _as_blocks(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(torch.uint8).view(self.num_blocks, -1)

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of ``block_ids``, ``[num_layers, len(block_ids), bytes_per_block]`` uint8 each,
        on the CPU (bytes as stored: float8 K/V stays one byte per element)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.k_caches[0].device)
        k = torch.stack([self._as_blocks(t).index_select(0, index) for t in self.k_caches])
        v = (torch.stack([self._as_blocks(t).index_select(0, index) for t in self.v_caches]) if self.v_caches
             else k.new_empty(k.shape[0], k.shape[1], 0))   # a latent pool stores no V
        return k.cpu().contiguous(), v.cpu().contiguous()

    def write_blocks(self, block_ids: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``read_blocks``' output at ``block_ids`` of this pool."""
        device = self.k_caches[0].device
        index = torch.tensor(block_ids, dtype=torch.long, device=device)
        for caches, blocks in ((self.k_caches, k), (self.v_caches, v)):
            for layer, cache in enumerate(caches):
                self._as_blocks(cache).index_copy_(0, index, blocks[layer].to(device))


class LatentKVCache(KVCache):
    """Multi-head latent attention's pool (DeepSeek-V2/V3): per layer and token one row, the
    compressed KV latent (``v_head_dim`` = kv_lora_rank columns) then the rope key
    (qk_rope_head_dim), as one KV "head" ``[num_slots, 1, head_dim]`` that every query head reads.
    K is the whole row; V is its first ``v_head_dim`` columns, a view (``layer``), so nothing is
    stored twice: ``v_caches`` is empty and ``write`` stores K only."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device, first_layer: int = 0,
                 v_head_dim: int | None = None) -> None:
        assert num_kv_heads == 1 and v_head_dim is not None and v_head_dim <= head_dim, \
            "a latent pool holds one row per token, V within it"
        super().__init__(num_layers, num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                         first_layer, v_head_dim)

    def _allocate(self, device: torch.device) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        shape = (self.num_blocks * self.block_size, 1, self.head_dim)
        return _zeroed_pools(self.num_layers, shape, self.dtype, device), []

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                        v_head_dim: int | None = None) -> int:
        """Bytes one token's latent rows take across all layers (V is inside them)."""
        return num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write(self, layer_id: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the latent rows ``k`` ``[num_tokens, 1, head_dim]``; ``v`` is their first
        ``v_head_dim`` columns and is not stored again."""
        cache = self.k_caches[layer_id - self.first_layer]
        k = k.to(self.dtype)
        if self.dtype.itemsize == 1 and self.dtype.is_floating_point:   # as KVCache.write: no float8 kernel
            cache, k = cache.view(torch.uint8), k.view(torch.uint8)
        cache.index_copy_(0, slots, k)

    def layer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        latent = self.k_caches[layer_id - self.first_layer]
        return latent, latent[..., :self.v_head_dim]


def pool_class(latent: bool) -> type[KVCache]:
    """The pool for a model's attention layers: latent rows (``Attention.latent``, MLA) or per-head
    K and V."""
    return LatentKVCache if latent else KVCache


def _pairs_as_words(x: torch.Tensor) -> bool:
    """Whether 2-byte ``x`` can be viewed as int32 words (even last dim of stride 1, even strides)."""
    return (x.shape[-1] % 2 == 0 and x.stride(-1) == 1
            and all(stride % 2 == 0 for stride in x.stride()[:-1]) and x.storage_offset() % 2 == 0)


def block_heads(blocks: torch.Tensor, block_size: int, num_kv_heads: int) -> torch.Tensor:
    """``read_blocks``' ``[num_layers, num_blocks, bytes_per_block]`` viewed per KV head:
    ``[num_layers, num_blocks, block_size, num_kv_heads, bytes_per_head]`` (a block stores its
    slots one after another, each slot its heads one after another)."""
    return blocks.view(blocks.shape[0], blocks.shape[1], block_size, num_kv_heads, -1)


def select_heads(blocks: torch.Tensor, block_size: int, num_kv_heads: int, start: int,
                 size: int) -> torch.Tensor:
    """KV heads ``start .. start + size - 1`` of blocks holding ``num_kv_heads`` heads, in the
    same byte layout (the pool of a rank that holds those heads)."""
    heads = block_heads(blocks, block_size, num_kv_heads)[:, :, :, start:start + size]
    return heads.contiguous().view(blocks.shape[0], blocks.shape[1], -1)


def _zeroed_pools(count: int, shape: tuple[int, int, int], dtype: torch.dtype,
                  device: torch.device) -> list[torch.Tensor]:
    """``count`` zeroed layer pools, views of one allocation, on transparent huge pages where the OS
    gives them (huge_pages.py: a decode reads its rows block by block from anywhere in a pool).
    On CPU the allocation is an anonymous mapping of its own (the tensor keeps it alive), so the
    advice reaches its pages before the zeroing first touches them: through torch's allocator a
    pool could come from heap memory that earlier frees had already faulted in with 4-KiB pages
    (the engine's 18 per-layer pools of Gemma 3 270M got none)."""
    num_bytes = count * shape[0] * shape[1] * shape[2] * dtype.itemsize
    if device.type != "cpu" or num_bytes == 0:
        return list(torch.zeros((count, *shape), dtype=dtype, device=device).unbind(0))
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)   # shared: shmem, no THP
    pools = torch.frombuffer(mapping, dtype=torch.uint8).view(dtype).view(count, *shape)
    advise_huge_pages(pools)
    return list(pools.zero_().unbind(0))   # zeroed: every page faulted in now, not in a request
