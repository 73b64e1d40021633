"""EPLB on a skewed routing workload (issue 33): the busiest expert-parallel rank's share of the
expert rows, in the initial placement and in the one EPLB plans from the measured load.

Two workloads. ``zipf``: 16 experts, top-2, router logits ``N(0, 1) + log(popularity)`` with a
Zipf(1) popularity whose hot experts are scattered (a permutation), 8192 tokens in 64 passes.
``tiny-mixtral``: the tiny random-weight Mixtral (8 experts, top-2, 2 layers; tests/tiny_models.py) serves prompts
drawn from 12 token ids, so its routing concentrates on a few experts. The per_token recorder
keeps every pass's routing; EPLB's plan (``moe_parallel.rebalance``) is made from the first half
of the passes and scored on the second half (out of sample), with the same dispatch function the
EP layer uses (``ExpertPlacement.rows_per_rank``: a replicated expert's rows round robin over its
replicas). Prints one table row per (ranks, redundant slots) layout.

    PYTHONPATH=. python benchmarks/eplb_balance.py
"""

from __future__ import annotations

import random
import tempfile

import torch

from servelm.config import EngineConfig, ModelConfig, ObservabilityConfig
from servelm.engine.engine import LLMEngine
from servelm.model.layers.moe_parallel import ExpertPlacement, rebalance
from servelm.sampling.params import SamplingParams
from tests.tiny_models import make_tiny_model_dir

LAYOUTS = ((2, 0), (2, 2), (4, 0), (4, 4))
"""(expert-parallel ranks, redundant slots) of the 8-expert layers."""


def recorded_routing(num_prompts: int = 24) -> list[list[torch.Tensor]]:
    """Per pass, per MoE layer, the ``[T, 2]`` experts of a skewed workload."""
    with tempfile.TemporaryDirectory() as folder:
        model = make_tiny_model_dir(folder, "mixtral")
        engine = LLMEngine(EngineConfig(
            model=ModelConfig(model=str(model), skip_tokenizer_init=True, dtype="float32"),
            observability=ObservabilityConfig(expert_distribution_recorder_mode="per_token",
                                              expert_distribution_recorder_buffer_size=-1)))
        rng = random.Random(0)
        vocabulary = rng.sample(range(1, 300), 12)
        engine.expert_distribution("start")
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        for index in range(num_prompts):
            engine.add_request(f"r{index}", [rng.choice(vocabulary) for _ in range(rng.randrange(8, 40))], params)
            while engine.has_unfinished():
                engine.step()
        passes = engine.expert_distribution("dump")["passes"]
        engine.shutdown()
    return [[torch.tensor(layer, dtype=torch.int64).reshape(-1, 2) for layer in one_pass] for one_pass in passes]


def busiest_share(placements: list[ExpertPlacement], passes: list[list[torch.Tensor]]) -> float:
    """The busiest rank's share of all rows, summed per layer over ``passes``."""
    rows = torch.zeros(len(placements), placements[0].num_ranks, dtype=torch.int64)
    for one_pass in passes:
        for layer, (placement, ids) in enumerate(zip(placements, one_pass)):
            rows[layer] += torch.tensor(placement.rows_per_rank(ids))
    return float((rows.max(dim=1).values / rows.sum(dim=1)).mean())


def zipf_routing(num_experts: int = 16, num_passes: int = 64, tokens_per_pass: int = 128) -> list[list[torch.Tensor]]:
    """One layer's ``[T, 2]`` experts per pass, popularity Zipf(1) over a shuffled expert order."""
    generator = torch.Generator().manual_seed(0)
    rank = torch.randperm(num_experts, generator=generator) + 1
    bias = torch.log(1.0 / rank.double()).float()
    return [[torch.topk(torch.randn(tokens_per_pass, num_experts, generator=generator) + bias, 2).indices]
            for _ in range(num_passes)]


def report(name: str, passes: list[list[torch.Tensor]], num_experts: int,
           layouts: tuple[tuple[int, int], ...]) -> None:
    plan_half, score_half = passes[:len(passes) // 2], passes[len(passes) // 2:]
    num_layers = len(passes[0])
    load = torch.zeros(num_layers, num_experts)
    for one_pass in plan_half:
        for layer, ids in enumerate(one_pass):
            load[layer] += torch.bincount(ids.reshape(-1), minlength=num_experts)
    print(f"{name}: {len(passes)} passes; rows per expert (plan half, layer 0): {load[0].int().tolist()}")
    print("| workload | ranks | redundant | busiest rank's share: initial | after EPLB | even |")
    print("|---|---|---|---|---|---|")
    for ranks, redundant in layouts:
        initial = [ExpertPlacement.initial(num_experts, redundant, ranks)] * num_layers
        planned = [rebalance(layer_load.tolist(), redundant, ranks) for layer_load in load]
        print(f"| {name} | {ranks} | {redundant} | {busiest_share(initial, score_half):.3f} | "
              f"{busiest_share(planned, score_half):.3f} | {1 / ranks:.3f} |")


def main() -> None:
    report("zipf", zipf_routing(), 16, ((2, 0), (2, 2), (4, 0), (4, 4), (8, 8)))
    report("tiny-mixtral", recorded_routing(), 8, LAYOUTS)


if __name__ == "__main__":
    main()
