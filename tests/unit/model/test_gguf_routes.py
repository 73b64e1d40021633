"""GGUF routes as data (gguf/gguf_routes.py, model/routes.py): every candidate route agrees with the
others, the quality rules hold whatever the ranking, the route table is measured once per key.

This CPU may have none of the C++ kernels, so the kernels here are torch implementations with the
compiled modules' Python API (``block_linear_a16``, ``rows_gemm``, ``i8_gemm``): the routing code takes
them exactly as it takes a build of gguf_kernel.cpp for any instruction set.
"""

from __future__ import annotations


import pytest
import torch
from torch import nn

from servelm.model import routes as route_table
from servelm.model.forward_batch import BatchPlan, ForwardBatch, SequencePlan
from servelm.model.gguf import gguf_i8gemm, gguf_rows
from servelm.model.gguf.gguf_blocks import BlockWeight, concat_rows
from servelm.model.gguf.gguf_linear import GGUFBlockLinearMethod
from servelm.model.gguf.gguf_routes import (GENERATION_ONLY, ROW_CLASSES, LayerRoutes, LinearShape, PassRows,
                                            Route, complete)


def _unpack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
            n: int) -> BlockWeight:
    """A tiled copy (gguf_blocks.tile_outputs) back to a BlockWeight of its first ``n`` outputs."""
    tiles, groups, cols, lanes, group = codes.shape
    flat = codes.permute(0, 2, 3, 1, 4).reshape(tiles * cols * lanes, groups * group)[:n]

    def rows(values: torch.Tensor) -> torch.Tensor:
        return values.permute(0, 2, 3, 1).reshape(tiles * cols * lanes, -1)[:n]

    block = flat.shape[1] // scales.shape[1]
    return BlockWeight(flat, rows(scales), None if offsets is None else rows(offsets), block, "Q")


def _finish(out: torch.Tensor, bf16_out: bool, bias: torch.Tensor | None = None) -> torch.Tensor:
    if bias is not None:
        out = out + bias
    return out.bfloat16() if bf16_out else out


class TorchBlockKernel:
    """gguf_kernel.cpp's API in torch (unrounded activations: the ``float`` mode's arithmetic)."""

    def block_linear_a16(self, x, codes, scales, offsets, block, bf16_out=False, bias=None):
        weight = BlockWeight(codes, scales, offsets, block, "Q").dequantize()
        return _finish(x.float() @ weight.T, bf16_out, bias)

    block_linear = block_linear_float = block_linear_a16
    packed_float = block_linear_a16   # the tiles route's name (this fake never packs: it reads the codes)


class TorchRowsKernel:
    GEMM_COLS = 2

    def rows_gemm(self, x, codes, scales, offsets, block, bf16_out=False, n=-1, bias=None):
        assert x.dtype == torch.bfloat16
        codes = gguf_rows.unpack_codes(codes)   # any of gguf_rows.pack's forms
        n = n if n >= 0 else codes.shape[0] * codes.shape[2] * codes.shape[3]
        offsets = offsets.float() if offsets is not None else None   # fp16 copies widen exactly
        return _finish(x.float() @ _unpack(codes, scales.float(), offsets, n).dequantize().T, bf16_out, bias)

    def rows_call(self, x, codes, scales, offsets, block, bf16_out=False, bias=None):
        return self.rows_gemm(x, codes, scales, offsets, block, bf16_out, -1, bias)

    def amx_gemm(self, x, codes, scales, offsets, block, bf16_out=False, n=-1, bias=None):
        """The dense bf16 copy's product (gguf_rows.cpp ``amx_gemm``)."""
        codes = gguf_rows.unpack_codes(codes)
        n = n if n >= 0 else codes.shape[0] * codes.shape[2] * codes.shape[3]
        offsets = offsets.float() if offsets is not None else None
        weight = _unpack(codes, scales.float(), offsets, n).dequantize().bfloat16().float()
        return _finish(x.float() @ weight.T, bf16_out, bias)

    def amx_permitted(self):
        return True


class TorchI8Kernel:
    def __init__(self) -> None:
        self.calls = 0

    def i8_gemm(self, x, codes, scales, offsets, block, bf16_out, n, out=None, bias=None):
        self.calls += 1
        weight = _unpack(codes.bitwise_xor(0x80).view(torch.int8), scales, offsets, n)
        result = _finish(gguf_i8gemm.reference(x.float(), weight), bf16_out, bias)
        return result if out is None else out[:, :n].copy_(result)


