#!/usr/bin/env bash
# Create .venv with CPU PyTorch, tilevox (editable) and the reference packages that the `oracle`
# tests compare against. Needs Python 3.11 on Linux, network access to PyPI, and PyTorch's CPU index
# (https://download.pytorch.org/whl/cpu; or a local torch-2.13.0+cpu wheel on pip's find-links).
# Safe to re-run. Installs packages only: no installed package's files are changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
"$PYTHON" -m venv .venv
PIP=".venv/bin/pip"
"$PIP" install --quiet --upgrade pip
# The CPU build first: everything installed after it sees torch already satisfied.
bash scripts/install_cpu_torch.sh .venv/bin/python
# Everything installed with its dependencies first, in one resolve ... (the filter hides setuptools'
# generic notice that a folder named like the package, here tilevox/ itself, is importable from the checkout)
PYTHONWARNINGS="ignore:Editable installation" "$PIP" install --quiet -e ".[test]" -r requirements/oracle.txt
# ... then the packages whose declared pins must not be followed. pip checks dependencies only on
# installs that resolve them, so their unmet pins are not reported here (`pip check` lists them).
"$PIP" install --quiet --no-deps -r requirements/riva-client-nodeps.txt -r requirements/oracle-nodeps.txt \
    -r requirements/cuda-build.txt
echo "setup: installed without their dependencies (see requirements/*-nodeps.txt): nvidia-riva-client, qwen-tts, xcodec2, ...; 'pip check' lists their pins, expected"
.venv/bin/python -c "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__; assert not torch.version.cuda, 'a CUDA torch was installed'"
echo "setup done: activate with 'source .venv/bin/activate'; try: .venv/bin/tilevox synth --model random:llama-tiny --text 'Hello there' --out hello.wav"
