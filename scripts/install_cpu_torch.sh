#!/usr/bin/env bash
# Install the CPU build of PyTorch 2.13.0 into the environment of the given Python, and check it.
#
#   bash scripts/install_cpu_torch.sh .venv/bin/python
#
# The default torch wheel on PyPI for Linux x86-64 is the CUDA build (several GB of CUDA libraries),
# so this asks for the local version `2.13.0+cpu`, which only PyTorch's CPU index
# ($TORCH_CPU_INDEX, default https://download.pytorch.org/whl/cpu) or a local wheel on pip's
# find-links provides: a CUDA build can never be picked. The index is probed first (5 s timeout) and
# left out when unreachable, so that machines without it (a local wheel, no network beyond PyPI) do
# not wait on pip's retries. Used by scripts/setup_cpu.sh and tests/test_packaging.py.
set -euo pipefail
PY="${1:?usage: install_cpu_torch.sh PYTHON}"
TORCH_VERSION="2.13.0"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"

extra=()
if reason=$("$PY" - "$TORCH_CPU_INDEX" 2>&1 <<'PY'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
except Exception as exc:
    sys.exit(f"{type(exc).__name__}: {exc}")
PY
); then
    extra=(--extra-index-url "$TORCH_CPU_INDEX")
else
    echo "install_cpu_torch: $TORCH_CPU_INDEX is unreachable ($reason); looking for torch==$TORCH_VERSION+cpu on pip's other indexes and find-links" >&2
fi
if ! "$PY" -m pip install --quiet ${extra[@]+"${extra[@]}"} "torch==$TORCH_VERSION+cpu"; then
    echo "install_cpu_torch: error: no CPU build of torch $TORCH_VERSION found (needs $TORCH_CPU_INDEX reachable, or a torch-$TORCH_VERSION+cpu wheel on pip's find-links; CPU builds exist for Linux)" >&2
    exit 1
fi
# -W ignore: torch warns that numpy is missing, which it is in a fresh environment at this point
"$PY" -W ignore -c "import torch; assert torch.__version__ == '$TORCH_VERSION+cpu', torch.__version__; assert not torch.version.cuda, 'a CUDA torch was installed'"
echo "install_cpu_torch: torch $TORCH_VERSION+cpu installed (no CUDA)"
