"""--enable-torch-compile (compiled decode layers) and --num-threads (engine thread placement)."""

from __future__ import annotations

import os
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig, RuntimeConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.distributed.parallel import ParallelContext
from servelm.model.architectures.common import GatedMLP
from servelm.model.compile import INDUCTOR_OPTIONS, DecodeDispatch
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.layers.norm import RMSNorm
from servelm.model.threads import (OMP_WAIT_POLICY, available_cpus, configure_engine_threads,
                                   configure_front_end_threads, default_num_threads,
                                   ThreadGovernor, export_openmp_wait_policy)
from servelm.sampling.params import SamplingParams
from tests.tiny_models import make_tiny_model_dir


def test_dispatch_compiles_only_small_decode_steps() -> None:
    calls: list[str] = []
    dispatch = DecodeDispatch(lambda h, b: calls.append("eager"), lambda h, b: calls.append("compiled"),
                              max_bs=4)
    for num_tokens, num_sequences in [(3, 3), (4, 4), (5, 5), (6, 3), (1, 1)]:
        dispatch(torch.zeros(1), SimpleNamespace(num_tokens=num_tokens, num_sequences=num_sequences,
                                                 lora=[]))
    dispatch(torch.zeros(1), SimpleNamespace(num_tokens=2, num_sequences=2, lora=["a group"]))
    assert calls == ["compiled", "compiled", "eager", "eager", "compiled", "eager"]  # LoRA: eager


def test_compile_with_quantization_is_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match="--enable-torch-compile cannot be combined"):
        EngineConfig(model=ModelConfig(quantization="w8a8_int8"),
                     runtime=RuntimeConfig(enable_torch_compile=True))
    with pytest.raises(ValueError, match="--torch-compile-max-bs"):
        RuntimeConfig(torch_compile_max_bs=0)
    with pytest.raises(ValueError, match="--num-threads"):
        RuntimeConfig(num_threads=0)


def test_engine_threads_follow_the_flag_or_the_physical_cores() -> None:
    before = torch.get_num_threads()
    try:
        assert configure_engine_threads(1) == 1 and torch.get_num_threads() == 1
        chosen = configure_engine_threads(None)
        assert chosen == default_num_threads() == torch.get_num_threads()
        assert 1 <= chosen <= available_cpus()
    finally:
        torch.set_num_threads(before)


def _greedy(path: Path, compile_decode: bool, prompts: list[list[int]]) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="float32"),
        cache=CacheConfig(max_total_tokens=2048, page_size=8),
        scheduler=SchedulerConfig(max_prefill_tokens=2048),
        runtime=RuntimeConfig(enable_torch_compile=compile_decode, torch_compile_max_bs=4)))
    if compile_decode:
        assert all(isinstance(layer.forward, DecodeDispatch)
                   for layer in engine.runner.model.model.layers)  # type: ignore[attr-defined]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for index, prompt in enumerate(prompts):
        assert engine.add_request(f"r{index}", prompt, params) is None
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for output in engine.step():
            outputs.setdefault(output.request_id, []).extend(output.new_token_ids)
    return [outputs[f"r{index}"] for index in range(len(prompts))]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_compiled_decode_greedy_equals_eager(tmp_path: Path, arch: str) -> None:
    """Three prompts decode through the batch-size-dynamic graph (3 <= max-bs 4), one alone
    through the batch-1 graph; prefill stays eager. Tokens must equal eager mode's exactly."""
    from torch._dynamo.utils import counters

    path = make_tiny_model_dir(tmp_path, arch)
    rng = random.Random(7)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randrange(3, 20))] for _ in range(4)]
    eager = _greedy(path, False, prompts[:3]) + _greedy(path, False, prompts[3:])
    counters.clear()
    compiled = _greedy(path, True, prompts[:3]) + _greedy(path, True, prompts[3:])
    assert counters["stats"]["unique_graphs"] > 0, "no graph was compiled"
    assert compiled == eager


