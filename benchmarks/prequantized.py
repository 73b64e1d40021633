"""Pre-quantized checkpoints of Qwen2.5-Coder-0.5B on this CPU: quality and speed per format (issue 34).

The float32 weights come from ``--float-dir`` (a Hugging Face directory with the tokenizer; the one
in /work/peers is the packaged Q4_K_M GGUF dequantized by transformers, saved in float32). Each
format is made here from them, by its own library where that runs on this CPU:

- compressed-tensors W4A16 (int4, group 128, asymmetric) and W8A16 (int8 per channel): the
  compressed-tensors library's scheme, min/max scales (its ``calculate_qparams``: llm-compressor's
  round-to-nearest recipe without calibration data) and compressor (tests/prequantized_checkpoints.py
  ``write_ct_with_library``; llm-compressor itself would replace transformers here);
- llm-compressor itself (``llmc-*``): its ``oneshot`` with the preset schemes W8A8 (int8 weights
  per channel, dynamic int8 activations per token), W4A16 (int4 group 128, round-to-nearest, and
  ``llmc-w4a16-gptq``: GPTQ calibrated on this repository's README and ARCHITECTURE text) and
  FP8_DYNAMIC, run by scripts/make_llmc_fixtures.py in llm-compressor's own venv
  (``$LLMC_PYTHON``, default /work/llmc-venv/bin/python: its wheel pins an older transformers);
- bitsandbytes int8 (LLM.int8) and nf4 with double quant: transformers + bitsandbytes' CPU backend;
- GPTQ int4 g128 asymmetric and AWQ int4 g128: round-to-nearest, written to their published layouts
  by tests/prequantized_checkpoints.py (GPTQModel and AutoAWQ need CUDA builds); FP8 e4m3 in
  128x128 blocks by the same writers.

Each directory is served by the engine at ``--dtype auto`` (integer codes on the GGUF block routes
where the format has them), against float32 (the reference) and the packaged GGUF on its own blocks:
perplexity of ``quant_quality.TEXT``, greedy agreement with float32 over ``quant_quality.PROMPTS``
(identical outputs, mean agreeing prefix), and 1- and 32-stream decode tok/s.

``--servers servelm,vllm`` adds, per format, the rates of each server over HTTP with one client
(benchmarks/compare_peers.py's: streamed /v1/completions, ``--output-len`` tokens, one stream of a
16-token prompt and 32 concurrent 128-token prompts): ``servelm serve DIR`` and vLLM's CPU build
(``$VLLM_VENV``, default ~/.cache/vllm-cpu-venv) serving the same directory as shipped. A server
that refuses a format gets its own error line in the cell (its log is in ``--log-dir``).

    PYTHONPATH=. python benchmarks/prequantized.py [--formats float32,gguf,gptq,...] [--num-threads 2]
        [--servers servelm,vllm]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.compare_peers import run_peer, servelm_peer, vllm_peer  # noqa: E402
from benchmarks.quant_quality import PROMPTS, TEXT, decode_tok_s, greedy, perplexity  # noqa: E402
from servelm.config import EngineConfig  # noqa: E402
from servelm.engine.engine import LLMEngine  # noqa: E402
from servelm.model.packaged import packaged_model_path  # noqa: E402
from tests.prequantized_checkpoints import (write_awq, write_bitsandbytes, write_ct_with_library,  # noqa: E402
                                            write_fp8, write_gptq)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
CT_W4A16 = {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 128}
CT_W8A16 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}

LLMC_PYTHON = os.environ.get("LLMC_PYTHON", "/work/llmc-venv/bin/python")
REPO = Path(__file__).resolve().parents[1]
CALIBRATION_TEXT = REPO / "build" / "llmc-calibration.txt"


def write_llmc(path: Path, source: Path, scheme: str, modifier: str = "rtn") -> None:
    """llm-compressor's ``oneshot`` on ``source`` (scripts/make_llmc_fixtures.py in its own venv)."""
    extra = []
    if modifier == "gptq":   # calibration text: this repository's prose (not quant_quality.TEXT)
        CALIBRATION_TEXT.parent.mkdir(exist_ok=True)
        CALIBRATION_TEXT.write_text((REPO / "README.md").read_text() + (REPO / "ARCHITECTURE.md").read_text())
        extra = ["--calibration-text", str(CALIBRATION_TEXT)]
    subprocess.run([LLMC_PYTHON, str(REPO / "scripts/make_llmc_fixtures.py"), "--model", str(source), "--scheme",
                    scheme, "--modifier", modifier, "--out", str(path), *extra], check=True)


