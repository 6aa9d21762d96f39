"""Fixtures shared by the Qwen3-TTS tests (and the speech-tokenizer tests below this folder).

`oracle_checkpoints` (session scope) builds tiny official checkpoints once per session; see
oracle_checkpoints.py. Imported by module name: pytest's default (prepend) import mode puts
this folder on sys.path before importing this conftest.
"""

import pytest
import torch
from oracle_checkpoints import oracle_checkpoints  # noqa: F401  (re-exported as a fixture)


@pytest.fixture(autouse=True)
def _single_thread():
    """Tiny models on a shared 2-core runner: intra-op threads only contend (measured 40x slower
    per step with 2 threads under load, 2026-12-02), so run these tests single-threaded."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
