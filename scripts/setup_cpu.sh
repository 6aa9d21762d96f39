#!/usr/bin/env bash
# Create .venv with CPU PyTorch, tilevox (editable) and the reference packages that the `oracle`
# tests compare against. Needs Python 3.11 and network access to PyPI. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3.11}"
"$PYTHON" -m venv .venv
PIP=".venv/bin/pip"
"$PIP" install --quiet --upgrade pip
# The CPU build first: everything installed after it sees torch already satisfied.
"$PIP" install --quiet torch==2.13.0
"$PIP" install --quiet -e ".[test]"
"$PIP" install --quiet --no-deps -r requirements/server-nodeps.txt
"$PIP" install --quiet --no-deps -r requirements/oracle-nodeps.txt
"$PIP" install --quiet -r requirements/oracle.txt
"$PIP" install --quiet --no-deps -r requirements/cuda-build.txt
# torchaudio 2.11.1 (the newest on PyPI) ships C++ extensions built for torch 2.11 that cannot load in
# torch 2.13; qwen-tts imports torchaudio at import time but its 12 Hz path never calls the extensions.
# Without these files torchaudio imports in pure-Python mode.
.venv/bin/python - <<'PY'
import pathlib, site
lib = pathlib.Path(site.getsitepackages()[0]) / "torchaudio" / "lib"
for name in ("_torchaudio.so", "libtorchaudio.so", "torchaudio_prefixctc.so"):
    (lib / name).unlink(missing_ok=True)
PY
.venv/bin/python -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__; assert not torch.version.cuda, 'a CUDA torch was installed'"
echo "setup done: activate with 'source .venv/bin/activate'; try: .venv/bin/tilevox synth --model random:llama-tiny --text 'Hello there' --out hello.wav"
