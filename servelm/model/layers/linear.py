"""Linear layers behind one LinearMethod seam, column/row-parallel over a ParallelContext.

Invariants:
- Every linear layer owns its parameters through a LinearMethod: ``create_weights`` registers them
  on the layer, ``apply`` computes the output. Quantization (a method with packed weights and
  scales) plugs in here, not in the architectures. LoRA: ``set_lora`` gives a layer per-adapter-slot
  low-rank deltas (one per shard of a fused layer); ``forward(x, lora)`` adds each ``LoRAGroup``'s
  delta to its rows only, whatever the LinearMethod (base rows untouched). With tp_size > 1 each
  rank keeps B's rows it outputs (column-parallel) or A's columns it takes in (row-parallel, whose
  partial deltas the all-reduce sums with the partial outputs).
- Weights keep the torch/HF layout ``[output_size, input_size]``. A column-parallel layer owns a
  contiguous range of output rows (``ParallelContext.split``); a row-parallel layer owns a range of
  input columns, and its partial outputs are summed over the ranks (all-reduce) before its bias is
  added once. QKV and the attention output follow the rank's ``HeadShard`` instead (whole heads,
  KV heads replicated when there are fewer than ranks). With ``tp_size == 1`` every range is the
  whole tensor and there is no collective: the layers run exactly as in a single process.
- Fused layers (QKV, gate_up) load HF shards by ``shard_id`` into their row range of the fused weight.
- Dense float32 GEMMs on CPU (these layers and the float LM head) go through ``dense_linear``
  (oneDNN); everything else through ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from servelm.distributed.parallel import HeadShard, ParallelContext, Shard

if TYPE_CHECKING:
    from servelm.model.layers.f32_rows import DenseRoutes


def _has_onednn_linear() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


_ONEDNN_LINEAR = _has_onednn_linear()


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 routes: DenseRoutes | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``; float32 on CPU goes through oneDNN instead of ``F.linear``, or through
    the few-rows kernel where ``routes`` (the weight's measured routes, layers/f32_rows.py) say it
    wins at this many rows.

    ``F.linear`` on CPU calls MKL's sgemm, which takes a slow code path on AMD CPUs (the dev box
    is an AMD EPYC with AVX-512). oneDNN's linear on the same plain weights, Gemma 3 270M shapes,
    one thread (ms): 640x262144 LM head M=1 53.5 -> 32.0, M=32 212 -> 112; 640x4096 M=32 2.46 ->
    1.10; 2048x640 M=32 0.95 -> 0.49; M=1 layer shapes equal. Results differ from sgemm only in
    summation order (max abs difference 6e-6 on the head).
    """
    if (_ONEDNN_LINEAR and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.dim() == 2 and x.shape[0] > 0
            and x.is_contiguous() and weight.is_contiguous()):
        if torch.compiler.is_compiling():  # inductor lowers the mkldnn op only for frozen weights
            return _onednn_linear(x, weight, bias)
        if routes is not None and routes.takes_kernel(x.shape[0]):
            return routes.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


@torch.library.custom_op("servelm::onednn_linear", mutates_args=())
def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The oneDNN linear as an opaque op for torch.compile (--enable-torch-compile)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_onednn_linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


