"""--debug-tensor-dump-output-folder on a tiny Llama in float32: every forward pass is one file
whose tensors are the pass's own (its logits are the runner's, the final norm's rows give them
through the LM head, and the decoder layers chain: each layer's output is in the next one's
residual stream)."""

from __future__ import annotations

from pathlib import Path

import torch

from servelm.config import CacheConfig, EngineConfig, ModelConfig, ObservabilityConfig, RuntimeConfig
from servelm.engine.engine import LLMEngine
from servelm.sampling.params import SamplingParams
from tests.tiny_models import make_tiny_model_dir

PROMPT = [11, 22, 33, 44, 55]


def test_each_forward_pass_is_dumped(tmp_path: Path) -> None:
    model_dir = make_tiny_model_dir(tmp_path / "model", "llama")
    folder = tmp_path / "dump"
    config = EngineConfig(model=ModelConfig(model=str(model_dir), skip_tokenizer_init=True, dtype="float32"),
                          cache=CacheConfig(max_total_tokens=256, page_size=16),
                          runtime=RuntimeConfig(num_threads=1),
                          observability=ObservabilityConfig(debug_tensor_dump_output_folder=str(folder)))
    engine = LLMEngine(config)
    try:
        runner = engine.runner
        passes_before = runner.tensor_dumper.num_passes  # start-up passes (if any) are dumped too
        assert engine.add_request("r", PROMPT, SamplingParams(temperature=0.0, max_tokens=3,
                                                              ignore_eos=True)) is None
        tokens: list[int] = []
        while engine.has_unfinished():
            for output in engine.step():
                tokens += output.new_token_ids
        files = sorted((folder / "rank0").glob("pass*.pt"))[passes_before:]
        assert len(files) == 3  # one prefill, two decodes
        prefill, *decodes = [torch.load(path) for path in files]
        assert prefill["input_ids"].tolist() == PROMPT
        assert [d["input_ids"].tolist() for d in decodes] == [[tokens[0]], [tokens[1]]]
        assert prefill["positions"].tolist() == list(range(len(PROMPT)))
        num_layers = runner.hf_config.num_hidden_layers
        for dump in (prefill, *decodes):
            layers = [f"model.layers.{i}" for i in range(num_layers)]
            assert all(name in dump for name in layers)
            assert all(f"{name}.self_attn" in dump and f"{name}.mlp" in dump for name in layers)
            # Greedy: each pass's logits pick the next token.
            rows = dump["input_ids"].shape[0]
            assert dump[f"model.layers.{num_layers - 1}"].shape == (rows, runner.hidden_size)
        assert [int(d["logits"][-1].argmax()) for d in (prefill, *decodes)] == tokens
        # The final norm's last row through the LM head gives the dumped logits.
        head = runner.model.compute_logits(prefill["model.norm"][-1:], None).float()
        torch.testing.assert_close(head, prefill["logits"][-1:])
        # Layer 0 adds its attention and MLP outputs to the embedding (pre-norm residual stream).
        layer0 = prefill["model.embed_tokens"] + prefill["model.layers.0.self_attn"] + \
            prefill["model.layers.0.mlp"]
        torch.testing.assert_close(layer0, prefill["model.layers.0"])
    finally:
        engine.shutdown()
