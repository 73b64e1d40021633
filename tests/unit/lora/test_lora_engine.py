"""LoRA through the engine's adapter registry with the features it must work with: chunked
prefill and preemption (greedy tokens still equal peft's), quantized base weights (the same delta
on top), and the contiguous-span path of the linear layers (equal to the gathered-rows path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servelm.config import CacheConfig, EngineConfig, LoRAConfig, ModelConfig, SchedulerConfig
from servelm.engine.engine import LLMEngine
from servelm.model.layers.linear import LoRAGroup
from servelm.model.runner import ModelRunner
from servelm.sampling.params import SamplingParams
from tests.engine_drive import drain
from tests.tiny_models import make_tiny_hf_model
from tests.unit.model.conftest import make_source

peft = pytest.importorskip("peft")

ADAPTERS = {
    "attn": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "mix": dict(r=2, lora_alpha=3, target_modules=["v_proj", "up_proj"], layers_to_transform=[1]),
}
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [30, 31, 32, 33, 34, 35, 36, 37, 38]]
NUM_NEW = 8


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str | None, list[list[int]]]]:
    root = tmp_path_factory.mktemp("adapters")
    expected: dict[str | None, list[list[int]]] = {}
    for seed, (name, kwargs) in enumerate([(None, None), *ADAPTERS.items()]):
        model = make_tiny_hf_model("llama")
        if name is not None:
            torch.manual_seed(seed)
            model = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **kwargs)).eval()
            model.save_pretrained(root / name)
        expected[name] = []
        for prompt in PROMPTS:
            with torch.no_grad():
                out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NUM_NEW,
                                     do_sample=False, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            expected[name].append(out[0, len(prompt):].tolist())
    return root, expected


def make_engine(root: Path, max_total_tokens: int, lora: dict[str, object] | None = None,
                **scheduler: object) -> LLMEngine:
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype="float32"),
                          cache=CacheConfig(page_size=4, max_total_tokens=max_total_tokens),
                          scheduler=SchedulerConfig(**scheduler),  # type: ignore[arg-type]
                          lora=LoRAConfig(lora_paths=[f"{name}={root / name}" for name in ADAPTERS],
                                          **(lora or {})))  # type: ignore[arg-type]
    runner = ModelRunner(config, make_source(make_tiny_hf_model("llama")))
    return LLMEngine(config, runner=runner, eos_token_ids=[], context_length=128)


def test_chunked_prefill_and_preemption_equal_peft(
        adapters: tuple[Path, dict[str | None, list[list[int]]]]) -> None:
    root, expected = adapters
    engine = make_engine(root, max_total_tokens=40, chunked_prefill_size=4)  # 10 blocks of 4
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    for name in [None, *ADAPTERS]:
        for index, prompt in enumerate(PROMPTS):
            assert engine.add_request(f"{name}-{index}", prompt, params, lora_name=name) is None
    outputs = drain(engine)
    assert engine.scheduler.num_preemptions > 0  # six requests of 5 blocks each in a 10-block pool
    for name in [None, *ADAPTERS]:
        for index in range(len(PROMPTS)):
            assert outputs[f"{name}-{index}"] == expected[name][index], (name, index)
    refused = engine.add_request("x", PROMPTS[0], params, lora_name="nope")
    assert refused is not None and refused.error_status == 404 and "is not loaded" in str(refused.error)


def test_more_adapters_than_memory_holds_equal_peft(
        adapters: tuple[Path, dict[str | None, list[list[int]]]]) -> None:
    """Three adapters, two held in memory and two per batch, all requested at once: requests for
    the third wait, adapters are dropped and read back from disk at admission, and every request
    still gets peft's tokens."""
    root, expected = adapters
    engine = make_engine(root, max_total_tokens=512, lora=dict(max_loras_per_batch=2, max_loaded_loras=2))
    assert engine.lora is not None and len(engine.lora.installed) == 2  # the third is on disk
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    names = [*ADAPTERS, None, *reversed(ADAPTERS)]
    for index, name in enumerate(names):
        assert engine.add_request(f"{index}", PROMPTS[index % 2], params, lora_name=name) is None
    outputs = drain(engine)
    for index, name in enumerate(names):
        assert outputs[f"{index}"] == expected[name][index % 2], (index, name)
    assert engine.lora.num_loads == 3 and len(engine.lora.installed) == 2
    assert engine.lora.num_installs > 3  # some adapter was dropped and read back from disk


