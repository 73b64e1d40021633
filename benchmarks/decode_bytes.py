"""Bytes one 1-row decode step reads from a GGUF model's weights, per linear kind, against the file.

Loads the engine (``--model``, default the packaged Qwen2.5-Coder 0.5B) and sums, for every GGUF block
linear, what its prepared 1-row call reads: the codes (packed at their bit width, or int8), the scales
and the offsets in the layout the call takes (float32, or the AVX2 build's compact fp16 / int8
sub-scales), and for the LM head what a greedy row reads (the screen's 5-bit copy and tiled scales,
lm_head_screen.py, plus its candidates' exact rows, ignored) or else the full head. The file's bytes
are what llama.cpp reads for the same tensors (its blocks as stored). The float32 column is the layout
before the compact one.

    .venv/bin/python benchmarks/decode_bytes.py [--model qwen2.5-coder-0.5b]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.model.gguf.gguf_linear import GGUFBlockLinearMethod  # noqa: E402

MIB = 2 ** 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig.from_flat({"model": args.model, "num_threads": 1, "max_total_tokens": 1024,
                                               "skip_tokenizer_init": True}))
    model = engine.runner.model
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0, 0.0, 0.0])  # codes, f32 s+o, compact s+o, weights
    for name, module in model.named_modules():
        if not isinstance(getattr(module, "linear_method", None), GGUFBlockLinearMethod):
            continue
        weight = module.gguf_weight
        leaf = name.rsplit(".", 1)[-1]
        key = f"{leaf} {weight.kind}"
        call = module.__dict__.get("gguf_decode_args")
        screen = engine.runner.lm_head_screen if leaf == "lm_head" else None
        if screen is not None:
            key += " (greedy screen)"
            codes_bytes = screen.packed.nbytes
            float_bytes = compact_bytes = screen.tiled_scales.nbytes
        else:
            codes_bytes = (call[1].nbytes if call else
                           weight.packed.data.nbytes if weight.packed is not None else weight.shape[0] * weight.shape[1])
            float_bytes = weight.scales.nbytes + (weight.offsets.nbytes if weight.offsets is not None else 0)
            scales, offsets = call[2:4] if call else (weight.scales, weight.offsets)
            compact_bytes = scales.nbytes + (offsets.nbytes if offsets is not None else 0)
        row = rows[key]
        for index, value in enumerate((codes_bytes, float_bytes, compact_bytes, weight.shape[0] * weight.shape[1], 1)):
            row[index] += value
    print(f"# {args.model}: bytes one decode step reads per linear kind (MiB; per weight in brackets)")
    print("| linear | count | weights (M) | codes | scales+offsets float32 | scales+offsets as called | total as called |")
    print("|---|---|---|---|---|---|---|")
    totals = [0.0, 0.0, 0.0]
    for key, (codes, f32, compact, weights, count) in sorted(rows.items()):
        print(f"| {key} | {count:.0f} | {weights / 1e6:.1f} | {codes / MIB:.1f} ({codes / weights:.3f}) | "
              f"{f32 / MIB:.1f} ({f32 / weights:.3f}) | {compact / MIB:.1f} ({compact / weights:.3f}) | "
              f"{(codes + compact) / MIB:.1f} ({(codes + compact) / weights:.3f}) |")
        totals[0] += codes
        totals[1] += f32
        totals[2] += compact
    print(f"| all | | | {totals[0] / MIB:.1f} | {totals[1] / MIB:.1f} | {totals[2] / MIB:.1f} | "
          f"{(totals[0] + totals[2]) / MIB:.1f} (float32 scales: {(totals[0] + totals[1]) / MIB:.1f}) |")
    file_bytes = _file_bytes(args.model)
    if file_bytes:
        print(f"file: {file_bytes[0] / MIB:.1f} MiB, of which the token embedding {file_bytes[1] / MIB:.1f} MiB "
              f"(a decode step reads one row of it): llama.cpp reads ~{(file_bytes[0] - file_bytes[1]) / MIB:.1f} "
              "MiB per step")
    engine.shutdown()


def _file_bytes(model: str) -> tuple[int, int] | None:
    """(file size, token embedding bytes) of the GGUF behind ``model`` (a path or a packaged name)."""
    import os

    import gguf
    path = Path(model)
    if not path.exists():
        from servelm.model.packaged import packaged_model_path
        try:
            path = Path(packaged_model_path(model))
        except Exception:   # not a packaged name: no file to compare with
            return None
    reader = gguf.GGUFReader(str(path))
    embedding = sum(int(t.n_bytes) for t in reader.tensors if t.name == "token_embd.weight")
    return os.path.getsize(path), embedding


if __name__ == "__main__":
    main()