Writer = Callable[[Path, Callable[[], Any], Path], Any]
"""(directory to write, the float32 transformers model (loaded on first call), its directory)."""
WRITERS: dict[str, tuple[str, Writer]] = {
    "llmc-w8a8": ("llm-compressor W8A8 int8 (oneshot)", lambda path, _, source: write_llmc(path, source, "W8A8")),
    "llmc-w4a16": ("llm-compressor W4A16 g128 RTN (oneshot)",
                   lambda path, _, source: write_llmc(path, source, "W4A16")),
    "llmc-w4a16-gptq": ("llm-compressor W4A16 g128 GPTQ (oneshot)",
                        lambda path, _, source: write_llmc(path, source, "W4A16", "gptq")),
    "llmc-fp8": ("llm-compressor FP8_DYNAMIC (oneshot)",
                 lambda path, _, source: write_llmc(path, source, "FP8_DYNAMIC")),
    "ct-w4a16": ("compressed-tensors W4A16 g128 asym (library)",
                 lambda path, model, _: write_ct_with_library(path, model(), CT_W4A16, "pack-quantized")),
    "ct-w8a16": ("compressed-tensors W8A16 per channel (library)",
                 lambda path, model, _: write_ct_with_library(path, model(), CT_W8A16, "int-quantized")),
    "bnb-int8": ("bitsandbytes int8 (library)", lambda path, _, source: write_bitsandbytes(path, source, "int8")),
    "bnb-nf4": ("bitsandbytes nf4 + double quant (library)",
                lambda path, _, source: write_bitsandbytes(path, source, "nf4", double_quant=True)),
    "gptq": ("GPTQ int4 g128 asym (RTN, published layout)",
             lambda path, model, _: write_gptq(path, model(), 4, 128, sym=False)),
    "awq": ("AWQ int4 g128 (RTN, published layout)", lambda path, model, _: write_awq(path, model(), 128)),
    "fp8": ("FP8 e4m3 128x128 blocks (published layout)", lambda path, model, _: write_fp8(path, model())),
}
FORMATS = ("float32", "gguf", *WRITERS)
SERVERS = ("servelm", "vllm")


def checkpoint(name: str, float_dir: Path, work_dir: Path, model: list[Any]) -> tuple[str, str]:
    """(model path, label) of format ``name``; written into ``work_dir`` once (kept for later runs).
    ``model``: the float32 transformers model, loaded on first need."""
    if name == "float32":
        return str(float_dir), "float32 (reference)"
    if name == "gguf":
        return packaged_model_path("qwen2.5-coder-0.5b"), "GGUF Q4_K_M (packaged, own blocks)"
    label, write = WRITERS[name]
    path = work_dir / name

    def float_model() -> Any:
        if not model:
            from tests.reference import load_reference_model
            model.append(load_reference_model(float_dir))
        return model[0]

    if not (path / "config.json").exists():
        shutil.rmtree(path, ignore_errors=True)
        write(path, float_model, float_dir)
        for file in TOKENIZER_FILES:
            if (float_dir / file).exists():
                shutil.copy(float_dir / file, path / file)
    return str(path), label


def engine_for(model: str, num_threads: int | None) -> LLMEngine:
    return LLMEngine(EngineConfig.from_flat({"model": model, "max_total_tokens": 8192, "disable_radix_cache": True,
                                             "num_threads": num_threads}))


def server_rates(server: str, name: str, path: str, args: argparse.Namespace) -> str:
    """``server``'s 1- and 32-stream tok/s on the checkpoint at ``path`` ("a / b"), or why it has none
    (the server's own last error line where it refused the checkpoint)."""
    if server == "vllm":
        if not Path(path).is_dir():
            return "n/a (a GGUF file: vLLM serves Hugging Face directories here)"
        venv = Path(os.environ.get("VLLM_VENV", "~/.cache/vllm-cpu-venv")).expanduser()
        peer = vllm_peer(venv, Path(path), name, args.port, args.num_threads or 2, args.startup_s)
    else:
        peer = servelm_peer(str(path), args.port, args.num_threads or 2, ["--served-model-name", name])
    args.model = name
    log_name = f"{server}-{name}"
    try:
        rates = run_peer(peer, args.port, args, args.log_dir, counts=(1, 32), log_name=log_name)
    except Exception as error:   # a server refusing the format is a result, not a stop
        return f"failed: {last_error(args.log_dir / f'{log_name}.log') or error}"
    return " / ".join(f"{value:.2f}" for value in rates.values())