def block_weight(n: int, k: int, offsets: bool, seed: int = 0, packable: bool = False) -> BlockWeight:
    """Random codes over int8's range ("Q4_1" with offsets, else "Q8_0"), or with ``packable`` in the
    packed route's ranges (Q4_1's [0, 15] with offsets, else Q5_0's [-16, 15])."""
    generator = torch.Generator().manual_seed(seed)
    low, high = ((0, 15) if offsets else (-16, 15)) if packable else (-127, 127)
    codes = torch.randint(low, high + 1, (n, k), dtype=torch.int8, generator=generator)
    scales = torch.rand(n, k // 32, generator=generator) * 0.02 + 1e-3
    kind = ("Q4_1" if offsets else "Q5_0") if packable else ("Q4_1" if offsets else "Q8_0")
    return BlockWeight(codes, scales, -scales * 3 if offsets else None, 32, kind)


def torch_method(ranking=None, dense_dtype=torch.bfloat16, i8=None) -> GGUFBlockLinearMethod:
    return GGUFBlockLinearMethod(TorchBlockKernel(), dense_dtype, "int16", TorchRowsKernel(),
                                 i8 or TorchI8Kernel(), ranking)


TOLERANCE = {Route.BLOCK: 1e-5, Route.TILES: 1e-5, Route.ROWS: 1e-2, Route.PACKED: 1e-2, Route.DENSE: 1e-2, Route.INT8: 3e-2,
             Route.AMX: 1e-2}
"""Relative error of each route against float32 on bf16-representable rows: the bf16 dense copy and
the bf16 output round, the int8 route rounds activations to int8 per block."""


@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 70])
def test_every_route_forced_agrees_with_the_float_result(offsets: bool, rows: int) -> None:
    weight = block_weight(80, 128, offsets, packable=True)   # 80 outputs: a padded tile for the packed copies
    method = torch_method()
    shape = method.shape(weight)
    assert method.available(shape, weight.block) == set(Route)
    layer = nn.Module()
    method.prepare_all(layer, weight, shape)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)).bfloat16()
    reference = x.float() @ weight.dequantize().T
    for route in Route:
        out = method.run_route(route, layer, x, None, True)
        assert out.dtype == torch.float32 and out.shape == (rows, 80)
        error = ((out - reference).norm() / reference.norm()).item()
        assert error < TOLERANCE[route], (route, error)


def ranking_of(*order: Route):
    return lambda shape, x_bf16, rows: complete(list(order))


def test_generation_rows_never_take_int8_even_when_it_is_fastest() -> None:
    i8 = TorchI8Kernel()
    method = torch_method(ranking_of(Route.INT8, Route.DENSE), i8=i8)
    layer, kv, head = nn.Module(), nn.Module(), nn.Module()
    weight = block_weight(64, 128, False)
    method.process(layer, weight)
    method.process(kv, weight, int8_rows=False)
    method.process(head, weight, float_output=True)
    for rows in (1, 4, 64, 600):
        assert layer.gguf_routes.pick(rows, True, True) is Route.INT8
        for is_prompt in (False, True):
            assert kv.gguf_routes.pick(rows, True, is_prompt) is Route.DENSE
            assert head.gguf_routes.pick(rows, True, is_prompt) is Route.DENSE
        assert layer.gguf_routes.pick(rows, True, False) is Route.DENSE
    assert head.gguf_i8 is None and kv.gguf_i8 is None and layer.gguf_i8 is not None
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(1)).bfloat16()
    dense = method.run_route(Route.DENSE, layer, x, None, False)
    assert torch.equal(method.apply(layer, x, None, PassRows.of([1] * 40, [True] * 40)), dense)
    assert i8.calls == 0
    # a mixed pass: prompt rows on int8, the generation rows as a pass of only them gives them
    counts, generation = [1, 30, 1, 8], [True, False, True, False]
    out = method.apply(layer, x, None, PassRows.of(counts, generation))
    assert i8.calls == 1
    gen_rows = [0, 31]
    alone = method.apply(layer, x[gen_rows], None, GENERATION_ONLY)
    assert torch.equal(out[gen_rows], alone)
    by_i8 = method.run_route(Route.INT8, layer, x, None, False)
    prompt = [row for row in range(40) if row not in gen_rows]
    assert torch.equal(out[prompt], by_i8[prompt]) and not torch.equal(out[gen_rows], by_i8[gen_rows])


