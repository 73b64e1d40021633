"""The flat decode paths (servelm.model.architectures.flat_decode: gemma3_decode, llama_decode) against
the layer modules: a tiny bf16 or float32 model of each family on GGUF-style block weights (Q8_0: int8
codes, a scale per 32 inputs) decodes the same prompts through both, and every step's logits must be
bit-identical; the flat path must really run. Qwen2's QKV bias, Qwen3's q/k norms, Llama 3's rope
scaling and a Mistral sliding window each take their own branch. The real Qwen2.5-Coder 0.5B GGUF
(the default model) is checked the same way (slow). EAGLE heads' feature capture (``HiddenCapture``'s
hooks) sees the same features on a step the flat path would take as through the modules."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from servelm.model import huge_pages
from servelm.model.architectures.flat_decode import FlatDecodePlan, NativeStack
from servelm.model.architectures.gemma3_decode import DecodePlan
from servelm.model.architectures import gemma3_decode, llama_decode
from servelm.model.architectures.llama_decode import LlamaDecodePlan
from servelm.model.eagle import HiddenCapture, eagle3_layer_ids
from servelm.model.forward_batch import BatchPlan
from servelm.model.layers import fused
from servelm.model.gguf.gguf_blocks import BlockWeight
from servelm.model.gguf.gguf_kernel import kernel_status, load_kernel
from servelm.model.gguf import gguf_rows
from servelm.model.gguf.gguf_linear import GateUpAct, GGUFBlockLinearMethod
from servelm.model.layers.linear import LinearBase
from tests.tiny_models import make_tiny_hf_model
from tests.unit.model.conftest import POOL_TOKENS, BLOCK_SIZE, BlockAllocator, make_runner, make_source, prompts_for

pytestmark = pytest.mark.skipif(load_kernel() is None or fused.load_kernel() is None,
                                reason=f"no GGUF block kernel or fused ops here: {kernel_status()}")

STEPS = 6


def q8_blocks(weight: torch.Tensor) -> BlockWeight:
    """``weight`` [N, K] rounded to Q8_0's form: int8 codes and one float scale per 32 inputs."""
    n, k = weight.shape
    groups = weight.float().view(n, k // 32, 32)
    scales = groups.abs().amax(-1) / 127
    codes = torch.round(groups / scales.clamp_min(1e-12)[..., None]).clamp(-127, 127).to(torch.int8)
    return BlockWeight(codes.view(n, k), scales.contiguous(), None, 32, "Q8_0")


def tiny_mistral() -> Any:
    """A tiny Mistral (every layer a sliding window of 8) with the tiny Llama's shapes."""
    config = transformers.MistralConfig(
        vocab_size=320, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, max_position_embeddings=512, sliding_window=8, initializer_range=0.1,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def block_runner(hf_model: Any, residual_dtype: str = "auto", dtype: str = "bfloat16", blocks: bool = True) -> Any:
    """A runner in ``dtype`` over ``hf_model`` with its layers' linears on Q8_0-style block weights
    (float32: a CPU without a native bf16 GEMM, the dense copies float32), or dense (``blocks`` False)."""
    runner = make_runner(make_source(hf_model), dtype=dtype, residual_dtype=residual_dtype)
    if not blocks:
        return runner
    method = GGUFBlockLinearMethod(load_kernel(), getattr(torch, dtype))
    for name, module in runner.model.named_modules():
        if isinstance(module, LinearBase) and ".layers." in name:
            method.process(module, q8_blocks(module.weight))
    return runner


def decode_logits(hf_model: Any, arch: str, rows: int, residual_dtype: str = "auto",
                  dtype: str = "bfloat16", blocks: bool = True) -> list[torch.Tensor]:
    """Prefill ``rows`` prompts, then ``STEPS`` decode steps of them all: each step's logits."""
    runner = block_runner(hf_model, residual_dtype, dtype, blocks)
    prompts = prompts_for(arch, runner.vocab_size)[:rows]
    if arch == "mistral":   # past the window
        prompts = [prompt * 3 for prompt in prompts]
    return runner_decode_logits(runner, prompts)


def runner_decode_logits(runner: Any, prompts: list[list[int]]) -> list[torch.Tensor]:
    allocator = BlockAllocator(POOL_TOKENS // BLOCK_SIZE)
    logits = runner.execute(BatchPlan([allocator.plan(i, p, num_logits=1) for i, p in enumerate(prompts)]))
    steps = []
    for _ in range(STEPS):
        tokens = logits.argmax(-1).tolist()
        logits = runner.execute(BatchPlan([allocator.plan(i, [t], num_logits=1) for i, t in enumerate(tokens)]))
        steps.append(logits)
    return steps


ARCHS = ["gemma3", "llama", "qwen2", "qwen3", "mistral"]
CASES = [(arch, *case) for arch in ARCHS for case in [("bfloat16", "float32", True), ("bfloat16", "model", True),
                                                      ("float32", "auto", True)]]
CASES += [(arch, "float32", "auto", False) for arch in ("gemma3", "qwen2")]   # dense weights: both plans, a bias
"""(arch, model dtype, residual dtype, block weights): bf16 on blocks with either residual stream, float32
on blocks, float32 on dense weights (one family per plan: the dense call is the same for every family)."""


@pytest.mark.parametrize("arch,dtype,residual_dtype,blocks", CASES)
@pytest.mark.parametrize("rows", [1, 3])
def test_flat_decode_is_bit_identical_to_the_modules(arch: str, rows: int, dtype: str, residual_dtype: str,
                                                     blocks: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model with the residual stream in float32 (the CPU default) and in bf16 (``--residual-dtype
    model``); a float32 model (the default where the CPU has no native bf16 GEMM: no rounding anywhere)
    on block weights and on dense weights (``dense_linear``'s routes)."""
    hf_model = tiny_mistral() if arch == "mistral" else make_tiny_hf_model(arch)
    plan_class = DecodePlan if arch == "gemma3" else LlamaDecodePlan
    hidden_dtypes = []
    original_run = plan_class.run
    monkeypatch.setattr(plan_class, "run", lambda self, hidden, batch, final_norm=None: (
        hidden_dtypes.append((hidden.dtype, self.dtype)), original_run(self, hidden, batch, final_norm))[1])
    check_flat_against_modules(plan_class, rows,
                               lambda: decode_logits(hf_model, arch, rows, residual_dtype, dtype, blocks), monkeypatch)
    stream = torch.bfloat16 if residual_dtype == "model" else torch.float32
    assert set(hidden_dtypes) == {(stream, getattr(torch, dtype))}


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
@pytest.mark.parametrize("rows", [1, 3])
def test_gate_up_and_act_in_one_rows_kernel_call(arch: str, rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the rows kernel (bf16 rows, AVX512-BF16), both plans compute gate_up and act * up (SiLU, GELU
    tanh) in one call of it (``gate_up_act``, which must run): bit-identical to the modules' gate_up call
    then act_and_mul."""
    rows_kernel = gguf_rows.load_kernel()
    if rows_kernel is None:
        pytest.skip(f"no rows kernel here: {gguf_rows.kernel_status()}")
    hf_model = make_tiny_hf_model(arch)
    fused_rows: list[int] = []
    original = GateUpAct.__call__
    monkeypatch.setattr(GateUpAct, "__call__", lambda self, x: (fused_rows.append(x.shape[0]), original(self, x))[1])

    def decode() -> list[torch.Tensor]:
        runner = make_runner(make_source(hf_model), dtype="bfloat16", residual_dtype="float32")
        method = GGUFBlockLinearMethod(load_kernel(), torch.bfloat16, rows_kernel=rows_kernel)
        for name, module in runner.model.named_modules():
            if isinstance(module, LinearBase) and ".layers." in name:
                method.process(module, q8_blocks(module.weight))
        return runner_decode_logits(runner, prompts_for(arch, runner.vocab_size)[:rows])

    check_flat_against_modules(DecodePlan if arch == "gemma3" else LlamaDecodePlan, rows, decode, monkeypatch)
    assert fused_rows[-STEPS:] == [rows] * STEPS   # every decode step took it


MANY_ROWS = 24
"""Decode rows past every prepared call's reach (the block and rows kernels' few rows): the routed plan."""


@pytest.mark.parametrize("arch,dtype,residual_dtype", [(arch, *case) for arch in ("gemma3", "qwen2") for case in
                                                        [("bfloat16", "float32"), ("bfloat16", "model"),
                                                         ("float32", "auto")]])
def test_many_decode_rows_take_the_routed_plan_bit_identical_to_the_modules(
        arch: str, dtype: str, residual_dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 24-row decode step (a 32-stream server's): past the prepared calls, each linear takes its route
    for those rows through ``apply`` (``routed_call``); the rest of the layer is the flat path's."""
    hf_model = make_tiny_hf_model(arch)
    plan_class = DecodePlan if arch == "gemma3" else LlamaDecodePlan
    routed_plans = []
    original_init = FlatDecodePlan.__init__

    def recording_init(self: Any, layers: Any, routed: bool = False) -> None:
        original_init(self, layers, routed)
        if routed and self.layers is not None:
            routed_plans.append(self)

    monkeypatch.setattr(FlatDecodePlan, "__init__", recording_init)

    def decode() -> list[torch.Tensor]:
        runner = block_runner(hf_model, residual_dtype, dtype)
        base = prompts_for(arch, runner.vocab_size)
        prompts = [[(token + i) % runner.vocab_size for token in base[i % len(base)]] for i in range(MANY_ROWS)]
        plan = runner.model.__dict__.get("decode_plan")
        assert plan is None or plan.generation_rows < MANY_ROWS
        return runner_decode_logits(runner, prompts)

    check_flat_against_modules(plan_class, MANY_ROWS, decode, monkeypatch)
    assert routed_plans and all(plan.generation_rows >= MANY_ROWS for plan in routed_plans)


def check_flat_against_modules(plan_class: type, rows: int, decode: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``decode()``'s step logits with the flat path (which must run every decode step) and without."""
    runs = []
    original_run = plan_class.run

    def counted_run(self: Any, hidden: torch.Tensor, batch: Any, final_norm: Any = None) -> torch.Tensor:
        runs.append(hidden.shape[0])
        return original_run(self, hidden, batch, final_norm)

    monkeypatch.setattr(plan_class, "run", counted_run)
    flat = decode()
    assert runs[-STEPS:] == [rows] * STEPS   # every decode step took the flat path
    flat_runs = len(runs)
    with monkeypatch.context() as patch:
        patch.setattr(FlatDecodePlan, "applies", lambda self, hidden, batch: False)
        modules = decode()
    assert len(runs) == flat_runs
    for step, (a, b) in enumerate(zip(flat, modules)):
        assert torch.equal(a, b), f"step {step}: max difference {(a - b).abs().max()}"


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_eagle_capture_sees_the_flat_steps(arch: str, algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The features an EAGLE head receives (``HiddenCapture.take()`` after each forward: prefill, decode
    steps of 3 rows, a verify-like pass of 3 tokens) equal the module path's, bit for bit. EAGLE reads the
    body's output (its forward hook runs around the flat layers: the flat path still runs); EAGLE-3 reads
    layer inputs through hooks on the layer modules, which the flat path does not call: it must step aside
    while they are installed (and take every step again once they are removed)."""
    hf_model = make_tiny_hf_model(arch)
    plan_class = DecodePlan if arch == "gemma3" else LlamaDecodePlan
    runs: list[int] = []
    original_run = plan_class.run

    def counted_run(self: Any, hidden: torch.Tensor, batch: Any, final_norm: Any = None) -> torch.Tensor:
        runs.append(hidden.shape[0])
        return original_run(self, hidden, batch, final_norm)

    monkeypatch.setattr(plan_class, "run", counted_run)

    def features() -> tuple[list[torch.Tensor], list[int]]:
        runner = block_runner(hf_model)
        num_layers = hf_model.config.num_hidden_layers
        capture = HiddenCapture(runner.model, eagle3_layer_ids(num_layers) if algorithm == "EAGLE3" else None)
        allocator = BlockAllocator(POOL_TOKENS // BLOCK_SIZE)
        prompts = prompts_for(arch, runner.vocab_size)
        logits = runner.execute(BatchPlan([allocator.plan(i, p, num_logits=1) for i, p in enumerate(prompts)]))
        taken = [capture.take()]
        runs.clear()
        for _ in range(STEPS):
            tokens = logits.argmax(-1).tolist()
            logits = runner.execute(BatchPlan([allocator.plan(i, [t], num_logits=1) for i, t in enumerate(tokens)]))
            taken.append(capture.take())
        runner.execute(BatchPlan([allocator.plan(0, [5, 17, 3], num_logits=3)]))   # a verify's k + 1 tokens
        taken.append(capture.take())
        flat_runs = list(runs)
        capture.remove()   # hooks gone: plain decode takes the flat path again
        runs.clear()
        runner.execute(BatchPlan([allocator.plan(0, [7], num_logits=1)]))
        assert capture.take() is None
        assert all(t is not None and t.shape == (t.shape[0], capture.width) for t in taken)
        return [t for t in taken if t is not None], flat_runs + runs

    flat, flat_runs = features()
    assert flat_runs == ([3] * STEPS + [3] if algorithm == "EAGLE" else []) + [1]
    with monkeypatch.context() as patch:
        patch.setattr(FlatDecodePlan, "applies", lambda self, hidden, batch: False)
        modules, module_runs = features()
    assert module_runs == []
    assert [t.shape[0] for t in flat] == [sum(len(p) for p in prompts_for(arch, 320))] + [3] * (STEPS + 1)
    for step, (a, b) in enumerate(zip(flat, modules)):
        assert torch.equal(a, b), f"forward {step}: max difference {(a - b).abs().max()}"


@pytest.mark.slow
def test_qwen_coder_gguf_flat_decode_is_bit_identical(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model as served by default (its GGUF blocks, bf16 where the CPU has a native bf16 GEMM,
    else float32): 1 and 3 rows (the QKV bias inside the kernel; on AVX512-BF16 gate_up and SiLU in one
    rows-kernel call)."""
    from servelm.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig
    from servelm.engine.engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=ModelConfig(model="qwen2.5-coder-0.5b"),
                                    cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=POOL_TOKENS),
                                    runtime=RuntimeConfig(num_threads=1)))
    runner: Any = engine.runner
    model = runner.model.model
    if LlamaDecodePlan([model.layers[i] for i in model.held_layers]).layers is None:
        pytest.skip("the default Qwen model is not served on GGUF block weights here")
    prompts = [engine.tokenizer.encode(text) for text in ("def quicksort(items):", "The capital of France is",
                                                          "import numpy as np\n")]
    for rows in (1, 3):
        check_flat_against_modules(LlamaDecodePlan, rows, lambda: runner_decode_logits(runner, prompts[:rows]),
                                   monkeypatch)


@pytest.mark.slow
def test_qwen_coder_gguf_serves_eagle3(tmp_path: Any) -> None:
    """The default model as served by default (GGUF blocks in bf16 where the CPU has AVX512-BF16) with a
    random-weight EAGLE-3 head: every forward hands the head its features (the flat path skipped the
    capture's layer hooks: the first forward failed)."""
    from servelm.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SpeculativeConfig
    from servelm.engine.engine import LLMEngine
    from servelm.model.eagle_checkpoint import main as write_head
    from servelm.sampling.params import SamplingParams

    write_head(["--model", "qwen2.5-coder-0.5b", "--algorithm", "EAGLE3", "--out", str(tmp_path / "head")])
    engine = LLMEngine(EngineConfig(model=ModelConfig(model="qwen2.5-coder-0.5b"),
                                    cache=CacheConfig(page_size=BLOCK_SIZE, max_total_tokens=POOL_TOKENS),
                                    runtime=RuntimeConfig(num_threads=1),
                                    speculative=SpeculativeConfig(speculative_algorithm="EAGLE3",
                                                                  speculative_draft_model_path=str(tmp_path / "head"),
                                                                  num_speculative_tokens=3)))
    runner: Any = engine.runner
    model = runner.model.model
    if (LlamaDecodePlan([model.layers[i] for i in model.held_layers]).layers is None
            or model.norm.weight.dtype != torch.bfloat16):
        pytest.skip("the default Qwen model is not served on GGUF block weights in bf16 here")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert engine.add_request("0", engine.tokenizer.encode("def quicksort(items):"), params) is None
    tokens: list[int] = []
    while engine.has_unfinished():
        for output in engine.step():
            assert output.error is None, output.error
            tokens.extend(output.new_token_ids)
    assert len(tokens) == 12 and engine.stats()["spec_num_draft_tokens"] > 0


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_float32_block_decode_takes_one_mlp_call(arch: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 Llama (SiLU) or Gemma 3 (GELU tanh, (1 + w) post-norms) on block weights runs each
    layer's MLP half (o .. down and the next input norm, the last layer's the final norm) as one
    ``DecodeMlp.run`` call at one row, where the AVX2 block kernel has it, on one thread and on two (one
    parallel region with barriers): bit-identical to the module path."""
    if getattr(load_kernel(), "DecodeMlp", None) is None:
        pytest.skip("the block kernel here has no DecodeMlp (not the AVX2 build)")
    calls = []
    family = llama_decode if arch == "llama" else gemma3_decode
    original = family.decode_mlp

    def counted(plan: Any, dtype: torch.dtype, norms: list[torch.Tensor]) -> Any:
        run = original(plan, dtype, norms)   # None for the routed plan's layers (its calls are the modules)
        return None if run is None else lambda *args: (calls.append(1), run(*args))[1]

    monkeypatch.setattr(family, "decode_mlp", counted)
    monkeypatch.setattr(family, "decode_stack", lambda plans, offset: None)   # the per-layer calls, not one for all
    hf_model = make_tiny_hf_model(arch)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_flat_against_modules(LlamaDecodePlan if arch == "llama" else DecodePlan, 1,
                                   lambda: decode_logits(hf_model, arch, 1, "auto", "float32", True), monkeypatch)
    finally:
        torch.set_num_threads(previous)
    assert len(calls) >= STEPS * hf_model.config.num_hidden_layers


def check_stack_against_modules(arch: str, threads: int, decode: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``check_flat_against_modules`` at ``threads`` threads, every decode step of the flat run in one
    ``DecodeStack.run`` call (skipped where the block kernel has no DecodeStack)."""
    if getattr(load_kernel(), "DecodeStack", None) is None:
        pytest.skip("the block kernel here has no DecodeStack (not the AVX2 build)")
    results = []
    original = NativeStack.run

    def counted(self: NativeStack, *args: Any) -> Any:
        out = original(self, *args)
        results.append(out is not None)
        return out

    monkeypatch.setattr(NativeStack, "run", counted)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        check_flat_against_modules(DecodePlan if arch.startswith("gemma3") else LlamaDecodePlan, 1, decode, monkeypatch)
    finally:
        torch.set_num_threads(previous)
    assert results[-STEPS:] == [True] * STEPS   # every decode step of the flat run took the one call (not the prompt)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "gemma3_mqa", "mistral"])
def test_float32_block_decode_takes_one_call_for_all_layers(arch: str, threads: int,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A float32 model on block weights runs a one-row step's layers in one ``DecodeStack.run`` call (QKV
    with Qwen2's bias, Qwen3's and Gemma's q/k norms, Gemma's two ropes and its sliding-window layers,
    Mistral's window past the prompt, attention and the MLP half of every layer; one KV head whose query
    heads the threads share), where the AVX2 block kernel has it, on one thread and on two: bit-identical
    to the module path."""
    hf_model = tiny_mistral() if arch == "mistral" else make_tiny_hf_model(arch)
    check_stack_against_modules(arch, threads, lambda: decode_logits(hf_model, arch, 1, "auto", "float32", True),
                                monkeypatch)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("arch", ["llama", "gemma3_mqa"])
def test_decode_stack_at_a_long_context(arch: str, threads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A context of more than two of the paged decode's segments (its columns' softmax and values in
    parts, merged): ``DecodeStack`` runs the row's segment tasks on its own threads (a lone KV head's
    query heads split where the segments are fewer) and merges them after a barrier, bit-identical to
    the module path's kernel call, on one thread and on two."""
    from servelm.model.attention import paged_decode
    config = make_tiny_hf_model(arch).config
    config.max_position_embeddings = 2048
    torch.manual_seed(0)
    hf_model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    length = 2 * paged_decode.load_kernel().SEGMENT_COLUMNS + 90
    prompt = torch.randint(0, config.vocab_size, (length,), generator=torch.Generator().manual_seed(3)).tolist()
    check_stack_against_modules(
        arch, threads, lambda: runner_decode_logits(block_runner(hf_model, "auto", "float32"), [prompt]), monkeypatch)


def test_decode_stack_refuses_what_it_cannot_compute() -> None:
    """The native stack's checks: a pool of another head size, a slot outside the pool and a span past
    the row's columns are errors before any layer runs, not reads out of bounds."""
    module = load_kernel()
    if getattr(module, "DecodeStack", None) is None:
        pytest.skip("the block kernel here has no DecodeStack (not the AVX2 build)")
    runner = block_runner(make_tiny_hf_model("llama"), dtype="float32")
    model = runner.model.model
    plan = LlamaDecodePlan([model.layers[index] for index in model.held_layers])
    assert plan.stack is not None
    layers = plan.layers or []
    first = layers[0]
    hidden = torch.randn(1, first.input_norm.shape[0])
    normed = torch.randn_like(hidden)
    rope = torch.zeros(1, first.head_dim)
    pools = [torch.zeros(16, first.num_kv_heads, first.head_dim) for _ in layers]

    def run(slot: int = 3, span: int = 2, pool_d: int = first.head_dim) -> Any:
        k_pools = [torch.zeros(16, first.num_kv_heads, pool_d) for _ in layers]
        return plan.stack.native.run(normed, hidden, [rope], [rope], torch.tensor([slot]),
                                     [torch.tensor([[0, 1, 2, 3]])], [torch.tensor([span])], k_pools, pools,
                                     model.norm.weight, model.norm.eps)

    assert run()[0].shape == hidden.shape
    with pytest.raises(RuntimeError, match="pools"):
        run(pool_d=first.head_dim * 2)
    with pytest.raises(RuntimeError, match="outside the pool"):
        run(slot=16)
    with pytest.raises(RuntimeError, match="span"):
        run(span=5)


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_the_plan_reads_its_weights_gathered_onto_huge_pages(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan moves the copies its calls read into one huge-paged run in step order (a tiny model's too,
    with the size floor lifted) and is built again on them; the flat steps stay bit-identical to the
    modules, which read the same tensor objects."""
    monkeypatch.setattr(huge_pages, "GATHER_MIN_BYTES", 0)
    plans: list[Any] = []
    original_init = FlatDecodePlan.__init__

    def recording_init(self: Any, layers: Any, routed: bool = False) -> None:
        original_init(self, layers, routed)
        if not routed and self.layers is not None:
            plans.append(self)

    monkeypatch.setattr(FlatDecodePlan, "__init__", recording_init)
    hf_model = make_tiny_hf_model(arch)
    plan_class = DecodePlan if arch == "gemma3" else LlamaDecodePlan
    check_flat_against_modules(plan_class, 1, lambda: decode_logits(hf_model, arch, 1), monkeypatch)
    assert plans
    for plan in plans:
        weights = list({weight.data_ptr(): weight for weight in plan.weights()}.values())
        assert len(weights) >= 4 * len(plan.layers)
        assert len({weight.untyped_storage().data_ptr() for weight in weights}) == 1   # one buffer
        first, last = min(w.data_ptr() for w in weights), max(w.data_ptr() + w.nbytes for w in weights)
        assert last - first <= sum(-(-w.nbytes // huge_pages.GATHER_ALIGN) * huge_pages.GATHER_ALIGN
                                   for w in weights)   # one run, nothing between
        assert first % huge_pages.HUGE_PAGE_BYTES == 0
