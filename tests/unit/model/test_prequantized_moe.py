"""Pre-quantized mixture-of-experts checkpoints (issue 34's "one of the MoE architectures"): tiny
random Qwen3-MoE and Mixtral whose every expert projection is quantized, written as GPTQ int4 (its
published layout, per-expert ``qweight``/``qzeros``/``scales``/``g_idx``; the reference is its
documented dequantization) and as compressed-tensors pack-quantized int4 and int8 (made by the
compressed-tensors library itself on the experts unfused into Linear layers, as llm-compressor
quantizes them; the reference is the library's own decompression). Mixtral's tensors carry its
published names (``block_sparse_moe.experts.<e>.w1`` / ``w3`` / ``w2``).

- ``--dtype float32``: every quantized module dequantized exactly at load, as the dense path does;
  logits and greedy tokens equal the reference's in float32.
- ``--dtype auto`` (tp 1): each expert's integer codes run on the GGUF block routes at their own
  precision (each expert split into its own linears, as a GGUF MoE file's are), no float expert
  stack left; logits within the routes' 16-bit activation rounding, greedy tokens equal.
- ``--ep-size 2 --tp-size 2`` (``--dtype auto``): each rank serves its two whole experts on the block
  routes, holding only their codes (the tensor-parallel attention is dequantized); with the experts
  the only quantized modules, logits equal one process's within the routes' activation rounding
  of float32 differences upstream (SAME_ROUTES) and greedy tokens equal, and both stay within the routes' activation rounding of the reference. GPTQ desc_act,
  AWQ and compressed-tensors int4/int8 (slow) likewise; DP attention (slow): every layer whole on
  every rank, on the block routes, the experts expert-parallel. ``--dtype float32`` (slow): each
  rank dequantizes exactly the experts it holds; logits equal one process's.
- An expert-parallel group smaller than the tensor-parallel one splits each expert's intermediate
  columns: a rank keeps its group's experts' codes where its columns are whole groups and a
  multiple of the kernels' 64 inputs (GPTQ group 32, 64 columns a rank), and dequantizes them
  where they are not, or where desc_act sorts the down projection's inputs by group (a rank's
  columns are then no whole groups).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig
from servelm.distributed.parallel import ParallelContext
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.layers.moe import FusedMoE
from servelm.model.runner import ModelRunner
from servelm.model.source import resolve_model_source
from tests.prequantized_checkpoints import (make_quant_hf_model, reference_model, write_awq, write_ct_with_library,
                                            write_gptq)

from .conftest import BLOCK_SIZE, POOL_TOKENS, BlockAllocator, prompts_for
from .test_prequantized import (NUM_NEW_TOKENS, assert_parity, logits_and_greedy, make_quant_runner,
                                 reference_logits_and_greedy)

SLOW = pytest.mark.slow
NUM_EXPERTS = 4          # top-2 of 4: every expert gets rows of the prompts
HIDDEN, EXPERT_FFN = 128, 64   # both multiples of 64: the block kernels take every expert projection
CT_INT4 = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32}
CT_INT8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
KINDS = {"gptq": "GPTQ-int4", "gptq-desc-act": "GPTQ-int4-act", "ct-int4": "CT-int4", "ct-int8": "CT-int8",
         "gptq-experts": "GPTQ-int4", "awq-experts": "AWQ-int4"}
"""Checkpoint kind -> the block weights' kind its experts are served as."""
SAME_ROUTES = 1e-4
"""Relative distance allowed between logits of the same weights on the same block routes in one
process and over ranks (measured: 2e-5; 20x below the routes' distance to the float reference): the
routes round activations to 16 bits per 32 inputs, so a float32 rounding difference upstream (the
tensor-parallel attention's all-reduce sums in another order) can move an activation by one step."""
STORED = {"gptq": "qweight", "gptq-desc-act": "qweight", "ct-int4": "weight_packed", "ct-int8": "weight_packed"}


