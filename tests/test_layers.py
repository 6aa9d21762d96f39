"""The import-layer contract in `.importlinter` (trt_plugins <- models <- executor <- engine_builder <- server) holds.

import-linter reads packages from the file system, and the design folders are mapped into `tilevox` by
setup.py, so the check runs on a copy of the sources laid out as installed (`tilevox/<folder>/...`).
A second run plants an upward import to prove the check can fail.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
FOLDERS = ("trt_plugins", "models", "executor", "engine_builder", "server")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _installed_layout(dest: Path) -> Path:
    root = dest / "tilevox"
    root.mkdir(parents=True)
    shutil.copy(REPO / "tilevox" / "__init__.py", root / "__init__.py")
    for folder in FOLDERS:
        shutil.copytree(
            REPO / folder,
            root / folder,
            ignore=shutil.ignore_patterns("__pycache__", "build", "csrc", "*.so", "*.json"),
        )
    return root


def _lint(site: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(site)}
    return subprocess.run(
        [str(LINT_IMPORTS), str(REPO / ".importlinter"), "--no-cache"],
        cwd=site,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (it comes with the `test` extra)")
def test_import_layers_hold(tmp_path):
    _installed_layout(tmp_path)
    result = _lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.skipif(not LINT_IMPORTS.exists(), reason="import-linter is not installed (it comes with the `test` extra)")
def test_an_upward_import_breaks_the_contract(tmp_path):
    root = _installed_layout(tmp_path)
    (root / "trt_plugins" / "planted_upward_import.py").write_text("import tilevox.server.config\n")
    result = _lint(tmp_path)
    assert result.returncode != 0
    assert "0 kept, 1 broken" in result.stdout
