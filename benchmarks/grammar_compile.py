"""What one new grammar spec costs to compile, in the compile process and in the engine (issue 19).

With the default compile process, a spec is compiled twice: in the child, with every check, so a
compile past --grammar-compile-timeout can be killed and a grammar that allocates without bound
fails there (``compile_process``), then in the engine, where the matchers need the result. This
prints, per schema size (N optional integer properties, the shape whose compile is superlinear):

- child: the child's work (spec budget, grammar build, finiteness walk, compile, can-start probe);
- engine, all checks: what the engine ran before it skipped the checks the child had passed;
- engine, checked: what it runs now (``compile(..., is_checked=True)``: build and compile only);
- transfer: writing and reading xgrammar's serialized compiled grammar, the alternative to the
  second compile (the only form in which a compiled grammar crosses a process boundary).

Each row is the median of ``--repeats`` runs with xgrammar's own cache off. Times are noisy on a
shared machine; compare the columns of one run.

    .venv/bin/python benchmarks/grammar_compile.py --model smollm2-135m --properties 30 300 1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

from servelm.config import ModelConfig
from servelm.constrained.compile_process import compile_checked
from servelm.constrained.xgrammar_backend import XGrammarBackend
from servelm.model.tokenizer import load_tokenizer


def timed(run: Callable[[], object], repeats: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--properties", type=int, nargs="+", default=[30, 300, 1000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transfer-up-to", type=int, default=300,
                        help="measure the serialized transfer only up to this many properties "
                             "(it takes minutes beyond)")
    args = parser.parse_args()
    tokenizer = load_tokenizer(ModelConfig(model=args.model))
    assert tokenizer is not None
    backend = XGrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    backend.compiler.clear_cache()
    import xgrammar as xgr
    backend.compiler = xgr.GrammarCompiler(backend.tokenizer_info, max_threads=1, cache_enabled=False)
    print(f"model {args.model} (vocab {len(tokenizer)}), xgrammar, load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| properties | spec bytes | child | engine, all checks | engine, checked | "
          "transfer (write + read, size) |")
    print("|---|---|---|---|---|---|")
    for num_properties in args.properties:
        spec = json.dumps({"type": "object", "properties": {
            f"p{i}": {"type": "integer"} for i in range(num_properties)}})
        child_s, _ = timed(lambda: compile_checked(backend, "json", spec, 1 << 24), args.repeats)
        full_s, _ = timed(lambda: backend.compile("json", spec), args.repeats)
        checked_s, compiled = timed(lambda: backend.compile("json", spec, is_checked=True),
                                    args.repeats)
        transfer = "not measured"
        if num_properties <= args.transfer_up_to:
            write_s, text = timed(compiled.serialize_json, 1)  # type: ignore[attr-defined]
            read_s, _ = timed(lambda: xgr.CompiledGrammar.deserialize_json(
                text, backend.tokenizer_info), 1)  # type: ignore[arg-type]
            transfer = f"{write_s:.3f} + {read_s:.3f} s, {len(text) / 1e6:.1f} MB"  # type: ignore[arg-type]
        print(f"| {num_properties} | {len(spec)} | {child_s:.3f} s | {full_s:.3f} s | "
              f"{checked_s:.3f} s | {transfer} |", flush=True)


if __name__ == "__main__":
    main()
