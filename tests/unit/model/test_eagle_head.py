"""EAGLE heads at the model level: the features ``HiddenCapture`` takes are the ones transformers
reports (the last hidden state for EAGLE, the inputs of the chosen layers for EAGLE-3), and the
head's forward over its paged KV equals a plain-torch reference of the published EAGLE / EAGLE-3
computation, in one pass or split in two."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from servelm.model.eagle import EagleHeadRunner, HiddenCapture, eagle3_layer_ids, read_head_config
from servelm.model.forward_batch import BatchPlan, SequencePlan
from servelm.model.eagle_checkpoint import random_head_tensors, head_config, save_head
from tests.tiny_models import make_tiny_hf_model
from tests.unit.model.conftest import make_runner, make_source

PROMPT = [5, 17, 3, 99, 42, 7, 250, 31, 8, 64, 12]


def test_default_layer_ids() -> None:
    assert eagle3_layer_ids(28) == [2, 14, 25]
    assert eagle3_layer_ids(2) == [2, 1, 0]   # kept within 0..L (L: the final pre-norm output)
    config = SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 9, 20]})
    assert eagle3_layer_ids(28, config) == [2, 10, 21]


@pytest.mark.parametrize("arch, layer_ids", [("gemma3", [2, 2, 1]), ("llama", [1, 0]), ("qwen2", None)])
def test_capture_matches_transformers_hidden_states(arch, layer_ids) -> None:
    hf_model = make_tiny_hf_model(arch)
    runner = make_runner(make_source(hf_model))
    capture = HiddenCapture(runner.model, layer_ids)
    runner.execute(BatchPlan([SequencePlan(PROMPT, 0, list(range(3)), num_logits=1)]))
    captured = capture.take()
    assert captured is not None and capture.take() is None
    with torch.no_grad():
        states = hf_model(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    expected = (states[-1][0] if layer_ids is None
                else torch.cat([states[i][0] for i in layer_ids], dim=-1))
    assert captured.shape == expected.shape
    torch.testing.assert_close(captured, expected, atol=2e-5, rtol=1e-4)
    capture.remove()
    runner.execute(BatchPlan([SequencePlan(PROMPT, 0, list(range(3)), num_logits=1)]))
    assert capture.take() is None   # removed hooks capture nothing


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _reference(tensors: dict[str, torch.Tensor], config, prefix: str, x_attn: torch.Tensor,
               residual: torch.Tensor) -> torch.Tensor:
    """One Llama layer over a whole sequence: ``residual + attn(x_attn)``, then the MLP."""
    t, heads = x_attn.shape[0], config.num_attention_heads
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    q = (x_attn @ tensors[f"{prefix}.self_attn.q_proj.weight"].T).view(t, heads, head_dim).transpose(0, 1)
    k = (x_attn @ tensors[f"{prefix}.self_attn.k_proj.weight"].T).view(t, kv_heads, head_dim).transpose(0, 1)
    v = (x_attn @ tensors[f"{prefix}.self_attn.v_proj.weight"].T).view(t, kv_heads, head_dim).transpose(0, 1)
    cos, sin = LlamaRotaryEmbedding(config)(v, torch.arange(t)[None])
    q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
    k = k[0].repeat_interleave(heads // kv_heads, 0)
    v = v.repeat_interleave(heads // kv_heads, 0)
    scores = (q[0] @ k.transpose(1, 2)) * head_dim ** -0.5
    scores = scores.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    attended = (torch.softmax(scores, -1) @ v).transpose(0, 1).reshape(t, heads * head_dim)
    hidden = residual + attended @ tensors[f"{prefix}.self_attn.o_proj.weight"].T
    x = _rms(hidden, tensors[f"{prefix}.post_attention_layernorm.weight"], config.rms_norm_eps)
    gate = x @ tensors[f"{prefix}.mlp.gate_proj.weight"].T
    up = x @ tensors[f"{prefix}.mlp.up_proj.weight"].T
    return hidden + (torch.nn.functional.silu(gate) * up) @ tensors[f"{prefix}.mlp.down_proj.weight"].T


@pytest.mark.parametrize("algorithm", ["EAGLE", "EAGLE3"])
def test_head_forward_matches_a_reference(tmp_path, algorithm) -> None:
    hf_model = make_tiny_hf_model("qwen2")
    runner = make_runner(make_source(hf_model))
    config_dict = head_config(hf_model.config, algorithm, draft_vocab_size=100, num_layers=2)
    tensors = random_head_tensors(config_dict, seed=1, std=0.2)
    path = save_head(tmp_path / algorithm, config_dict, tensors)
    head = EagleHeadRunner(str(path), algorithm, hf_model.config, block_size=4)
    head.init_kv_cache(8)
    head.attach(runner.model, runner.attention, torch.device("cpu"), torch.float32, torch.float32)
    config = read_head_config(str(path))
    hidden = config.hidden_size
    tokens = PROMPT[1:] + [77]
    width = 3 * hidden if algorithm == "EAGLE3" else hidden
    features = torch.randn(len(tokens), width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        embeds = hf_model.model.embed_tokens(torch.tensor(tokens))
        if algorithm == "EAGLE3":
            h = features @ tensors["fc.weight"].T
            x = torch.cat([_rms(embeds, tensors["midlayer.input_layernorm.weight"], config.rms_norm_eps),
                           _rms(h, tensors["midlayer.hidden_norm.weight"], config.rms_norm_eps)], -1)
            out = _reference(tensors, config, "midlayer", x, h)
            last = _rms(out, tensors["norm.weight"], config.rms_norm_eps)[-1]
            expected = last @ tensors["lm_head.weight"].T
        else:
            h = torch.cat([embeds, features], -1) @ tensors["fc.weight"].T
            h = _reference(tensors, config, "layers.0", h, h)
            x = _rms(h, tensors["layers.1.input_layernorm.weight"], config.rms_norm_eps)
            out = _reference(tensors, config, "layers.1", x, h)
            expected = hf_model.lm_head(out[-1])
    blocks = list(range(3))
    logits, feature = head.forward([SequencePlan(tokens, 0, blocks)], features, True)
    torch.testing.assert_close(logits[0], expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(feature[0], out[-1], atol=1e-4, rtol=1e-4)
    # The same through the paged KV: the first 8 entries, then the last 3.
    head.forward([SequencePlan(tokens[:8], 0, blocks)], features[:8], True)
    split, _ = head.forward([SequencePlan(tokens[8:], 8, blocks)], features[8:], True)
    torch.testing.assert_close(split[0], expected, atol=1e-4, rtol=1e-4)
    if algorithm == "EAGLE3":
        ids = head.draft_to_target
        assert ids is not None and ids.shape == (100,) and int(ids.max()) < 320
