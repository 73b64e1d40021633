"""Collect real LM-head input hidden states of qwen2.5-coder-0.5b (greedy) and dump the Q8_0 head."""
import sys, torch
import os
DIR = os.environ.get("SCREEN_SIM_DIR", "/tmp/screen_sim")
from servelm.config import EngineConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from servelm.bench_common import random_prompts

REAL = [
    "def fibonacci(n):", "The capital of France is", "Once upon a time, in a land far away,",
    "import numpy as np\n\nx = np.", "Explain the theory of relativity in simple terms.",
    "SELECT name, email FROM users WHERE", "The three primary colors are",
    "class Stack:\n    def __init__(self):",
    "// Quicksort in C\nvoid quicksort(int *a, int n) {", "Write a haiku about autumn leaves.",
    "#!/bin/bash\n# back up the home directory\n", "The French Revolution began in 1789 when",
    "fn main() {\n    let v: Vec<i32> =", "Q: What is 17 * 23?\nA:",
    "<html>\n<head>\n<title>", "In machine learning, gradient descent is",
]
engine = LLMEngine(EngineConfig.from_flat({"model": "qwen2.5-coder-0.5b", "quantization": "auto",
                                           "num_threads": 2, "disable_lm_head_screen": True}))
model = engine.runner.model
head = model.lm_head
w = head.gguf_weight
print("head", w.kind if hasattr(w, "kind") else "", tuple(w.codes.shape), w.scales.dtype, tuple(w.scales.shape))
captured = []
cl = model.compute_logits
model.compute_logits = lambda hidden, *rest: (captured.append(hidden.detach().float().clone()), cl(hidden, *rest))[1]
tok = engine.tokenizer
prompts = [tok.encode(p) for p in REAL] + random_prompts(10, 24, 150000, seed=7)
for i, p in enumerate(prompts):
    engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=int(sys.argv[1]), ignore_eos=True))
while engine.has_unfinished():
    engine.step()
h = torch.cat(captured)
print("hidden", tuple(h.shape))
torch.save({"hidden": h, "codes": w.codes.clone(), "scales": w.scales.clone()}, DIR + "/data.pt")
engine.shutdown()
