"""Engine step overhead without a model: a runner returning constant logits (vocab 1,024), so the
time is the scheduler, KV manager, stages, executor (sampler), update and outputs. Prints the
median decode step (us) at 1 and 32 streams. Compare two commits by running it from each tree
alternately (``PYTHONPATH=<tree> python benchmarks/engine_step_overhead.py``)."""
import statistics
import time

import torch

from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.unit.engine.fake_runner import FakeRunner


class ConstantRunner(FakeRunner):
    def execute(self, plan):
        rows = sum(seq.num_logits for seq in plan.sequences)
        logits = torch.zeros(rows, self.vocab_size)
        logits[:, 7] = 1.0
        return logits


def median_step_us(streams: int, steps: int = 200) -> float:
    runner = ConstantRunner(num_blocks=4096, block_size=16, vocab_size=1024)
    engine = LLMEngine(EngineConfig(), runner=runner, eos_token_ids=[], context_length=4096)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    for index in range(streams):
        assert engine.add_request(str(index), [100 + index] * 32, params) is None
    for _ in range(3):  # prefill and warm-up steps
        engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return 1e6 * statistics.median(times)


torch.set_num_threads(1)
print(" ".join(f"{streams}:{median_step_us(streams):.1f}" for streams in (1, 32)))
