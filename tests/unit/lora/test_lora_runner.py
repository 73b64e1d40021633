"""Our runner with adapters installed: greedy tokens of base + adapters in one batch equal peft's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from servelm.lora.adapter import FUSED_TARGETS, BaseShapes, load_adapter
from servelm.model.forward_batch import BatchPlan
from tests.engine_drive import drain
from tests.tiny_models import make_tiny_config, make_tiny_hf_model
from tests.unit.model.conftest import BlockAllocator, make_runner, make_source

peft = pytest.importorskip("peft")

ADAPTERS = {
    1: dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    2: dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    3: dict(r=2, lora_alpha=3, target_modules=["v_proj", "up_proj"], layers_to_transform=[1]),
}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_mixed_batch_greedy_equals_peft(tmp_path: Path, arch: str) -> None:
    runner = make_runner(make_source(make_tiny_hf_model(arch)))
    shapes = BaseShapes.from_hf_config(make_tiny_config(arch))
    references = {0: make_tiny_hf_model(arch)}
    for slot, kwargs in ADAPTERS.items():
        torch.manual_seed(slot)
        model = peft.get_peft_model(make_tiny_hf_model(arch), peft.LoraConfig(init_lora_weights=False, **kwargs))
        model.save_pretrained(tmp_path / str(slot))
        references[slot] = model.eval()
        adapter = load_adapter(str(slot), tmp_path / str(slot), shapes, max_rank=8)
        runner.set_lora(slot, [(layer, *FUSED_TARGETS[module], w.a, w.b, w.scale)
                               for (layer, module), w in adapter.weights.items()])
    prompt, steps = [5, 17, 42, 99, 3, 250, 7], 6
    expected = {}
    for slot, model in references.items():
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected[slot] = out[0, len(prompt):].tolist()
    assert len({tuple(tokens) for tokens in expected.values()}) == 4  # every adapter changes the output

    def greedy(slots: list[int]) -> dict[int, list[int]]:
        blocks = BlockAllocator(runner.num_blocks, seed=len(slots))
        tokens: dict[int, list[int]] = {slot: [] for slot in slots}
        for step in range(steps):
            plans = []
            for slot in slots:
                plan = blocks.plan(slot, prompt if step == 0 else tokens[slot][-1:], 1)
                plan.lora_slot = slot
                plans.append(plan)
            logits = runner.execute(BatchPlan(plans))
            for slot, row in zip(slots, logits.argmax(-1).tolist()):
                tokens[slot].append(row)
        return tokens

    together = greedy([2, 0, 3, 1])
    for slot in ADAPTERS.keys() | {0}:
        assert together[slot] == expected[slot], slot
        assert greedy([slot])[slot] == expected[slot], slot
    runner.remove_lora(1)
    assert greedy([1])[1] == expected[0]  # a removed slot falls back to the base weights


def test_engine_mixed_adapters_equal_peft_and_no_cross_adapter_prefix(tmp_path: Path) -> None:
    from servelm.config import CacheConfig, EngineConfig, ModelConfig
    from servelm.engine.engine import LLMEngine
    from servelm.sampling.params import SamplingParams

    arch = "llama"
    config = EngineConfig(model=ModelConfig(model="tiny", device="cpu", dtype="float32"),
                          cache=CacheConfig(page_size=4, max_total_tokens=1024))
    from servelm.model.runner import ModelRunner
    runner = ModelRunner(config, make_source(make_tiny_hf_model(arch)))
    shapes = BaseShapes.from_hf_config(make_tiny_config(arch))
    expected = {}
    prompt = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10]
    for slot in (0, 1, 2):
        model = make_tiny_hf_model(arch)
        if slot:
            torch.manual_seed(slot)
            model = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **ADAPTERS[slot])).eval()
            model.save_pretrained(tmp_path / str(slot))
            adapter = load_adapter(str(slot), tmp_path / str(slot), shapes, max_rank=8)
            runner.set_lora(slot, [(layer, *FUSED_TARGETS[module], w.a, w.b, w.scale)
                                   for (layer, module), w in adapter.weights.items()])
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=5, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
        expected[slot] = out[0, len(prompt):].tolist()
    from servelm.engine.frontdoor import SubmitRequest
    from servelm.engine.request import LoRAState, Request
    from servelm.engine.stage import Refusal, Stage

    class SlotsByRequestId(Stage):
        """The runner's slots given directly (request "<round>-<slot>"), as the LoRA stage would."""

        def check(self, request: Request, submission: SubmitRequest) -> Refusal | None:
            slot = int(request.request_id.rsplit("-", 1)[1])
            request.lora = LoRAState(str(slot), slot) if slot else None
            return None

    engine = LLMEngine(config, runner=runner, eos_token_ids=[], context_length=128,
                       extra_stages=[lambda engine: SlotsByRequestId()])
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for round_ in range(2):  # the second round may hit the prefix cache, per adapter only
        for slot in (0, 1, 2):
            engine.add_request(f"{round_}-{slot}", prompt, params)
        outputs = drain(engine)
        for slot in (0, 1, 2):
            assert outputs[f"{round_}-{slot}"] == expected[slot], (round_, slot)
