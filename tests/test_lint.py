"""The toolchain's checks, as CI runs them: ruff's formatter and linter (configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUFF = Path(sys.executable).with_name("ruff")

pytestmark = pytest.mark.skipif(not RUFF.exists(), reason="ruff is not installed (it comes with the `test` extra)")


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(RUFF), *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_the_tree_is_formatted():
    result = _ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def test_the_linter_finds_nothing():
    result = _ruff("check", "--output-format", "concise", ".")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
