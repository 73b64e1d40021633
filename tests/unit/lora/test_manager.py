"""The adapter registry on a real runner (tiny llama): LRU/FIFO eviction and reload from disk,
draining unloads, refusals; and --max-loras-per-batch in the scheduler."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servelm.cache.block_pool import BlockPool
from servelm.config import LoRAConfig, SchedulerConfig
from servelm.engine.lora_stage import AdapterSlots
from servelm.engine.request import LoRAState, Request
from servelm.engine.kv_manager import KVManager
from servelm.engine.scheduler import Scheduler
from servelm.lora.adapter import BaseShapes, LoRAAdapterError
from servelm.lora.manager import AdapterNotFoundError, LoRAManager
from servelm.sampling.params import SamplingParams
from tests.tiny_models import make_tiny_config, make_tiny_hf_model
from tests.unit.model.conftest import make_runner, make_source

peft = pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for seed, (name, targets) in enumerate({"a": ["q_proj"], "b": ["down_proj"], "c": ["v_proj"],
                                            "d": ["o_proj"]}.items()):
        torch.manual_seed(seed)
        model = peft.get_peft_model(make_tiny_hf_model("llama"),
                                    peft.LoraConfig(init_lora_weights=False, r=4, target_modules=targets))
        model.save_pretrained(root / name)
        dirs[name] = root / name
    return dirs


def manager(**config: object) -> LoRAManager:
    runner = make_runner(make_source(make_tiny_hf_model("llama")))
    return LoRAManager(LoRAConfig(enable_lora=True, **config),  # type: ignore[arg-type]
                       BaseShapes.from_hf_config(make_tiny_config("llama")), runner)


def installed_slots(registry: LoRAManager) -> set[int]:
    runner = registry.slots
    return {slot for layer in runner._lora_layers().values() for slot in layer.lora}  # type: ignore[attr-defined]


@pytest.mark.parametrize("policy, dropped", [("lru", "b"), ("fifo", "a")])
def test_eviction_policy_and_reload(adapter_dirs: dict[str, Path], policy: str, dropped: str) -> None:
    registry = manager(max_loras_per_batch=2, max_loaded_loras=3, lora_eviction_policy=policy)
    ids = {name: registry.load(name, str(adapter_dirs[name]), set()).adapter_id for name in "abc"}
    assert registry.acquire(ids["a"], set()) == 1  # lru: a becomes the most recently used
    registry.load("d", str(adapter_dirs["d"]), set())
    assert registry.registered[dropped].slot is None and set(registry.registered) == set("abcd")
    assert len(installed_slots(registry)) == 3
    assert registry.acquire(ids[dropped], set()) == 5  # read again from disk, into a fresh slot
    assert len(registry.installed) == 3 and registry.resolve(dropped) == ids[dropped]


def test_running_adapters_are_never_evicted(adapter_dirs: dict[str, Path]) -> None:
    registry = manager(max_loras_per_batch=2, max_loaded_loras=2)
    a = registry.load("a", str(adapter_dirs["a"]), set())
    b = registry.load("b", str(adapter_dirs["b"]), set())
    running = {a.adapter_id, b.adapter_id}
    c = registry.load("c", str(adapter_dirs["c"]), running)
    assert c.slot is None  # registered (validated), installed on its first admitted request
    assert registry.acquire(c.adapter_id, running) is None  # no room: the request waits
    assert registry.acquire(c.adapter_id, {a.adapter_id}) == 3  # b had no running request
    assert b.slot is None and a.slot == 1 and installed_slots(registry) == {1, 3}


def test_unload_lets_holders_finish(adapter_dirs: dict[str, Path]) -> None:
    registry = manager()
    old = registry.load("a", str(adapter_dirs["a"]), set())
    assert registry.unload("a", {old.adapter_id}) is True  # a request still holds it
    with pytest.raises(AdapterNotFoundError):
        registry.resolve("a")
    assert registry.acquire(old.adapter_id, set()) == old.slot  # its holder still runs with it
    new = registry.load("a", str(adapter_dirs["a"]), set())
    assert new.adapter_id != old.adapter_id  # no prefix shared with the old load
    assert registry.has_unloaded
    registry.release_unused({old.adapter_id})
    assert installed_slots(registry) == {old.slot, new.slot}
    registry.release_unused(set())
    assert installed_slots(registry) == {new.slot} and not registry.has_unloaded
    with pytest.raises(AdapterNotFoundError):
        registry.unload("zzz", set())


def test_refusals(adapter_dirs: dict[str, Path]) -> None:
    registry = manager(lora_target_modules=["q_proj", "v_proj"], max_lora_rank=4)
    registry.load("a", str(adapter_dirs["a"]), set())
    with pytest.raises(LoRAAdapterError, match="already loaded"):
        registry.load("a", str(adapter_dirs["c"]), set())
    with pytest.raises(LoRAAdapterError, match="targets down_proj, not among --lora-target-modules"):
        registry.load("b", str(adapter_dirs["b"]), set())
    assert "b" not in registry.registered and installed_slots(registry) == {1}
    with pytest.raises(LoRAAdapterError, match="exceeds --max-lora-rank 2"):
        manager(max_lora_rank=2).load("a", str(adapter_dirs["a"]), set())


def test_config_parses_both_dialects() -> None:
    config = LoRAConfig(lora_paths=["x=/p/x", "/p/y/", '{"name": "z", "path": "/p/z"}',
                                    '{"lora_name": "w", "lora_path": "/p/w"}'])
    assert config.is_enabled
    assert [(s.name, s.path) for s in config.sources] == [
        ("x", "/p/x"), ("y", "/p/y/"), ("z", "/p/z"), ("w", "/p/w")]
    with pytest.raises(ValueError, match="more than once"):
        LoRAConfig(lora_paths=["x=/a", "x=/b"])
    with pytest.raises(ValueError, match="--max-loras-per-batch has no effect without --enable-lora"):
        LoRAConfig(max_loras_per_batch=2)
    with pytest.raises(ValueError, match="--max-loaded-loras \\(1\\) must be at least"):
        LoRAConfig(enable_lora=True, max_loaded_loras=1, max_loras_per_batch=2)
    with pytest.raises(ValueError, match="lm_head"):
        LoRAConfig(enable_lora=True, lora_target_modules=["lm_head"])
    fused = LoRAConfig(enable_lora=True, lora_target_modules=["qkv_proj", "down_proj"]).target_modules
    assert fused == ("q_proj", "k_proj", "v_proj", "down_proj", "qkv_proj")
    parts = LoRAConfig(enable_lora=True, lora_target_modules=["gate_proj", "up_proj"]).target_modules
    assert parts == ("gate_proj", "up_proj", "gate_up_proj")
    from servelm.config import EngineConfig, ModelConfig, ParallelConfig, RuntimeConfig

    lora = LoRAConfig(enable_lora=True)
    EngineConfig(parallel=ParallelConfig(tensor_parallel_size=2), lora=lora)  # TP is fine
    EngineConfig(runtime=RuntimeConfig(enable_torch_compile=True), lora=lora)  # LoRA steps run eager
    with pytest.raises(ValueError, match="--task embed"):
        EngineConfig(model=ModelConfig(task="embed"), lora=lora)
    EngineConfig(parallel=ParallelConfig(data_parallel_size=2), lora=lora)  # DP is fine
    with pytest.raises(ValueError, match="--pp-size"):
        EngineConfig(parallel=ParallelConfig(pipeline_parallel_size=2), lora=lora)
    with pytest.raises(ValueError, match="must not contain ':'"):
        LoRAConfig(lora_paths=["a:b=/p"])
    with pytest.raises(ValueError, match="is the base model's name"):
        EngineConfig(model=ModelConfig(model="m"), lora=LoRAConfig(lora_paths=["m=/p"]))


def test_scheduler_defers_a_further_adapter() -> None:
    """--max-loras-per-batch 2: requests for a third adapter wait until one adapter has no running
    request; the base model does not count; the plan is grouped by slot."""
    slots = {"x": 1, "y": 2, "z": 3}

    class FixedSlots:  # the manager's part: each adapter installed in its own slot
        def acquire(self, adapter_id: str, running: set[str]) -> int:
            return slots[adapter_id]

    scheduler = Scheduler(SchedulerConfig(), KVManager(BlockPool(64), 4),
                          adapter_slot=AdapterSlots(FixedSlots(), max_adapters=2))  # type: ignore[arg-type]

    def add(name: str, adapter: str | None, slot: int, max_tokens: int) -> Request:
        request = Request(name, [1, 2, 3], SamplingParams(max_tokens=max_tokens), [0], 512,
                          lora=LoRAState(adapter, slot) if adapter is not None else None)
        scheduler.add_request(request)
        return request

    add("x1", "x", 1, 1)
    add("base", None, 0, 4)
    add("y1", "y", 2, 4)
    add("z1", "z", 3, 4)
    add("x2", "x", 1, 4)
    output = scheduler.schedule()
    admitted = [item.request.request_id for item in output.scheduled]
    assert admitted == ["base", "x1", "x2", "y1"]  # z1 waits; sorted by slot
    assert [s.lora_slot for s in output.plan.sequences] == [0, 1, 1, 2]
    x1 = scheduler.requests["x1"]
    from servelm.engine.request import FinishReason
    scheduler.finish(x1, FinishReason.LENGTH)
    assert [i.request.request_id for i in scheduler.schedule().scheduled] == ["base", "x2", "y1"]
    scheduler.finish(scheduler.requests["x2"], FinishReason.LENGTH)
    assert [i.request.request_id for i in scheduler.schedule().scheduled] == ["base", "y1", "z1"]