def last_error(log: Path) -> str:
    """The last line of a server log that raises an error (vLLM's refusal; not its warnings), shortened."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines()
             if ("Error:" in line or "Exception:" in line) and "WARNING" not in line] if log.exists() else []
    return lines[-1][-300:].replace("|", "/") if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--float-dir", type=Path, default=Path("/work/peers/hf-qwen2.5-coder-0.5b"))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/servelm-prequantized-bench"))
    parser.add_argument("--formats", default=",".join(FORMATS), help="the first is the reference")
    parser.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per prompt")
    parser.add_argument("--decode-tokens", type=int, default=17, help="tokens per timed stream")
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--servers", default="", help=f"also measure these over HTTP, comma-separated: {SERVERS}")
    parser.add_argument("--output-len", type=int, default=64, help="--servers: tokens per stream")
    parser.add_argument("--port", type=int, default=18437)
    parser.add_argument("--startup-s", type=float, default=1200, help="--servers: how long a server may take to start")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/prequantized-servers"))
    parser.add_argument("--skip-quality", action="store_true", help="only the --servers columns")
    args = parser.parse_args()
    servers = [server for server in args.servers.split(",") if server]
    if unknown := set(servers) - set(SERVERS):
        parser.error(f"--servers: unknown {sorted(unknown)} (choose from {SERVERS})")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    print(f"load average before: {os.getloadavg()}", file=sys.stderr, flush=True)
    model: list[Any] = []
    paths = {name: checkpoint(name, args.float_dir, args.work_dir, model) for name in args.formats.split(",")}
    model.clear()
    quality = {} if args.skip_quality else quality_rows(paths, args)
    served = {name: [server_rates(server, name, path, args) for server in servers]
              for name, (path, _) in paths.items()}
    print(f"load average after: {os.getloadavg()}", file=sys.stderr, flush=True)
    columns = ([f"served as | identical greedy ({len(PROMPTS)} prompts x {args.max_tokens} tokens) | mean agreeing "
                "prefix | perplexity | 1-stream tok/s | 32-stream tok/s"] if quality else [])
    columns += [f"{server} HTTP 1 / 32 streams tok/s" for server in servers]
    print("| checkpoint | " + " | ".join(columns) + " |")
    print("|---" * (1 + sum(column.count("|") + 1 for column in columns)) + "|")
    for name, (_, label) in paths.items():
        cells = list(quality.get(name, ())) + served[name]
        print("| " + " | ".join([label, *cells]) + " |")


def quality_rows(paths: dict[str, tuple[str, str]], args: argparse.Namespace) -> dict[str, list[str]]:
    """Per format, in-process (one engine at a time): how it is served, greedy agreement with the
    first format's outputs, perplexity, 1- and 32-stream decode tok/s."""
    reference: list[list[int]] | None = None
    rows = {}
    for name, (path, _) in paths.items():
        engine = engine_for(path, args.num_threads)
        prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
        outputs = greedy(engine, prompts, args.max_tokens)
        reference = reference or outputs
        identical = sum(o == r for o, r in zip(outputs, reference)) / len(outputs)
        leading = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), len(r))
                   for o, r in zip(outputs, reference)]
        text_ppl = perplexity(engine, engine.tokenizer.encode(TEXT))
        one = decode_tok_s(engine, prompts[0], args.decode_tokens)
        many = decode_tok_s(engine, prompts[0], args.decode_tokens, streams=32)
        rows[name] = [engine.runner.quantization, f"{identical:.0%}", f"{sum(leading) / len(leading):.1f}",
                      f"{text_ppl:.2f}", f"{one:.2f}", f"{many:.1f}"]
        print(name, rows[name], f"load {os.getloadavg()[0]:.1f}", file=sys.stderr, flush=True)
        engine.shutdown()
        del engine
    return rows

if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