def test_a_qkv_projections_queries_alone_take_int8() -> None:
    """``I8_GEMM_LEAD``: a merged QKV layer's prompt rows take the int8 GEMM for its queries where their
    own shape's routes say so; its keys and values (cached) keep the dense copy, its generation rows
    never take int8, a mixed pass's generation rows come out as a pass of their own."""
    i8 = TorchI8Kernel()
    method = torch_method(ranking_of(Route.INT8, Route.DENSE), i8=i8)
    queries, keys_values = block_weight(64, 128, False, seed=1), block_weight(32, 128, False, seed=2)
    layer = nn.Module()
    method.process(layer, concat_rows([queries, keys_values]), int8_rows=False, int8_lead=queries)
    lead, lead_routes, rests = layer.gguf_lead
    assert lead == 64 and lead_routes.shape == method.shape(queries) and layer.gguf_i8 is not None
    assert rests == {Route.DENSE}   # the only route of the rest this ranking holds
    assert layer.gguf_routes.pick(40, True, True) is Route.DENSE   # the layer itself: never int8
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    bias = torch.randn(96, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = method.apply(layer, x, bias, PassRows.of([40], [False]))
    assert i8.calls == 1 and out.dtype == torch.bfloat16 and out.shape == (40, 96)
    by_i8 = method.run_route(Route.INT8, layer, x, None, True)   # float32: the bias goes in before the rounding
    dense = method.run_route(Route.DENSE, layer, x, bias, False)
    assert torch.equal(out[:, :64], (by_i8[:, :64] + bias[:64]).bfloat16())
    torch.testing.assert_close(out[:, 64:], dense[:, 64:], rtol=0, atol=0)
    assert not torch.equal(out[:, :64], dense[:, :64])
    # decode rows only: the dense copy, no int8
    calls = i8.calls
    assert torch.equal(method.apply(layer, x, bias, PassRows.of([1] * 40, [True] * 40)), dense)
    assert i8.calls == calls
    # a mixed pass: prompt rows as above, the generation rows as a pass of only them gives them
    counts, generation = [1, 30, 1, 8], [True, False, True, False]
    mixed = method.apply(layer, x, bias, PassRows.of(counts, generation))
    gen_rows = [0, 31]
    prompt = [row for row in range(40) if row not in gen_rows]
    assert torch.equal(mixed[gen_rows], method.apply(layer, x[gen_rows], bias, GENERATION_ONLY))
    assert torch.equal(mixed[prompt], out[prompt])
    # where the queries' routes never take int8 the layer keeps no int8 copy
    plain = nn.Module()
    torch_method(ranking_of(Route.DENSE, Route.INT8)).process(plain, concat_rows([queries, keys_values]),
                                                              int8_rows=False, int8_lead=queries)
    assert plain.gguf_lead is None and plain.gguf_i8 is None


def test_float32_rows_keep_an_exact_route_where_the_block_kernel_is_held() -> None:
    method = torch_method(ranking_of(Route.ROWS, Route.DENSE))
    layer = nn.Module()
    method.process(layer, block_weight(64, 128, False), model_dtype=torch.float32)
    assert layer.gguf_routes.pick(1, False, False) is Route.BLOCK
    assert layer.gguf_routes.pick(16, False, False) is Route.BLOCK
    assert layer.gguf_routes.pick(17, False, False) is Route.ROWS   # above it, bf16 rounding as before


def test_the_copies_kept_are_those_the_routes_use() -> None:
    method = torch_method(ranking_of(Route.ROWS))
    layer = nn.Module()
    method.process(layer, block_weight(64, 128, False))
    assert layer.gguf_dense is None and layer.gguf_i8 is None and layer.gguf_packed is not None
    # the prepared decode call reaches as far as its route does
    call = layer.gguf_decode_args
    assert call[0] == method.rows_kernel.rows_call and call.generation_rows == call.prompt_rows == 512
    assert call.takes_bias


def test_the_forward_batch_carries_the_generation_rows() -> None:
    plan = BatchPlan([SequencePlan([1], 5, [0], 1), SequencePlan([2, 3, 4], 0, [1], 1),
                      SequencePlan([5, 6], 3, [2], 2)])
    batch = ForwardBatch.build(plan, 16, torch.device("cpu"))
    assert batch.rows is not None and batch.head_rows is not None
    assert not batch.rows.generation_only and batch.rows.num_rows == 6
    assert batch.rows.generation_rows.tolist() == [0, 4, 5]
    assert batch.head_rows.num_rows == 4 and batch.head_rows.generation_rows.tolist() == [0, 2, 3]
    decode = ForwardBatch.build(BatchPlan([SequencePlan([1], 5, [0], 1)] * 3), 16, torch.device("cpu"))
    assert decode.rows.generation_only and decode.rows.generation_rows is None


def test_the_route_table_is_measured_once_per_key(tmp_path, monkeypatch) -> None:
    method = torch_method(dense_dtype=torch.float32)   # block and dense (no rows kernel beside float32)
    shape = LinearShape(128, 64, "Q8_0", False, True)
    specs = [route_table.ShapeSpec(shape, 32, False)]
    monkeypatch.setattr(route_table, "time_candidates",
                        lambda candidates, **_: {name: (1.0 if name == "block" else 2.0) for name in candidates})
    table, source = route_table.build_table(method, specs, torch.float32, None, tmp_path)
    assert len(table.cells) == len(ROW_CLASSES) and "measured" in source and table.path(tmp_path).exists()
    assert table.cells[table.cell_name(shape, False, 64)][0] == "block"
    ranking = table.ranking(method.default_ranking)
    assert ranking(shape, False, 40)[0] is Route.BLOCK   # 40 rows: the 48-row class

    def fail(*args, **kwargs):
        raise AssertionError("a cached key was measured again")

    monkeypatch.setattr(route_table, "time_candidates", fail)
    again, source = route_table.build_table(method, specs, torch.float32, None, tmp_path)
    assert again.cells == table.cells and "0 measured" in source
    monkeypatch.setattr(route_table, "time_candidates",
                        lambda candidates, **_: {name: (1.0 if name == "dense" else 2.0) for name in candidates})
    monkeypatch.setattr(route_table, "cpu_model_name", lambda: "another CPU")
    other, _ = route_table.build_table(method, specs, torch.float32, None, tmp_path)
    assert other.path(tmp_path) != table.path(tmp_path)
    assert other.cells[other.cell_name(shape, False, 64)][0] == "dense"


class PrefetchRowsKernel(TorchRowsKernel):
    """The rows kernel's stand-in with its prefetch setting (gguf_rows.cpp ``set_nta_prefetch``), recording the
    setting each call ran under."""

    def __init__(self) -> None:
        self.nta, self.calls = True, []

    def set_nta_prefetch(self, on):
        self.nta = on

    def rows_gemm(self, *args, **kwargs):
        self.calls.append(self.nta)
        return super().rows_gemm(*args, **kwargs)


def prefetch_method() -> tuple[PrefetchRowsKernel, GGUFBlockLinearMethod, list]:
    """A method on ``PrefetchRowsKernel`` and one Q4_K layer's spec (it has the bit-width copy)."""
    kernel = PrefetchRowsKernel()
    method = GGUFBlockLinearMethod(TorchBlockKernel(), torch.bfloat16, "int16", kernel, TorchI8Kernel())
    return kernel, method, [route_table.ShapeSpec(LinearShape(128, 64, "Q4_K", False, True), 32, True, (0, 15))]


@pytest.mark.parametrize("faster", ["nta", "t0"])
def test_the_rows_kernels_prefetch_is_measured_first_and_the_faster_set(tmp_path, monkeypatch, faster: str) -> None:
    """``PREFETCH_CELL``: one row on the rows kernel timed with non-temporal and with T0 prefetches before any
    route cell (the cells' times depend on it), the faster set on the kernel, kept with the table (a cached
    table sets it again without timing); a table without the cell keeps the earlier constant (non-temporal)."""
    kernel, method, specs = prefetch_method()
    timed: list[set[str]] = []

    def fake(candidates, **_):
        timed.append(set(candidates))
        for run in candidates.values():
            run()
        return {name: (1.0 if name in (faster, "amx") else 2.0) for name in candidates}

    monkeypatch.setattr(route_table, "time_candidates", fake)
    monkeypatch.setattr(route_table.ThreadGovernor, "supported", staticmethod(lambda: False))   # no busy-core rule here
    table, source = route_table.build_table(method, specs, torch.bfloat16, None, tmp_path)
    assert timed[0] == {"nta", "t0"} and True in kernel.calls and False in kernel.calls
    assert table.nta_prefetch() is (faster == "nta") and kernel.nta is (faster == "nta")
    assert ("non-temporal" if faster == "nta" else "T0") in source
    kernel.set_nta_prefetch(faster != "nta")
    monkeypatch.setattr(route_table, "time_candidates", lambda *a, **k: pytest.fail("a cached key was timed again"))
    route_table.build_table(method, specs, torch.bfloat16, None, tmp_path)
    assert kernel.nta is (faster == "nta")
    assert route_table.RouteTable({}).nta_prefetch()


@pytest.fixture
def busy_cores(monkeypatch):
    """Two threads, and the thread governor reading ``others[0]`` cores taken by other processes (0.4 or more
    costs this process a thread): the list, to change between builds."""
    others = [1.0]
    monkeypatch.setattr(route_table.ThreadGovernor, "supported", staticmethod(lambda: True))
    monkeypatch.setattr(route_table.ThreadGovernor, "others_cores", lambda self, before, now, slack_ticks=0: others[0])
    monkeypatch.setattr(route_table.ThreadGovernor, "target",
                        lambda self, used: self.max_threads - (1 if used >= 0.4 else 0))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield others
    torch.set_num_threads(threads)


def test_the_prefetch_timed_beside_busy_cores_is_not_kept(tmp_path, monkeypatch, busy_cores) -> None:
    """``PREFETCH_CELL`` follows the cells' rule: timed while other processes kept a core busy, it is not kept
    (the earlier constant, non-temporal, serves) and a quiet start measures it."""
    kernel, method, specs = prefetch_method()
    monkeypatch.setattr(route_table, "time_candidates",
                        lambda candidates, **_: {name: (1.0 if name in ("t0", "amx") else 2.0) for name in candidates})
    table, _ = route_table.build_table(method, specs, torch.bfloat16, None, tmp_path)
    assert route_table.PREFETCH_CELL in table.busy and route_table.PREFETCH_CELL not in table.times_us
    assert kernel.nta   # not measured: the earlier constant
    busy_cores[0] = 0.1
    table, _ = route_table.build_table(method, specs, torch.bfloat16, None, tmp_path)
    assert table.times_us[route_table.PREFETCH_CELL] == {"nta": 2.0, "t0": 1.0} and not kernel.nta


def test_writers_saving_one_table_at_once_never_fail(tmp_path) -> None:
    """Two ranks of one machine may save the same table together (a test's ranks are threads of one
    process): each writes a temporary file of its own, so none renames another's away."""
    import threading

    table = route_table.RouteTable({"cpu": "test"}, {"cell": ["block"]}, {"cell": {"block": 1.0}})
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def save() -> None:
        try:
            start.wait()
            for _ in range(50):
                table.save(tmp_path)
        except BaseException as error:  # surfaced below
            errors.append(error)

    threads = [threading.Thread(target=save) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert route_table.RouteTable.load({"cpu": "test"}, tmp_path).cells == table.cells
    assert [p.name for p in tmp_path.iterdir()] == [table.path(tmp_path).name]   # no temporary left


def test_over_the_budget_the_defaults_serve(tmp_path) -> None:
    method = torch_method(dense_dtype=torch.float32)
    shape = LinearShape(128, 64, "Q8_0", False, True)
    table, source = route_table.build_table(method, [route_table.ShapeSpec(shape, 32, False)], torch.float32,
                                            0.0, tmp_path)
    assert "over the" in source and len(table.cells) < len(ROW_CLASSES)
    ranking = table.ranking(method.default_ranking)
    assert ranking(shape, False, 600) == method.default_ranking(shape, False, 600)


def test_cells_timed_beside_busy_cores_are_not_kept(tmp_path, busy_cores) -> None:
    """A cell timed while other processes kept one of the engine's two cores busy (the thread
    governor's reading) is neither kept nor saved: the defaults serve it, the log line says why, and a
    quiet start measures it."""
    method = torch_method(dense_dtype=torch.float32)
    shape = LinearShape(128, 64, "Q8_0", False, True)
    specs = [route_table.ShapeSpec(shape, 32, False)]
    table, source = route_table.build_table(method, specs, torch.float32, None, tmp_path)
    # every row class and the dense copy's calls at a long chunk (``split_cell_name``)
    assert not table.cells and len(table.busy) == len(ROW_CLASSES) + 1 and "cores busy" in source
    assert not table.path(tmp_path).exists()
    assert table.ranking(method.default_ranking)(shape, False, 1) == method.default_ranking(shape, False, 1)
    busy_cores[0] = 0.1   # the front end's small share: quiet enough
    table, source = route_table.build_table(method, specs, torch.float32, None, tmp_path)
    assert len(table.cells) == len(ROW_CLASSES) and not table.busy and "cores busy" not in source
    assert table.path(tmp_path).exists()


def test_a_shape_with_one_route_is_never_timed(tmp_path) -> None:
    method = GGUFBlockLinearMethod(None, torch.float32)   # no kernel at all: the dense copy only
    shape = LinearShape(128, 64, "Q8_0", False, True)
    table, source = route_table.build_table(method, [route_table.ShapeSpec(shape, 32, False)], torch.float32,
                                            None, tmp_path)
    # no route cell; only how the dense copy takes a long prompt chunk (one call or cut) is timed
    assert not table.cells and list(table.times_us) == [table.split_cell_name(shape, False)]
    head = LinearShape(128, 64, "Q8_0", True, False)
    table, source = route_table.build_table(method, [route_table.ShapeSpec(head, 32, False)], torch.float32,
                                            None, tmp_path)
    assert not table.cells and not table.times_us and "nothing to measure" in source


def test_a_route_needing_a_bigger_copy_must_win_by_its_margin(tmp_path, monkeypatch) -> None:
    """``COPY_MARGIN``: the dense copy 3% faster than the block kernel does not rank first (the layer
    would keep 2-4 bytes per weight for it); 20% faster does."""
    method = torch_method(dense_dtype=torch.float32)
    shape = LinearShape(128, 64, "Q8_0", False, False)
    specs = [route_table.ShapeSpec(shape, 32, False)]
    for dense_us, first in ((0.97, "block"), (0.8, "dense")):
        monkeypatch.setattr(route_table, "time_candidates",
                            lambda candidates, **_: {name: (dense_us if name == "dense" else 1.0) for name in candidates})
        table, _ = route_table.build_table(method, specs, torch.float32, None, tmp_path, fresh=True)
        assert table.cells[table.cell_name(shape, False, 8)][0] == first


def test_a_dense_copy_is_kept_only_where_it_wins_by_its_margin_then_serves_every_cell_it_leads() -> None:
    """``COPY_MARGIN``'s dense 20%, from the measured times (``MeasuredRanking``): a float32 copy 10% faster
    than the tiles at 512 generation rows only is not kept (a layer of Qwen2.5-Coder 0.5B on a Zen 3: 4
    bytes a weight for batches of 129-512 decodes); 30% faster at 512 keeps it, and then the 128-row class,
    where it leads by 10%, takes it too (the copy is paid for), while 64 rows, where the tiles lead, keep
    them. No copy is added by the second pass: each cell takes its own first choice or a held route."""
    method = torch_method(dense_dtype=torch.float32)
    shape = LinearShape(128, 64, "Q5_0", False, False)
    for gain_512, held_dense in ((1.1, False), (1.3, True)):
        table = route_table.RouteTable({})
        for rows in ROW_CLASSES:
            gain = {512: gain_512, 128: 1.1, 64: 0.95}.get(rows, 0.5)
            times = {"tiles": 100.0 * rows, "dense": 100.0 * rows / gain, "block": 150.0 * rows}
            name = table.cell_name(shape, False, rows)
            table.times_us[name] = times
            table.cells[name] = sorted(times, key=times.__getitem__)   # stored fastest first
        resolved = LayerRoutes.resolve(shape, frozenset({Route.BLOCK, Route.TILES, Route.DENSE}),
                                       table.ranking(method.default_ranking), False, "int16", False)
        assert (Route.DENSE in resolved.held) is held_dense
        expected = Route.DENSE if held_dense else Route.TILES
        assert resolved.pick(512, False, False) is expected and resolved.pick(200, False, False) is expected
        assert resolved.pick(128, False, False) is expected and resolved.pick(100, False, False) is expected
        assert resolved.pick(64, False, False) is Route.TILES and resolved.pick(16, False, False) is Route.TILES
        # the stored order alone (a cell without times) is taken as it is
        table.times_us.clear()
        plain = LayerRoutes.resolve(shape, frozenset({Route.BLOCK, Route.TILES, Route.DENSE}),
                                    table.ranking(method.default_ranking), False, "int16", False)
        assert plain.pick(512, False, False) is Route.DENSE


@pytest.mark.parametrize("first", [Route.BLOCK, Route.ROWS])
def test_the_prepared_decode_call_is_the_routed_result(first: Route) -> None:
    """A layer's prepared decode call (``gguf_decode_args``, the flat decode paths' call) reaches as
    far as its 1-row route does, and gives what routing the same rows gives."""
    method = torch_method(lambda shape, x_bf16, rows: complete([first] if rows <= 8 else [Route.DENSE]))
    layer = nn.Module()
    weight = block_weight(64, 128, True)
    method.process(layer, weight)
    call = layer.gguf_decode_args
    assert call.generation_rows == call.prompt_rows == 8 and call.takes_bias   # the block and rows kernels take one
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    for rows in (1, 8):
        routed = method.run_route(first, layer, x[:rows], None, False)
        assert torch.equal(method.apply(layer, x[:rows], None, GENERATION_ONLY), routed)
        assert torch.equal(call[0](x[:rows], *call[1:], True), routed)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(3)).bfloat16()
    for rows in (1, 8):   # a biased layer (Qwen2's QKV) takes the prepared call at any row count it reaches
        routed = method.run_route(first, layer, x[:rows], bias, False)
        assert torch.equal(method.apply(layer, x[:rows], bias, GENERATION_ONLY), routed)
        assert torch.equal(call[0](x[:rows], *call[1:], True, bias), routed)
    nine = torch.randn(9, 128).bfloat16()
    assert torch.equal(method.apply(layer, nine, None), method.run_route(Route.DENSE, layer, nine, None, False))


def test_a_float32_models_prepared_call_takes_float32_rows() -> None:
    """A float32 model (a CPU without a native bf16 GEMM): its prepared decode call is its 1-row float32
    route's block kernel, reaching as far as that route, unrounded (``round_out`` False), and ``apply``
    takes it for float32 rows with what routing gives (a bias added in float32)."""
    method = torch_method(lambda shape, x_bf16, rows: complete([Route.BLOCK] if rows <= 8 else [Route.DENSE]),
                          dense_dtype=torch.float32)
    layer = nn.Module()
    method.process(layer, block_weight(64, 128, True), model_dtype=torch.float32)
    call = layer.gguf_decode_args
    assert call.dtype == torch.float32 and not call.rounds and call.takes_bias
    assert call.generation_rows == call.prompt_rows == 8
    x = torch.randn(8, 128, generator=torch.Generator().manual_seed(2))
    for rows in (1, 8):
        routed = method.run_route(Route.BLOCK, layer, x[:rows], None, False)
        assert routed.dtype == torch.float32
        assert torch.equal(method.apply(layer, x[:rows], None, GENERATION_ONLY), routed)
        assert torch.equal(call[0](x[:rows], *call[1:], False), routed)
    bias = torch.randn(64, generator=torch.Generator().manual_seed(3))
    assert torch.equal(method.apply(layer, x[:1], bias), method.run_route(Route.BLOCK, layer, x[:1], bias, False))


def test_a_forced_route_comes_first_where_the_rules_allow_it(tmp_path, monkeypatch) -> None:
    """``routes.forced_route`` (benchmarks/quant_quality.py ``gguf+route=R``): the measured table's
    ranking gives way to the forced route; the rules still keep generation rows off int8."""
    method = torch_method(dense_dtype=torch.float32)
    shape = LinearShape(128, 64, "Q8_0", False, True)
    monkeypatch.setattr(route_table, "time_candidates",
                        lambda candidates, **_: {name: (1.0 if name == "dense" else 2.0) for name in candidates})
    table, _ = route_table.build_table(method, [route_table.ShapeSpec(shape, 32, False)], torch.float32, None,
                                       tmp_path)
    assert table.ranking(method.default_ranking)(shape, False, 64)[0] is Route.DENSE
    with route_table.forced_route(Route.BLOCK):
        assert table.ranking(method.default_ranking)(shape, False, 64)[0] is Route.BLOCK
    with route_table.forced_route(Route.INT8):
        ranking = table.ranking(method.default_ranking)
    assert ranking(shape, False, 64)[0] is Route.INT8
    resolved = LayerRoutes.resolve(shape, frozenset(Route), ranking, False, "int16", False)
    assert resolved.pick(64, False, True) is Route.INT8 and resolved.pick(64, False, False) is not Route.INT8
    assert table.ranking(method.default_ranking)(shape, False, 64)[0] is Route.DENSE   # restored


def test_the_timing_cycles_through_cold_copies_with_the_model_code_range(monkeypatch) -> None:
    """``measure_shape`` times each route on copies of the synthetic weight, in turn, up to the
    working bytes (a step reads every layer from memory: one hot copy ranked the routes that read
    more bytes too high), each copy computing the same result; the synthetic codes keep the model's
    range, so a build reading codes packed at their width reads as many bits as it would serve."""
    from servelm.model.gguf.gguf_blocks import PackedCodes

    weight = route_table.synthetic_weight(LinearShape(256, 64, "Q5_0", False, True), 32, False, (-16, 15))
    low, high = torch.aminmax(weight.codes)
    assert (int(low), int(high)) == (-16, 15) and PackedCodes.of(weight.codes).bits == 5
    method = torch_method()
    shape = LinearShape(256, 64, "Q5_0", False, True)
    layers = route_table.cold_copies(method, weight, shape, working_bytes=4 << 20)
    held = method.prepare_all(nn.Module(), weight, shape)   # the module's blocks and every route's copy
    assert held >= weight.nbytes + layers[0].gguf_dense.nbytes + sum(t.nbytes for t in layers[0].gguf_i8 if t is not None)
    assert len(layers) == -(-(4 << 20) // held) > 2
    assert layers[1].gguf_dense.data_ptr() != layers[0].gguf_dense.data_ptr()
    x = torch.randn(3, 256).bfloat16()
    for route in Route:
        assert torch.equal(method.run_route(route, layers[0], x, None, True),
                           method.run_route(route, layers[-1], x, None, True))
    assert len(route_table.cold_copies(method, weight, shape, working_bytes=1)) == 1   # a model in the cache

    seen: dict[str, set[int]] = {}
    original = method.run_route

    def recording(route, layer, *args):
        seen.setdefault(route.value, set()).add(id(layer))
        return original(route, layer, *args)

    def calls(candidates, **_):
        for _ in range(len(layers) + 1):
            for run in candidates.values():
                run()
        return {name: 1.0 for name in candidates}

    monkeypatch.setattr(method, "run_route", recording)
    monkeypatch.setattr(route_table, "time_candidates", calls)
    table = route_table.RouteTable({})
    assert route_table.measure_shape(method, shape, 32, False, torch.bfloat16, table, float("inf"), (-16, 15),
                                     4 << 20)
    assert set(seen) == {route.value for route in Route}
    assert all(len(ids) == len(layers) for ids in seen.values())   # every copy, for every route


def test_a_long_prompt_chunk_is_cut_into_dense_calls_only_where_that_measured_faster(tmp_path, monkeypatch) -> None:
    """``DENSE_CALL_ROWS``: the table times ``DENSE_SPLIT_ROWS`` rows on the dense copy in one call and in
    calls of that many rows; a layer holding the dense copy cuts longer calls where the cut calls won by
    ``DENSE_SPLIT_MARGIN`` (oneDNN's bf16 GEMM on AMX ran 1,019 x 2,048 x 640 at half the rate of two
    ~510-row calls), never the head, and a cell without that timing keeps one call."""
    method = torch_method(dense_dtype=torch.float32)
    shape = LinearShape(128, 64, "Q8_0", False, False)
    head = LinearShape(128, 64, "Q8_0", True, False)
    specs = [route_table.ShapeSpec(shape, 32, False), route_table.ShapeSpec(head, 32, False)]
    seen: list[set[str]] = []
    for cut_us, expected in ((0.9, route_table.DENSE_CALL_ROWS), (0.97, 0), (1.2, 0)):
        def timing(candidates, **_):
            seen.append(set(candidates))
            return {name: {"cut": cut_us, "whole": 1.0, "dense": 0.5}.get(name, 1.0) for name in candidates}

        monkeypatch.setattr(route_table, "time_candidates", timing)
        table, _ = route_table.build_table(method, specs, torch.float32, None, tmp_path, fresh=True)
        assert {"whole", "cut"} in seen and table.split_cell_name(head, False) not in table.times_us
        assert table.split_cell_name(shape, False) not in table.cells   # times only: never a ranking's cell
        ranking = table.ranking(method.default_ranking)
        assert ranking.dense_call_rows(shape, False) == expected and ranking.dense_call_rows(head, False) == 0
        resolved = LayerRoutes.resolve(shape, frozenset({Route.BLOCK, Route.DENSE}), ranking, False, "int16", False)
        assert Route.DENSE in resolved.held and resolved.dense_rows == expected
        no_dense = LayerRoutes.resolve(shape, frozenset({Route.BLOCK, Route.DENSE}), ranking_of(Route.BLOCK),
                                       False, "int16", False)
        assert no_dense.dense_rows == 0   # a ranking without the timing (the defaults): one call
    table.times_us.clear()
    assert table.ranking(method.default_ranking).dense_call_rows(shape, False) == 0


@pytest.mark.parametrize("rows, calls", [(700, [350, 350]), (1025, [342, 342, 341]), (512, [512]), (3, [3])])
def test_dense_calls_cover_every_row_in_even_calls(monkeypatch, rows: int, calls: list[int]) -> None:
    """``dense_calls``: rows beyond ``call_rows`` go in even calls of at most that many, each row's result
    that of the call computing it, in place; at most ``call_rows`` rows (or 0) take one call."""
    from servelm.model.gguf import gguf_linear

    seen: list[int] = []
    linear = gguf_linear.dense_linear

    def counted(x, weight):
        seen.append(x.shape[0])
        return linear(x, weight)

    monkeypatch.setattr(gguf_linear, "dense_linear", counted)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=generator).bfloat16()
    weight = torch.randn(48, 64, generator=generator).bfloat16()
    out = gguf_linear.dense_calls(x, weight, 512)
    assert seen == calls and out.shape == (rows, 48) and out.dtype == torch.bfloat16
    start = 0
    for count in calls:   # each part as a call of its own rows computes it
        assert torch.equal(out[start:start + count], linear(x[start:start + count], weight))
        start += count
    seen.clear()
    assert torch.equal(gguf_linear.dense_calls(x, weight, 0), linear(x, weight)) and seen == [rows]