def moe_model(arch: str, expert_ffn: int = EXPERT_FFN) -> Any:
    if arch == "mixtral":
        return make_quant_hf_model(arch, hidden=HIDDEN, intermediate=expert_ffn, seed=2, num_local_experts=NUM_EXPERTS)
    return make_quant_hf_model(arch, hidden=HIDDEN, intermediate=128, moe_intermediate_size=expert_ffn,
                               num_experts=NUM_EXPERTS)


def write_checkpoint(path: Path, model: Any, kind: str) -> dict[str, torch.Tensor]:
    """The checkpoint of ``kind``; returns the reference weights (HF name -> dequantized float32)."""
    if kind.startswith("gptq"):
        return write_gptq(path, model, 4, 32, sym=False, desc_act=kind == "gptq-desc-act",
                          experts_only=kind == "gptq-experts")
    if kind == "awq-experts":
        return write_awq(path, model, 32, experts_only=True)
    return write_ct_with_library(path, model, CT_INT4 if kind == "ct-int4" else CT_INT8, "pack-quantized")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``(arch, kind[, expert FFN]) -> (directory, the float model, the dequantized reference model)``,
    written once."""
    made: dict[tuple[str, str, int], tuple[Path, Any, Any]] = {}

    def get(arch: str, kind: str, expert_ffn: int = EXPERT_FFN) -> tuple[Path, Any, Any]:
        if (arch, kind, expert_ffn) not in made:
            model = moe_model(arch, expert_ffn)
            path = tmp_path_factory.mktemp(f"{arch}-{kind}-{expert_ffn}") / "checkpoint"
            made[arch, kind, expert_ffn] = (path, model, reference_model(model, write_checkpoint(path, model, kind)))
        return made[arch, kind, expert_ffn]
    return get


def stored_expert_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys() if ".experts." in name}


@pytest.mark.parametrize(("arch", "kind"), [
    pytest.param("qwen3_moe", "gptq", marks=SLOW), ("mixtral", "ct-int4"),
    pytest.param("qwen3_moe", "ct-int8", marks=SLOW),
    pytest.param("mixtral", "gptq", marks=SLOW), pytest.param("qwen3_moe", "ct-int4", marks=SLOW),
    pytest.param("mixtral", "gptq-desc-act", marks=SLOW)])
def test_dequantized_experts_match_the_reference(checkpoints: Any, arch: str, kind: str) -> None:
    """The checkpoint stores every expert projection quantized (no float expert weight), under the
    family's published names; servelm in float32 gives the reference's logits and greedy tokens."""
    if kind.startswith("ct"):
        pytest.importorskip("compressed_tensors")
    path, model, reference = checkpoints(arch, kind)
    stored = stored_expert_tensors(path)
    projections = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    layer = "block_sparse_moe" if arch == "mixtral" else "mlp"
    for expert in range(NUM_EXPERTS):
        for projection in projections:
            packed = stored[f"model.layers.0.{layer}.experts.{expert}.{projection}.{STORED[kind]}"]
            assert packed.dtype == torch.int32
    assert not any(name.endswith(".weight") for name in stored)
    # the reference holds the quantized experts, not the float ones they came from
    assert not torch.equal(reference.model.layers[0].mlp.experts.down_proj, model.model.layers[0].mlp.experts.down_proj)
    assert_parity(make_quant_runner(path), reference, arch)


@pytest.mark.parametrize(("arch", "kind"), [
    ("mixtral", "gptq"), pytest.param("qwen3_moe", "ct-int8", marks=SLOW),
    pytest.param("qwen3_moe", "gptq", marks=SLOW),
    pytest.param("mixtral", "ct-int4", marks=SLOW), pytest.param("mixtral", "gptq-desc-act", marks=SLOW)])
def test_experts_run_at_their_own_precision_on_the_block_routes(checkpoints: Any, arch: str, kind: str,
                                                                float32_rest: None) -> None:
    """--dtype auto: every expert's gate_up and down are block linears of the checkpoint's codes (the
    stacks dropped); logits within the block routes' activation rounding of the reference's, greedy
    tokens equal. desc_act: each expert's inputs sorted by group (a permuted input)."""
    from servelm.model.gguf.gguf_kernel import load_kernel
    from servelm.model.prequantized import PermutedInputMethod
    if load_kernel() is None:
        pytest.skip("no GGUF block kernel on this machine")
    if kind.startswith("ct"):
        pytest.importorskip("compressed_tensors")
    path, _, reference = checkpoints(arch, kind)
    runner = make_quant_runner(path, dtype="auto")
    moes = [module for module in runner.model.modules() if isinstance(module, FusedMoE)]
    assert len(moes) == 2   # Mixtral's two layers; Qwen3-MoE's layers 0 and 2 (1 is dense)
    for moe in moes:
        assert moe.gate_up_proj is None and moe.down_proj is None and moe.expert_layers is not None
        for layers in moe.expert_layers:
            for linear in (layers.gate_up_proj, layers.down_proj):
                assert getattr(linear, "gguf_weight", None) is not None
                assert linear.gguf_weight.kind == KINDS[kind]
                assert isinstance(linear.linear_method, PermutedInputMethod) == (kind == "gptq-desc-act")
    prompts = prompts_for(arch, runner.vocab_size)
    logits, greedy = logits_and_greedy(runner, prompts)
    expected_logits, expected_greedy = reference_logits_and_greedy(reference, prompts)
    assert (logits - expected_logits).norm() <= 2e-3 * expected_logits.norm()
    assert greedy == expected_greedy


