"""Fixtures shared by the Qwen3-TTS tests (and the speech-tokenizer tests below this folder).

`oracle_checkpoints` (session scope) builds tiny official checkpoints once per session; see
oracle_checkpoints.py. Imported by module name: pytest's default (prepend) import mode puts
this folder on sys.path before importing this conftest.
"""

from oracle_checkpoints import oracle_checkpoints  # noqa: F401  (re-exported as a fixture)