def test_compiled_bf16_norm_and_mlp_round_where_eager_rounds() -> None:
    """The second half of a Llama layer in bf16: ``add_norm``, the gated MLP and the residual add.
    Inductor's defaults fuse the norm's bf16 roundings away and fold the residual add into the
    down projection's GEMM (about a quarter of the outputs one bf16 step off); INDUCTOR_OPTIONS
    must give eager's bits."""
    torch.manual_seed(0)
    norm = RMSNorm(64, 1e-6, dtype=torch.bfloat16)
    mlp = GatedMLP(64, 128, "silu", dtype=torch.bfloat16, parallel=ParallelContext.single())
    with torch.no_grad():
        for param in [norm.weight, *mlp.parameters()]:
            param.normal_(1.0 if param is norm.weight else 0.0, 0.2)

    def second_half(attn_out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        normed, total = norm.add_norm(attn_out, residual)
        return total + mlp(normed)

    attn_out, residual = (torch.randn(3, 64) * 4).bfloat16(), (torch.randn(3, 64) * 4).bfloat16()
    torch._dynamo.reset()
    with torch.inference_mode():
        compiled = torch.compile(second_half, dynamic=True, options=INDUCTOR_OPTIONS)(attn_out, residual)
        assert torch.equal(compiled, second_half(attn_out, residual))


def test_compiled_bf16_decode_logits_equal_eager(tmp_path: Path) -> None:
    """A tiny bf16 Llama, teacher-forced over 16 decode steps of 3 sequences (the dynamic-batch
    graph) and of 1 (the batch-1 graph): every compiled step's logits equal eager's bit for bit."""
    path = make_tiny_model_dir(tmp_path, "llama")
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), skip_tokenizer_init=True, dtype="bfloat16"),
        cache=CacheConfig(max_total_tokens=2048, page_size=8),
        runtime=RuntimeConfig(enable_torch_compile=True, torch_compile_max_bs=4, num_threads=1)))
    runner = engine.runner
    dispatches = [layer.forward for layer in runner.model.model.layers]  # type: ignore[attr-defined]
    assert all(isinstance(dispatch, DecodeDispatch) for dispatch in dispatches)
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 300) for _ in range(rng.randrange(4, 20))] for _ in range(3)]
    first_block = [1]  # block 0 holds warm_up's dummy tokens

    @torch.inference_mode()
    def decode(batch: list[list[int]], max_bs: int, forced: list[list[int]] | None) -> tuple[
            list[list[int]], list[torch.Tensor]]:
        for dispatch in dispatches:
            dispatch.max_bs = max_bs   # 0: every step eager
        blocks = [list(range(first_block[0] + 5 * i, first_block[0] + 5 * i + 5)) for i in range(len(batch))]
        first_block[0] += 5 * len(batch)
        logits = runner.execute(BatchPlan([SequencePlan(p, 0, b) for p, b in zip(batch, blocks)]))
        tokens, steps = [[int(row.argmax())] for row in logits], [logits]
        for step in range(16):
            fed = [(forced or tokens)[i][step] for i in range(len(batch))]
            logits = runner.execute(BatchPlan([SequencePlan([token], len(p) + step, b)
                                               for token, p, b in zip(fed, batch, blocks)]))
            steps.append(logits)
            for row, out in zip(logits, tokens):
                out.append(int(row.argmax()))
        return tokens, steps

    for batch in (prompts, prompts[:1]):
        eager_tokens, eager_logits = decode(batch, 0, None)
        _, compiled_logits = decode(batch, 4, eager_tokens)
        assert all(torch.equal(c, e) for c, e in zip(compiled_logits, eager_logits))


def test_front_end_keeps_one_thread_and_respects_user_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAYON_NUM_THREADS", raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "true")
    before = torch.get_num_threads()
    try:
        configure_front_end_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert os.environ["RAYON_NUM_THREADS"] == "1"
    assert os.environ["TOKENIZERS_PARALLELISM"] == "true"   # the user's choice is kept


def test_omp_wait_policy_is_exported_for_child_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(OMP_WAIT_POLICY, raising=False)
    assert export_openmp_wait_policy("default") is None
    assert OMP_WAIT_POLICY not in os.environ
    assert export_openmp_wait_policy("passive") == "PASSIVE"
    assert os.environ[OMP_WAIT_POLICY] == "PASSIVE"
    monkeypatch.setenv(OMP_WAIT_POLICY, "active")           # the user's export wins
    assert export_openmp_wait_policy("passive") == "active"
    with pytest.raises(ValueError, match="--omp-wait-policy"):
        RuntimeConfig(omp_wait_policy="spin")


def test_thread_governor_targets() -> None:
    governor = ThreadGovernor(4, cpus=[0, 1, 2, 3])
    governor.physical_cores = 4
    assert [governor.target(others) for others in (0.0, 0.3, 0.5, 1.2, 1.7, 3.5, 9.0)] == [4, 4, 3, 3, 2, 1, 1]
    governor.max_threads = 2                      # never above --num-threads
    assert governor.target(0.0) == 2


def spin(cpu: int) -> None:
    os.sched_setaffinity(0, {cpu})
    while True:
        pass


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or ThreadGovernor(2).physical_cores < 2,
                    reason="needs two physical cores")
def test_thread_governor_yields_a_core_to_a_busy_process_and_takes_it_back() -> None:
    """A real busy loop on one of the engine's cores: the governor drops to one thread, and goes
    back to two once the loop ends (two agreeing readings each way)."""
    import multiprocessing
    import time

    before = torch.get_num_threads()
    governor = ThreadGovernor(2, interval_s=0.3)
    competitor = multiprocessing.get_context("spawn").Process(target=spin, args=(max(governor.cpus),), daemon=True)
    competitor.start()
    try:
        deadline = time.monotonic() + 20
        while governor.current == 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            governor.step()
        assert governor.current == 1 and torch.get_num_threads() == 1
    finally:
        competitor.kill()
        competitor.join()
    try:
        deadline = time.monotonic() + 20
        while governor.current == 1 and time.monotonic() < deadline:
            time.sleep(0.1)
            governor.step()
        assert governor.current == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