class LinearMethod(Protocol):
    """How a linear layer stores its weights and computes ``x @ W.T + b``."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype | None) -> None: ...

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              rows: Any = None) -> torch.Tensor:
        """``rows``: the pass's row facts (a ``gguf_routes.PassRows`` from the forward batch, or None);
        only methods with per-pass routes read it."""
        ...


class UnquantizedLinearMethod:
    """Plain dense weights in the model dtype."""

    def create_weights(self, layer: nn.Module, input_size: int, output_size: int,
                       dtype: torch.dtype | None) -> None:
        weight = nn.Parameter(torch.empty(output_size, input_size, dtype=dtype), requires_grad=False)
        layer.register_parameter("weight", weight)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              rows: Any = None) -> torch.Tensor:
        return dense_linear(x, layer.weight, bias, layer.dense_routes)


_MAX_LORA_STACKS = 4
"""Stacked-weight combinations a layer keeps (the running adapters change rarely)."""


@dataclass(frozen=True)
class LoRAGroup:
    """The token rows of one forward batch that use one adapter slot (base rows are in no group)."""

    slot: int
    rows: torch.Tensor  # [n] int64 row indices into the layer input
    span: tuple[int, int] | None = None
    """``(start, end)`` when ``rows`` is the contiguous range start..end-1 (the scheduler orders
    a step's sequences by adapter, so usually): the delta then reads and adds to views, no copies."""


@dataclass(frozen=True)
class _LoRAPiece:
    offset: int  # first output column of this layer the delta lands in (a fused layer's shard)
    size: int
    a: torch.Tensor  # [rank, input_size]
    b: torch.Tensor  # [size, rank]
    scale: float


class LinearBase(nn.Module):
    """A linear layer of this rank's partition: ``input_size -> output_size`` (per partition)."""

    def __init__(self, input_size: int, output_size: int, bias: bool,
                 linear_method: LinearMethod | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.linear_method: LinearMethod = linear_method or UnquantizedLinearMethod()
        self.linear_method.create_weights(self, input_size, output_size, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size, dtype=dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)
        self.dense_routes: DenseRoutes | None = None
        """A float32 weight's measured routes (layers/f32_rows.py ``apply_dense_routes``), else None: oneDNN."""
        self.lora: dict[int, list[_LoRAPiece]] = {}
        """Adapter slot -> low-rank deltas on this layer (several for a fused layer's shards)."""
        self.lora_fused: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Adapter slot -> (``A_cat.T`` [input_size, total rank], ``B.T`` [total rank, output_size]):
        the slot's pieces as one pair, B block-diagonal over the shards with the scales folded in,
        so a group's delta is two GEMMs whatever the number of shards."""
        self.lora_stacks: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
        """Slots of a step -> their fused pairs stacked (ranks zero-padded to the largest) for the
        batched path; rebuilt when an adapter is set or removed."""

    def forward(self, x: torch.Tensor, lora: Sequence[LoRAGroup] | None = None, rows: Any = None) -> torch.Tensor:
        """``rows``: the forward batch's ``rows`` (which rows are generation rows), for the method's routes."""
        return self.add_lora(x, self.linear_method.apply(self, x, self.bias, rows), lora)

    def set_lora(self, slot: int, a: torch.Tensor, b: torch.Tensor, scale: float,
                 shard_id: int | str | None = None) -> None:
        """Add adapter ``slot``'s delta ``(x @ a.T) @ b.T * scale`` (to one shard of a fused layer).
        ``a`` and ``b`` are the whole (unpartitioned) matrices; each rank keeps its part."""
        for a_local, b_local, offset in self.lora_partition(a, b, shard_id):
            size = b_local.shape[0]
            if a_local.shape[1] != self.input_size or a_local.shape[0] != b_local.shape[1]:
                raise ValueError(f"LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a "
                                 f"{self.input_size} -> {size} projection")
            self.lora.setdefault(slot, []).append(
                _LoRAPiece(offset, size, a_local.contiguous(), b_local.contiguous(), scale))
        self.lora_fused[slot] = self._fuse(self.lora[slot])
        self.lora_stacks.clear()

    def lora_partition(self, a: torch.Tensor, b: torch.Tensor, shard_id: int | str | None
                       ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """This rank's (A, B, output offset) pieces of a whole adapter matrix pair: the rows of B
        this rank outputs (column-parallel) or the columns of A it takes in (row-parallel)."""
        offset, size = (0, self.output_size) if shard_id is None else self.shard_range(shard_id)
        if b.shape[0] != size:
            raise ValueError(f"LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a projection "
                             f"with {size} outputs")
        return [(a, b, offset)]

    def _fuse(self, pieces: list[_LoRAPiece]) -> tuple[torch.Tensor, torch.Tensor]:
        a_t = torch.cat([piece.a for piece in pieces]).T.contiguous()  # [input_size, total rank]
        b_t = a_t.new_zeros(a_t.shape[1], self.output_size)  # [total rank, output_size]
        rank_start = 0
        for piece in pieces:
            rank = piece.a.shape[0]
            b_t[rank_start:rank_start + rank, piece.offset:piece.offset + piece.size] = \
                piece.b.T * piece.scale
            rank_start += rank
        return a_t, b_t

    def shard_range(self, shard_id: int | str) -> tuple[int, int]:
        raise ValueError(f"{type(self).__name__} is not fused; it has no shard {shard_id!r}")

    def remove_lora(self, slot: int) -> None:
        self.lora.pop(slot, None)
        self.lora_fused.pop(slot, None)
        self.lora_stacks.clear()

    def add_lora(self, x: torch.Tensor, out: torch.Tensor, lora: Sequence[LoRAGroup] | None) -> torch.Tensor:
        """``out`` plus each adapter group's delta on its own rows; rows in no group are untouched."""
        if not lora or not self.lora_fused:
            return out
        if self._add_lora_batched(x, out, lora):
            return out
        for group in lora:
            fused = self.lora_fused.get(group.slot)
            if fused is None:
                continue
            a_t, b_t = fused
            if group.span is not None:  # contiguous rows: views, an in-place addmm
                start, end = group.span
                low_rank = x[start:end].to(a_t.dtype) @ a_t  # [n, total rank]
                if out.dtype == b_t.dtype:
                    out[start:end].addmm_(low_rank, b_t)
                else:
                    out[start:end] += (low_rank @ b_t).to(out.dtype)
                continue
            low_rank = x.index_select(0, group.rows).to(a_t.dtype) @ a_t
            out.index_add_(0, group.rows, (low_rank @ b_t).to(out.dtype))
        return out

    def _add_lora_batched(self, x: torch.Tensor, out: torch.Tensor, lora: Sequence[LoRAGroup]) -> bool:
        """Several adapter groups of equal size, back to back (a decode step whose streams are
        spread evenly over the adapters, sorted by slot): one bmm pair for all of them instead of
        a GEMM pair per group. False (nothing done) when the groups do not have that shape."""
        if len(lora) < 2 or lora[0].span is None:
            return False
        start, end = lora[0].span
        size = end - start
        for previous, group in zip(lora, lora[1:]):
            if group.span is None or group.span[0] != previous.span[1] or \
                    group.span[1] - group.span[0] != size:  # type: ignore[index]
                return False
        slots = tuple(group.slot for group in lora)
        if not any(slot in self.lora_fused for slot in slots):
            return True  # none of these adapters changes this layer
        stack = self.lora_stacks.get(slots)
        if stack is None:
            stack = self._stack(slots)
            if len(self.lora_stacks) >= _MAX_LORA_STACKS:
                self.lora_stacks.clear()
            self.lora_stacks[slots] = stack
        a_stack, b_stack = stack  # [G, input_size, rank], [G, rank, output_size]
        end = start + size * len(lora)
        rows = x[start:end].reshape(len(lora), size, -1).to(a_stack.dtype)
        delta = torch.bmm(torch.bmm(rows, a_stack), b_stack)  # [G, size, output_size]
        out[start:end] += delta.reshape(end - start, -1).to(out.dtype)
        return True

    def _stack(self, slots: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.lora_fused.get(slot) for slot in slots]
        present = [pair for pair in pairs if pair is not None]
        rank = max(a_t.shape[1] for a_t, _ in present)
        a_stack = present[0][0].new_zeros(len(slots), self.input_size, rank)
        b_stack = present[0][0].new_zeros(len(slots), rank, self.output_size)
        for index, pair in enumerate(pairs):  # a slot without a delta here stays zero
            if pair is not None:
                a_stack[index, :, :pair[0].shape[1]] = pair[0]
                b_stack[index, :pair[1].shape[0]] = pair[1]
        return a_stack, b_stack

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


def _copy_checked(param: torch.Tensor, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"weight shape {tuple(loaded.shape)} != param {tuple(param.shape)}"
    param.data.copy_(loaded)


class ColumnParallelLinear(LinearBase):
    """Output dimension split across ranks; its output stays partitioned (no all-gather)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 linear_method: LinearMethod | None = None, dtype: torch.dtype | None = None, *,
                 parallel: ParallelContext | None = None) -> None:
        self.parallel = parallel or ParallelContext.single()
        self.output_shard = self.parallel.split(output_size)
        self.full_output_size = output_size
        super().__init__(input_size, self.output_shard.size, bias, linear_method, dtype)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        _copy_checked(param, loaded.narrow(0, self.output_shard.start, self.output_shard.size))

    def lora_partition(self, a: torch.Tensor, b: torch.Tensor, shard_id: int | str | None
                       ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        if shard_id is not None:
            self.shard_range(shard_id)  # raises: an unfused layer has no shards
        if b.shape[0] != self.full_output_size:
            raise ValueError(f"LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a "
                             f"projection with {self.full_output_size} outputs")
        return [(a, b.narrow(0, self.output_shard.start, self.output_shard.size), 0)]


class RowParallelLinear(LinearBase):
    """Input dimension split across ranks; the partial outputs are all-reduced, then the bias added."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 linear_method: LinearMethod | None = None, dtype: torch.dtype | None = None, *,
                 parallel: ParallelContext | None = None, input_shard: Shard | None = None) -> None:
        self.parallel = parallel or ParallelContext.single()
        self.input_shard = input_shard or self.parallel.split(input_size)
        super().__init__(self.input_shard.size, output_size, bias, linear_method, dtype)

    def forward(self, x: torch.Tensor, lora: Sequence[LoRAGroup] | None = None, rows: Any = None) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return self.add_lora(x, self.linear_method.apply(self, x, self.bias, rows), lora)
        # Each rank adds (x_rank @ A_rank.T) @ B.T: the all-reduce sums them to the whole delta.
        partial = self.add_lora(x, self.linear_method.apply(self, x, None, rows), lora)
        partial = self.parallel.all_reduce(partial)
        return partial if self.bias is None else partial + self.bias

    def lora_partition(self, a: torch.Tensor, b: torch.Tensor, shard_id: int | str | None
                       ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        if shard_id is not None:
            self.shard_range(shard_id)  # raises: an unfused layer has no shards
        if b.shape[0] != self.output_size:
            raise ValueError(f"LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a projection with "
                             f"{self.output_size} outputs")
        return [(a.narrow(1, self.input_shard.start, self.input_shard.size), b, 0)]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if param.dim() == 1:  # bias is added once, after the reduce
            _copy_checked(param, loaded)
            return
        _copy_checked(param, loaded.narrow(1, self.input_shard.start, self.input_shard.size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input fused into one (e.g. gate_up).

    Each projection is split across ranks on its own (``shards``: this rank's rows of each), and a
    rank's fused weight holds its rows of every projection, in order.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False,
                 linear_method: LinearMethod | None = None, dtype: torch.dtype | None = None, *,
                 parallel: ParallelContext | None = None, shards: list[Shard] | None = None) -> None:
        self.parallel = parallel or ParallelContext.single()
        self.shards = shards or [self.parallel.split(size) for size in output_sizes]
        self.full_output_sizes = list(output_sizes)
        """Each projection's whole output size (``output_sizes`` are this rank's)."""
        self.output_sizes = [shard.size for shard in self.shards]
        self.output_shard = Shard(0, sum(self.output_sizes))
        LinearBase.__init__(self, input_size, sum(self.output_sizes), bias, linear_method, dtype)

    def shard_range(self, shard_id: int | str) -> tuple[int, int]:
        """(row offset, rows) of one shard inside this rank's fused weight."""
        index = int(shard_id)
        return sum(self.output_sizes[:index]), self.output_sizes[index]

    def _shard_index(self, shard_id: int | str) -> int:
        return int(shard_id)

    def lora_partition(self, a: torch.Tensor, b: torch.Tensor, shard_id: int | str | None
                       ) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """One piece per projection: B's rows of one shard, or of each shard for a delta on the
        whole fused layer (B stacked over the projections' whole outputs, as the HF fused weight)."""
        if shard_id is None:
            if b.shape[0] != sum(self.full_output_sizes):
                raise ValueError(f"LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a projection with "
                                 f"{sum(self.full_output_sizes)} outputs")
            return [piece for index, b_part in enumerate(b.split(self.full_output_sizes))
                    for piece in self.lora_partition(a, b_part, index)]
        index = self._shard_index(shard_id)
        if b.shape[0] != self.full_output_sizes[index]:
            raise ValueError(f"LoRA A {tuple(a.shape)} / B {tuple(b.shape)} do not fit a projection with "
                             f"{self.full_output_sizes[index]} outputs")
        source = self.shards[index]
        return [(a, b.narrow(0, source.start, source.size), self.shard_range(shard_id)[0])]

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,  # type: ignore[override]
                      shard_id: int | str | None = None) -> None:
        assert shard_id is not None, "fused layers load one shard at a time"
        offset, rows = self.shard_range(shard_id)
        source = self.shards[self._shard_index(shard_id)]
        _copy_checked(param.data.narrow(0, offset, rows), loaded.narrow(0, source.start, source.size))


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections fused; HF shards ``q_proj``/``k_proj``/``v_proj`` load as "q"/"k"/"v".

    A rank holds the heads of its ``HeadShard``: ``num_heads`` and ``num_kv_heads`` are this rank's.
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, linear_method: LinearMethod | None = None,
                 dtype: torch.dtype | None = None, *, parallel: ParallelContext | None = None) -> None:
        parallel = parallel or ParallelContext.single()
        self.head_dim = head_dim
        self.head_shard: HeadShard = parallel.head_shard(num_heads, num_kv_heads)
        self.num_heads = self.head_shard.q.size
        self.num_kv_heads = self.head_shard.kv.size
        kv_rows = Shard(self.head_shard.kv.start * head_dim, self.num_kv_heads * head_dim)
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim,
                                       num_kv_heads * head_dim], bias, linear_method, dtype,
                         parallel=parallel, shards=[self.q_columns, kv_rows, kv_rows])

    @property
    def q_columns(self) -> Shard:
        """This rank's columns of the attention output (the input of the output projection)."""
        return Shard(self.head_shard.q.start * self.head_dim, self.head_shard.q.size * self.head_dim)

    def _shard_index(self, shard_id: int | str) -> int:
        return {"q": 0, "k": 1, "v": 2}[shard_id] if isinstance(shard_id, str) else shard_id

    def shard_range(self, shard_id: int | str) -> tuple[int, int]:
        return super().shard_range(self._shard_index(shard_id))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[num_tokens, q+k+v] -> q [T, H, D], k [T, Hkv, D], v [T, Hkv, D] (this rank's heads)."""
        q, k, v = qkv.split(self.output_sizes, dim=-1)
        return (q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim),
                v.view(-1, self.num_kv_heads, self.head_dim))
