"""How often the peers' greedy outputs equal the float32 dequantized model's (issue 16's gate, for the peers).

The reference is servelm's float32 model in-process (``quant_quality.build_engine("none", ...)``:
the GGUF dequantized to float32), on quant_quality's held-out prompts, ``--max-tokens`` (32) greedy
tokens each, ``ignore_eos``. Each server then gets the same prompt token ids (servelm's tokenizer,
as quant_quality encodes them), one request at a time, temperature 0, and answers token ids:

- llama.cpp: ``/completion`` with ``"prompt": [ids]``, ``return_tokens``; its ``tokens_evaluated``
  must equal the prompt's length (the ids are taken as given, no BOS added twice);
- vLLM: ``/v1/completions`` with ``return_token_ids``; its ``prompt_token_ids`` must be the prompt;
- servelm: ``/generate`` with ``input_ids`` (its default flags, the same HTTP path as the peers:
  a check that the comparison reproduces quant_quality's in-process share).

Servers are started and stopped by compare_peers.py's helpers (``find_peers``, ``wait_ready``,
``stop_group``). Printed per server: the share of identical outputs and the mean agreeing prefix.

    .venv/bin/python benchmarks/peer_quality.py [--model gemma3-270m] [--more-prompts 96] [--peers servelm,llama.cpp,vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compare_peers  # noqa: E402
import quant_quality  # noqa: E402


def _llama(client: object, base_url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    response = client.post(f"{base_url}/completion", json={
        "prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "ignore_eos": True,
        "return_tokens": True, "cache_prompt": False})
    response.raise_for_status()
    body = response.json()
    if body.get("tokens_evaluated") != len(prompt):
        raise RuntimeError(f"llama.cpp evaluated {body.get('tokens_evaluated')} prompt tokens, sent {len(prompt)}")
    return list(body["tokens"])


def _vllm(client: object, base_url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    response = client.post(f"{base_url}/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "return_token_ids": True})
    response.raise_for_status()
    choice = response.json()["choices"][0]
    if choice.get("prompt_token_ids") not in (None, prompt):
        raise RuntimeError(f"vLLM's prompt ids {choice['prompt_token_ids'][:8]}... differ from {prompt[:8]}...")
    return list(choice["token_ids"])


def _servelm(client: object, base_url: str, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    response = client.post(f"{base_url}/generate", json={
        "input_ids": prompt, "sampling_params": {"temperature": 0.0, "max_new_tokens": max_tokens,
                                                  "ignore_eos": True}})
    response.raise_for_status()
    body = response.json()
    if body["meta_info"].get("prompt_tokens", len(prompt)) != len(prompt):
        raise RuntimeError(f"servelm took {body['meta_info']['prompt_tokens']} prompt tokens, sent {len(prompt)}")
    return list(body["output_ids"])


CLIENTS = {"llama.cpp": _llama, "vLLM": _vllm, "servelm": _servelm}


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """quant_quality's two figures: the share of identical outputs and the mean agreeing prefix."""
    identical = sum(o == r for o, r in zip(outputs, reference)) / len(reference)
    leading = [next((i for i, (a, b) in enumerate(zip(o, r)) if a != b), min(len(o), len(r)))
               for o, r in zip(outputs, reference)]
    return identical, sum(leading) / len(leading)


def run_server(peer: compare_peers.Peer, port: int, model: str, prompts: list[list[int]], max_tokens: int,
               log_dir: Path) -> list[list[int]]:
    import httpx
    base_url = f"http://127.0.0.1:{port}"
    ask = CLIENTS[peer.name.split()[0]]
    log = (log_dir / f"{peer.name.split()[0]}.log").open("w")
    process = subprocess.Popen(peer.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                               env={**os.environ, **peer.env})
    try:
        compare_peers.wait_ready(base_url, process, peer.startup_s)
        with httpx.Client(timeout=600) as client:
            return [ask(client, base_url, model, prompt, max_tokens) for prompt in prompts]
    finally:
        compare_peers.stop_group(process, 30)
        log.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m", help="a packaged model name")
    parser.add_argument("--peers", default="servelm,llama.cpp,vllm")
    parser.add_argument("--more-prompts", type=int, default=96, choices=(8, 32, 96, 288), dest="prompt_count")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=18432)
    parser.add_argument("--hf-dir", help="the model as a Hugging Face directory, for vLLM "
                                         "(default /work/peers/hf-MODEL)")
    parser.add_argument("--in-process", action="store_true",
                        help="also servelm's default in-process (quant_quality's mode auto): one prompt at a "
                             "time, as the servers get them, and all at once, as quant_quality runs them")
    parser.add_argument("--servelm-args", default="", help="extra servelm flags (default: none)")
    parser.add_argument("--log-dir", default="/tmp/peer_quality",
                        help="server logs and each server's token ids (JSON)")
    args = parser.parse_args()
    args.hf_dir = args.hf_dir or f"/work/peers/hf-{args.model}"
    args.output_len = args.max_tokens   # find_peers sizes llama.cpp's context from it
    from servelm.model.packaged import packaged_model_path
    gguf = Path(packaged_model_path(args.model))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    texts = (quant_quality.PROMPTS + quant_quality.MORE_PROMPTS + quant_quality.TOPIC_PROMPTS
             + quant_quality.TEMPLATE_PROMPTS)[:args.prompt_count]
    print(f"{args.model} ({gguf.name}), {len(texts)} prompts x {args.max_tokens} tokens, {args.threads} threads, "
          f"{platform.processor() or platform.machine()}; load average {os.getloadavg()}", flush=True)
    engine, _ = quant_quality.build_engine(args.model, "none", "auto", args.threads)
    prompts = [engine.tokenizer.encode(text) for text in texts]
    reference = quant_quality.greedy(engine, prompts, args.max_tokens)
    del engine
    saved = {"prompts": prompts, "float32": reference}
    rows = []
    if args.in_process:   # batches above 16 rows take the dense bf16 copy, fewer the GGUF kernel
        engine, _ = quant_quality.build_engine(args.model, "auto", "auto", args.threads)
        for name, outputs in (
                ("servelm default in-process, one prompt at a time",
                 [quant_quality.greedy(engine, [prompt], args.max_tokens)[0] for prompt in prompts]),
                ("servelm default in-process, all prompts at once (quant_quality)",
                 quant_quality.greedy(engine, prompts, args.max_tokens))):
            saved[name] = outputs
            rows.append((name, *agreement(outputs, reference)))
            print(f"  {rows[-1]}", flush=True)
        del engine
    peers, skipped = compare_peers.find_peers(args, gguf, args.port)
    for message in skipped:
        print(f"skipped {message}", flush=True)
    for peer in peers:
        print(f"running {peer.name} ...", flush=True)
        try:
            outputs = run_server(peer, args.port, args.model, prompts, args.max_tokens, log_dir)
        except Exception as error:   # one peer failing does not stop the others
            print(f"  {peer.name} failed: {error} (log in {log_dir})", flush=True)
            continue
        saved[peer.name] = outputs
        rows.append((peer.name, *agreement(outputs, reference)))
        print(f"  {rows[-1]}", flush=True)
    (log_dir / f"{args.model}-{len(texts)}.json").write_text(json.dumps(saved))
    print(f"| server ({args.model}) | identical greedy outputs ({len(texts)} prompts x {args.max_tokens} tokens) "
          "| mean agreeing prefix, tokens |")
    print("|---|---|---|")
    for name, identical, leading in rows:
        print(f"| {name} | {identical:.0%} | {leading:.1f} |")
    print(f"load average after: {os.getloadavg()}", flush=True)


if __name__ == "__main__":
    main()