@pytest.mark.parametrize("quantization", ["int8wo", "w8a8_int8"])
def test_quantized_base_gets_the_same_delta(
        adapters: tuple[Path, dict[str | None, list[list[int]]]], quantization: str) -> None:
    """On a quantized base, an adapter's rows get exactly the float delta on top of the quantized
    output (the LinearMethod computes the base, the LoRA hook adds to it)."""
    root, _ = adapters
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype="float32",
                                            quantization=quantization),
                          cache=CacheConfig(page_size=4, max_total_tokens=256),
                          lora=LoRAConfig(lora_paths=[f"attn={root / 'attn'}"]))
    runner = ModelRunner(config, make_source(make_tiny_hf_model("llama")))
    engine = LLMEngine(config, runner=runner, eos_token_ids=[], context_length=128)
    assert engine.lora is not None
    slot = engine.lora.registered["attn"].slot
    layer = runner._lora_layers()[(0, "qkv_proj")]
    x = torch.randn(5, 64)
    group = [LoRAGroup(slot, torch.tensor([1, 3]))]
    with torch.inference_mode():
        base, with_lora = layer(x), layer(x.clone(), group)
    a_t, b_t = layer.lora_fused[slot]
    torch.testing.assert_close(with_lora[[1, 3]] - base[[1, 3]], (x[[1, 3]] @ a_t) @ b_t,
                               rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(with_lora[[0, 2, 4]], base[[0, 2, 4]], rtol=0, atol=0)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    engine.add_request("base", PROMPTS[0], params)
    engine.add_request("attn", PROMPTS[0], params, lora_name="attn")
    outputs = drain(engine)
    assert outputs["base"] != outputs["attn"]


def test_span_path_equals_gathered_rows(adapters: tuple[Path, dict[str | None, list[list[int]]]]) -> None:
    root, _ = adapters
    engine = make_engine(root, max_total_tokens=256)
    assert engine.lora is not None
    layers = engine.runner._lora_layers()  # type: ignore[attr-defined]
    slots = [engine.lora.registered[name].slot for name in ADAPTERS]
    unequal = [LoRAGroup(slots[0], torch.arange(1, 3), (1, 3)), LoRAGroup(slots[1], torch.arange(3, 6), (3, 6))]
    equal = [LoRAGroup(slots[1], torch.arange(0, 3), (0, 3)), LoRAGroup(slots[0], torch.arange(3, 6), (3, 6))]
    with torch.inference_mode():
        for spans in (unequal, equal):  # a GEMM pair per group on views; one bmm pair for all
            gathered = [LoRAGroup(group.slot, group.rows) for group in spans]
            for key in ((0, "qkv_proj"), (1, "gate_up_proj"), (1, "down_proj"), (0, "o_proj")):
                layer = layers[key]
                inputs = torch.randn(6, layer.input_size)
                torch.testing.assert_close(layer(inputs, spans), layer(inputs, gathered),
                                           rtol=1e-5, atol=1e-5)
                assert not torch.equal(layer(inputs, gathered), layer(inputs))
        neither = [LoRAGroup(slots[0], torch.arange(0, 3), (0, 3)), LoRAGroup(slots[2], torch.arange(3, 6), (3, 6))]
        layer = layers[(0, "gate_up_proj")]  # attn and mix (layer 1 only) leave it alone
        inputs = torch.randn(6, layer.input_size)
        torch.testing.assert_close(layer(inputs, neither), layer(inputs), rtol=0, atol=0)


def test_fused_qkv_and_gate_up_targets(adapters: tuple[Path, dict[str | None, list[list[int]]]],
                                       tmp_path: Path) -> None:
    """An adapter on the fused qkv_proj / gate_up_proj (Phi-3's names): the attn and mlp adapters
    rewritten that way (A stacked, B block-diagonal, alpha scaled with the rank) give the same
    tokens as the originals; --lora-target-modules qkv_proj allows q/k/v and the fused name."""
    import json

    from safetensors.torch import load_file, save_file

    root, expected = adapters
    fused_names = {"attn": ("qkv_proj", "self_attn", ("q_proj", "k_proj", "v_proj")),
                   "mlp": ("gate_up_proj", "mlp", ("gate_proj", "up_proj"))}
    for name, (fused, block, parts) in fused_names.items():
        config = json.loads((root / name / "adapter_config.json").read_text())
        tensors = load_file(str(root / name / "adapter_model.safetensors"))
        out: dict[str, torch.Tensor] = {}
        for key, tensor in tensors.items():
            if not any(f".{part}." in key for part in parts):
                out[key] = tensor
        layers = sorted({int(k.split("layers.")[1].split(".")[0]) for k in tensors})
        for layer in layers:
            prefix = f"base_model.model.model.layers.{layer}.{block}"
            a = [tensors[f"{prefix}.{part}.lora_A.weight"] for part in parts]
            b = [tensors[f"{prefix}.{part}.lora_B.weight"] for part in parts]
            out[f"{prefix}.{fused}.lora_A.weight"] = torch.cat(a)
            out[f"{prefix}.{fused}.lora_B.weight"] = torch.block_diag(*b)
        growth = len(parts) if not config.get("use_rslora") else len(parts) ** 0.5  # same scale
        config.update(target_modules=sorted({*config["target_modules"], fused} - set(parts)),
                      rank_pattern={fused: config["r"] * len(parts)},
                      alpha_pattern={fused: config["lora_alpha"] * growth})
        (tmp_path / name).mkdir()
        save_file(out, str(tmp_path / name / "adapter_model.safetensors"))
        (tmp_path / name / "adapter_config.json").write_text(json.dumps(config))
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype="float32"),
                          cache=CacheConfig(page_size=4, max_total_tokens=512),
                          lora=LoRAConfig(lora_paths=[f"{n}={tmp_path / n}" for n in fused_names],
                                          max_lora_rank=24,
                                          lora_target_modules=["qkv_proj", "gate_up_proj", "o_proj",
                                                               "down_proj"]))
    engine = LLMEngine(config, runner=ModelRunner(config, make_source(make_tiny_hf_model("llama"))),
                       eos_token_ids=[], context_length=128)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    for name in fused_names:
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(f"{name}-{index}", prompt, params, lora_name=name)
    outputs = drain(engine)
    for name in fused_names:
        for index in range(len(PROMPTS)):
            assert outputs[f"{name}-{index}"] == expected[name][index], (name, index)


@pytest.mark.slow
def test_torch_compile_with_adapters_equals_peft(
        adapters: tuple[Path, dict[str | None, list[list[int]]]]) -> None:
    """--enable-torch-compile: base-only decode steps run the compiled layers, steps with adapter
    rows eager; every request still gets peft's tokens."""
    from servelm.config import RuntimeConfig

    root, expected = adapters
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype="float32"),
                          cache=CacheConfig(page_size=4, max_total_tokens=512),
                          runtime=RuntimeConfig(enable_torch_compile=True, torch_compile_max_bs=4),
                          lora=LoRAConfig(lora_paths=[f"attn={root / 'attn'}"]))
    runner = ModelRunner(config, make_source(make_tiny_hf_model("llama")))
    engine = LLMEngine(config, runner=runner, eos_token_ids=[], context_length=128)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    for round_, name in enumerate([None, "attn"]):  # base alone (compiled), then the adapter
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(f"{round_}-{index}", prompt, params, lora_name=name)
        outputs = drain(engine)
        for index in range(len(PROMPTS)):
            assert outputs[f"{round_}-{index}"] == expected[name][index], (name, index)