def expert_parallel_logits(path: Path, prompts: list[list[int]], parallel: Any, size: int,
                           quantization: str = "auto") -> torch.Tensor:
    """Prompt logits of ``path`` in float32 at ``--tp-size size --ep-size size`` (``parallel``: this
    rank's context, None for one process)."""
    model_config = ModelConfig(model=str(path), device="cpu", dtype="float32", quantization=quantization)
    config = EngineConfig(model=model_config, cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=POOL_TOKENS),
                          parallel=ParallelConfig(tensor_parallel_size=size, expert_parallel_size=size))
    runner = ModelRunner(config, resolve_model_source(model_config), parallel=parallel)
    assert runner.parallel.ep_size == size
    allocator = BlockAllocator(POOL_TOKENS // BLOCK_SIZE)
    return runner.execute(BatchPlan([allocator.plan(i, p, num_logits=len(p)) for i, p in enumerate(prompts)]))


@SLOW
def test_expert_parallel_2_with_tensor_parallel_2_equals_one_process(checkpoints: Any) -> None:
    """--ep-size 2 --tp-size 2 on the GPTQ Qwen3-MoE: each rank dequantizes exactly the experts it
    holds (the block routes are tp-1 only); the logits of every rank equal one process's."""
    from tests.unit.distributed.test_parallel import run_ranks

    path, _, _ = checkpoints("qwen3_moe", "gptq")
    prompts = prompts_for("qwen3_moe", 320)
    expected = expert_parallel_logits(path, prompts, None, 1)
    for got in run_ranks(2, lambda parallel: expert_parallel_logits(path, prompts, parallel, 2)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


# --- expert parallelism and tensor parallelism on the block routes -----------------------------------

def parallel_config(path: Path, size: int, *, ep_size: int | None = None, dp_attention: bool = False,
                    dtype: str = "auto") -> EngineConfig:
    model_config = ModelConfig(model=str(path), device="cpu", dtype=dtype)
    return EngineConfig(model=model_config, cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=POOL_TOKENS),
                        parallel=ParallelConfig(tensor_parallel_size=size, enable_dp_attention=dp_attention,
                                                expert_parallel_size=1 if dp_attention else ep_size or size))


class PartitionAllocator:
    """Sequence i's blocks from pool partition ``i % num_ranks`` (DP attention: its rank's pool)."""

    def __init__(self, num_ranks: int, blocks_per_rank: int) -> None:
        self.next_free = [rank * blocks_per_rank for rank in range(num_ranks)]
        self.tables: dict[int, list[int]] = {}
        self.num_cached: dict[int, int] = {}

    def plan(self, sequence_id: int, token_ids: list[int], num_logits: int) -> SequencePlan:
        table = self.tables.setdefault(sequence_id, [])
        start = self.num_cached.get(sequence_id, 0)
        partition = sequence_id % len(self.next_free)
        while len(table) * BLOCK_SIZE < start + len(token_ids):
            table.append(self.next_free[partition])
            self.next_free[partition] += 1
        self.num_cached[sequence_id] = start + len(token_ids)
        return SequencePlan(list(token_ids), start, list(table), num_logits=num_logits)


def ranks_logits_and_greedy(runner: ModelRunner, prompts: list[list[int]], parallel: ParallelContext,
                            allocator: Any) -> tuple[torch.Tensor, list[list[int]]]:
    """``logits_and_greedy`` on every rank at once: rank 0's tokens are broadcast, so each rank plans
    the same steps (under DP attention only rank 0 has the logits)."""
    def next_tokens(logits: torch.Tensor, rows: torch.Tensor) -> list[int]:
        tokens = logits[rows].argmax(-1) if parallel.tp_rank == 0 else torch.empty(len(prompts), dtype=torch.int64)
        return parallel.broadcast(tokens.contiguous(), 0).tolist()

    logits = runner.execute(BatchPlan([allocator.plan(i, p, num_logits=len(p)) for i, p in enumerate(prompts)]))
    outputs = [[token] for token in next_tokens(logits, torch.tensor([len(p) for p in prompts]).cumsum(0) - 1)]
    for _ in range(NUM_NEW_TOKENS - 1):
        step = runner.execute(BatchPlan([allocator.plan(i, out[-1:], num_logits=1) for i, out in enumerate(outputs)]))
        for out, token in zip(outputs, next_tokens(step, torch.arange(len(prompts)))):
            out.append(token)
    return logits, outputs


def block_expert_bytes(runner: ModelRunner, max_bits: int = 5) -> dict[str, int]:
    """Every expert projection this rank serves on the block routes -> the bytes of its block weight,
    each checked against the checkpoint's precision: codes packed at their bit width (at most
    ``max_bits``: an asymmetric int4 code less its zero point takes 5) or int8 bytes, plus a float32
    scale (and offset) per group of 32 and, where the AVX2 kernel made one, its compact copy of them;
    the float expert stacks are gone."""
    held: dict[str, int] = {}
    for name, moe in runner.model.named_modules():
        if not isinstance(moe, FusedMoE):
            continue
        assert moe.gate_up_proj is None and moe.down_proj is None and moe.expert_layers is not None, name
        for expert, layers in zip(moe.checkpoint_experts, moe.expert_layers, strict=True):
            for projection in ("gate_up_proj", "down_proj"):
                weight = getattr(layers, projection).gguf_weight
                n, k = weight.shape
                bits = 8 if weight.stored_codes is not None else weight.packed.bits
                # int8 bytes where the kernel reads them (the AVX-512 build), else packed at the bit width
                assert weight.stored_codes is not None or bits <= max_bits, (name, expert, projection, bits)
                code_bytes = n * k * bits // 8
                group_bytes = n * (k // 32) * 4 * (1 if weight.offsets is None else 2)
                # the AVX2 kernel's compact copy of the scales (and offsets): fp16 or smaller
                compact = [t for t in weight.compact or () if t is not None]
                assert all(t.element_size() <= 2 and t.numel() == n * (k // 32) for t in compact)
                group_bytes += sum(t.nbytes for t in compact)
                assert weight.nbytes == code_bytes + group_bytes, (name, expert, projection)
                held[f"{name}.{expert}.{projection}"] = weight.nbytes
    return held


def test_expert_parallel_ranks_serve_their_whole_experts_in_their_blocks(checkpoints: Any, float32_rest: None) -> None:
    """--tp-size 2 --ep-size 2, --dtype auto, on a GPTQ Mixtral whose experts are its only quantized
    modules: each rank serves its 2 of the 4 experts per layer on the block routes, holding exactly
    their block weights (half the one-process experts' bytes, the checkpoint's precision, no float
    stack); logits on both ranks equal one process's (block routes too) within SAME_ROUTES, and
    greedy tokens equal; both within the routes' activation rounding of the reference."""
    from servelm.model.gguf.gguf_kernel import load_kernel
    from tests.unit.distributed.test_parallel import run_ranks

    if load_kernel() is None:
        pytest.skip("no GGUF block kernel on this machine")
    path, _, reference = checkpoints("mixtral", "gptq-experts")
    prompts = prompts_for("mixtral", 320)
    single = ModelRunner(parallel_config(path, 1), resolve_model_source(parallel_config(path, 1).model))
    expected_logits, expected_greedy = logits_and_greedy(single, prompts)
    single_bytes = block_expert_bytes(single)

    def work(parallel: ParallelContext) -> tuple[torch.Tensor, list[list[int]], dict[str, int], list[str]]:
        config = parallel_config(path, 2)
        runner = ModelRunner(config, resolve_model_source(config.model), parallel=parallel)
        kinds = [linear.gguf_weight.kind for moe in runner.model.modules() if isinstance(moe, FusedMoE)
                 for layers in moe.expert_layers for linear in (layers.gate_up_proj, layers.down_proj)]
        logits, greedy = logits_and_greedy(runner, prompts)
        return logits, greedy, block_expert_bytes(runner), kinds

    ranks = run_ranks(2, work)
    for rank, (logits, greedy, held, kinds) in enumerate(ranks):
        assert set(kinds) == {"GPTQ-int4"} and len(kinds) == 2 * 2 * 2   # 2 layers x 2 experts x 2 linears
        mine = {name for name in single_bytes if int(name.split(".")[-2]) in (2 * rank, 2 * rank + 1)}
        assert held == {name: single_bytes[name] for name in mine}, rank
        assert (logits - expected_logits).norm() <= SAME_ROUTES * expected_logits.norm()
        assert greedy == expected_greedy
    assert sum(ranks[0][2].values()) + sum(ranks[1][2].values()) == sum(single_bytes.values())
    reference_logits, reference_greedy = reference_logits_and_greedy(reference, prompts)
    assert (expected_logits - reference_logits).norm() <= 2e-3 * reference_logits.norm()
    assert expected_greedy == reference_greedy


@SLOW
@pytest.mark.parametrize(("arch", "kind"), [("qwen3_moe", "gptq-desc-act"), ("mixtral", "awq-experts"),
                                            ("qwen3_moe", "ct-int4"), ("mixtral", "ct-int8")])
@pytest.mark.parametrize("dp_attention", [False, True])
def test_expert_parallel_block_experts_of_every_format(checkpoints: Any, arch: str, kind: str,
                                                       dp_attention: bool) -> None:
    """--tp-size 2 with --ep-size 2 or --enable-dp-attention, --dtype auto: each rank's experts are
    block linears of its 2 experts' codes in the checkpoint's kind (desc_act: a permuted input);
    under DP attention every other quantized layer too, whole, and each rank runs its own
    sequences. Logits within the routes' activation rounding of the reference, greedy tokens
    equal; where only the experts are quantized, logits equal one process's within SAME_ROUTES
    (each expert computes the same rows as there, on the same routes)."""
    from servelm.model.gguf.gguf_kernel import load_kernel
    from servelm.model.prequantized import PermutedInputMethod
    from tests.unit.distributed.test_parallel import run_ranks

    if load_kernel() is None:
        pytest.skip("no GGUF block kernel on this machine")
    if kind.startswith("ct"):
        pytest.importorskip("compressed_tensors")
    path, _, reference = checkpoints(arch, kind)
    prompts = prompts_for(arch, 320)
    single = ModelRunner(parallel_config(path, 1), resolve_model_source(parallel_config(path, 1).model))
    expected_logits, expected_greedy = logits_and_greedy(single, prompts)

    def work(parallel: ParallelContext) -> tuple[torch.Tensor, list[list[int]], dict[str, int], list[Any]]:
        config = parallel_config(path, 2, dp_attention=dp_attention)
        runner = ModelRunner(config, resolve_model_source(config.model), parallel=parallel)
        linears = [linear for moe in runner.model.modules() if isinstance(moe, FusedMoE)
                   for layers in moe.expert_layers for linear in (layers.gate_up_proj, layers.down_proj)]
        assert {linear.gguf_weight.kind for linear in linears} == {KINDS[kind]}
        assert all(isinstance(linear.linear_method, PermutedInputMethod) == (kind == "gptq-desc-act")
                   for linear in linears)
        attention = runner.model.model.layers[0].self_attn.o_proj
        assert (getattr(attention, "gguf_weight", None) is not None) == (dp_attention and "experts" not in kind)
        allocator = PartitionAllocator(2, POOL_TOKENS // BLOCK_SIZE // 2) if dp_attention else None
        logits, greedy = (ranks_logits_and_greedy(runner, prompts, parallel, allocator) if dp_attention
                          else logits_and_greedy(runner, prompts))
        return logits, greedy, block_expert_bytes(runner, 8 if kind == "ct-int8" else 5), [parallel.tp_rank]

    reference_logits, reference_greedy = reference_logits_and_greedy(reference, prompts)
    ranks = run_ranks(2, work)
    assert len(ranks[0][2]) == len(ranks[1][2]) == len(block_expert_bytes(single, 8)) // 2
    for logits, greedy, _, _ in ranks[:1] if dp_attention else ranks:
        assert (logits - reference_logits).norm() <= 2e-3 * reference_logits.norm()
        assert greedy == reference_greedy == expected_greedy
        if "experts" in kind:   # float attention (a rank's rows may take other routes than one process's)
            assert (logits - expected_logits).norm() <= SAME_ROUTES * expected_logits.norm()


def expert_group_layer(rank: int, intermediate: int = 64) -> tuple[torch.nn.Module, Any]:
    """Rank ``rank`` of --tp-size 4 --ep-size 2 over 4 experts (hidden 64): the experts layer of group
    ``rank // 2`` (experts 2g, 2g + 1), the second half of the intermediate columns on odd ranks."""
    from servelm.model.layers.moe_parallel import ExpertGroupMoE

    moe = ExpertGroupMoE(4, 64, intermediate, "silu",
                         parallel=ParallelContext(tp_rank=rank, tp_size=4, ep_size=2, group=object()))
    model = torch.nn.Module()
    model.experts = moe
    return model, moe


@pytest.mark.parametrize("rank", [0, 3])
def test_an_expert_group_rank_keeps_its_own_experts_columns_in_whole_groups(rank: int) -> None:
    """--tp-size 4 --ep-size 2: rank 3 holds experts 2 and 3, columns 32..64 (rank 0: experts 0 and
    1, columns 0..32): its expert linears are named by those checkpoint ids and hold exactly those
    experts' gate/up rows and down inputs (whole groups of 32), whatever the other group's weights."""
    from servelm.model.gguf.gguf_weights import split_block_experts
    from tests.tiny_models import random_block_weight

    shapes = {"gate_proj": (64, 64), "up_proj": (64, 64), "down_proj": (64, 64)}
    blocks = {f"experts.{e}.{p}.weight": random_block_weight(*shape, 32, offsets=True, seed=10 * e + i)
              for e in range(4) for i, (p, shape) in enumerate(shapes.items())}
    whole = {name: weight.dequantize() for name, weight in blocks.items()}
    model, moe = expert_group_layer(rank)
    assert split_block_experts(model, blocks) == [moe]
    assert split_block_experts(model, blocks) == [moe]   # a second call keeps the narrowed blocks
    group, columns = divmod(rank, 2)
    assert moe.checkpoint_experts == (2 * group, 2 * group + 1)
    assert [name for name, _ in moe.named_children() if name.isdigit()] == [str(2 * group), str(2 * group + 1)]
    cut = slice(32 * columns, 32 * columns + 32)
    for expert in moe.checkpoint_experts:
        for projection in shapes:
            name = f"experts.{expert}.{projection}.weight"
            expected = whole[name][:, cut] if projection == "down_proj" else whole[name][cut]
            assert torch.equal(blocks[name].dequantize(), expected), name


@pytest.mark.parametrize(("intermediate", "desc_act", "kept"), [(128, False, True), (128, True, False),
                                                                 (64, False, False)])
def test_which_column_split_experts_keep_their_codes(intermediate: int, desc_act: bool, kept: bool) -> None:
    """A rank of --tp-size 4 --ep-size 2 holding half of each of its experts' intermediate columns
    keeps their codes for the block routes where its down projections take 64 inputs (expert FFN
    128), not 32 (64: the kernels' input step), nor where desc_act sorts the down inputs by group (a
    rank's columns are then no whole groups); left-out layers serve dequantized. Whole experts
    (--ep-size = --tp-size) keep theirs either way."""
    from servelm.model.prequantized import _keep_servable_expert_columns
    from tests.tiny_models import random_block_weight

    shapes = {"gate_proj": (intermediate, 64), "up_proj": (intermediate, 64), "down_proj": (64, intermediate)}
    blocks = {f"experts.{e}.{p}.weight": random_block_weight(*shape, 32, offsets=False, seed=e)
              for e in range(4) for p, shape in shapes.items()}
    orders = {f"experts.{e}.down_proj.weight": torch.randperm(intermediate) for e in range(4)} if desc_act else {}
    model, _ = expert_group_layer(1, intermediate)
    served, others = dict(blocks), {}
    _keep_servable_expert_columns(model, served, orders, others)
    assert sorted(others) == ([] if kept else sorted(f"experts.{e}.{p}.weight" for e in (0, 1) for p in shapes))
    assert set(served) == set(blocks) - set(others)
    model.experts = FusedMoE(4, 64, intermediate, "silu")
    served = dict(blocks)
    _keep_servable_expert_columns(model, served, orders, {})
    assert served == blocks


@SLOW
def test_expert_group_smaller_than_tensor_parallel_serves_columns_in_blocks(checkpoints: Any) -> None:
    """--tp-size 4 --ep-size 2, --dtype auto, GPTQ (group 32) experts only, expert FFN 128: each rank
    serves its group's 2 experts' 64 intermediate columns (two whole groups) on the block routes;
    logits equal one process's within SAME_ROUTES, greedy tokens equal."""
    from servelm.model.gguf.gguf_kernel import load_kernel
    from tests.unit.distributed.test_parallel import run_ranks

    if load_kernel() is None:
        pytest.skip("no GGUF block kernel on this machine")
    path, _, _ = checkpoints("mixtral", "gptq-experts", 128)
    prompts = prompts_for("mixtral", 320)
    single = ModelRunner(parallel_config(path, 1), resolve_model_source(parallel_config(path, 1).model))
    expected_logits, expected_greedy = logits_and_greedy(single, prompts)

    def work(parallel: ParallelContext) -> tuple[torch.Tensor, list[list[int]], list[tuple[int, ...]]]:
        config = parallel_config(path, 4, ep_size=2)
        runner = ModelRunner(config, resolve_model_source(config.model), parallel=parallel)
        shapes = [tuple(layers.down_proj.gguf_weight.shape) for moe in runner.model.modules()
                  if isinstance(moe, FusedMoE) for layers in moe.expert_layers]
        return (*logits_and_greedy(runner, prompts), shapes)

    for logits, greedy, shapes in run_ranks(4, work):
        assert shapes == [(HIDDEN, 64)] * 4
        assert (logits - expected_logits).norm() <= SAME_ROUTES * expected_logits.norm()
        assert greedy == expected_greedy
