"""Config-field rules shared by every config parser (Llama, Qwen3-TTS talker / code predictor /
speech tokenizer, XCodec2): one rule for unknown fields and typed reads that name the key.

- Unknown fields are accepted and logged once per file and field at WARNING: real checkpoints
  carry many extra Hugging Face fields; transformers' generic PretrainedConfig keys
  (HF_GENERIC_CONFIG_FIELDS) are known and not logged.
- A wrongly typed value raises ValueError naming the key and the expected type; the loaders
  prefix the file (CheckpointError "<file>: <section>.<key> must be an integer, got ...").
Imports: stdlib only.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "HF_GENERIC_CONFIG_FIELDS",
    "config_bool",
    "config_float",
    "config_int",
    "config_int_list",
    "log_unknown_fields",
]

log = logging.getLogger(__name__)

# Keys transformers' PretrainedConfig (4.57) writes into every config.json (generation and
# bookkeeping fields); no model here reads them, and they never change the network's math.
HF_GENERIC_CONFIG_FIELDS = frozenset(
    {
        "_name_or_path",
        "_attn_implementation_autoset",
        "add_cross_attention",
        "architectures",
        "auto_map",
        "bad_words_ids",
        "begin_suppress_tokens",
        "bos_token_id",
        "chunk_size_feed_forward",
        "cross_attention_hidden_size",
        "decoder_start_token_id",
        "diversity_penalty",
        "do_sample",
        "dtype",
        "early_stopping",
        "encoder_no_repeat_ngram_size",
        "eos_token_id",
        "exponential_decay_length_penalty",
        "finetuning_task",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "id2label",
        "is_decoder",
        "is_encoder_decoder",
        "label2id",
        "length_penalty",
        "max_length",
        "min_length",
        "model_type",
        "no_repeat_ngram_size",
        "num_beam_groups",
        "num_beams",
        "num_return_sequences",
        "output_attentions",
        "output_hidden_states",
        "output_scores",
        "pad_token_id",
        "prefix",
        "problem_type",
        "pruned_heads",
        "remove_invalid_values",
        "repetition_penalty",
        "return_dict",
        "return_dict_in_generate",
        "sep_token_id",
        "suppress_tokens",
        "task_specific_params",
        "temperature",
        "tf_legacy_loss",
        "tie_encoder_decoder",
        "tokenizer_class",
        "top_k",
        "top_p",
        "torch_dtype",
        "torchscript",
        "transformers_version",
        "typical_p",
        "use_bfloat16",
        "use_cache",
        "initializer_range",
        "attention_dropout",
    }
)

_logged_lock = threading.Lock()
_logged: set[tuple[str, str]] = set()  # (source, field) pairs already logged


def log_unknown_fields(data: Mapping[str, Any], known: Iterable[str], *, source: str, section: str = "") -> list[str]:
    """Accept fields of `data` outside `known` (and HF_GENERIC_CONFIG_FIELDS), logging each once per
    `source` (the file) at WARNING; returns the unknown names (sorted)."""
    known = set(known)
    unknown = sorted(k for k in data if k not in known and k not in HF_GENERIC_CONFIG_FIELDS)
    prefix = f"{section}." if section else ""
    with _logged_lock:
        fresh = [k for k in unknown if (source, prefix + k) not in _logged]
        _logged.update((source, prefix + k) for k in fresh)
    if fresh:
        log.warning(
            "%s: ignoring unknown config field(s) %s (not read by tilevox; check they do not change the model)",
            source,
            ", ".join(prefix + k for k in fresh),
        )
    return unknown


_REQUIRED = object()


def _get(data: Mapping[str, Any], key: str, default: Any, section: str) -> tuple[bool, Any, str]:
    """(present, value or default, dotted name); a missing required key raises ValueError naming it."""
    name = f"{section}.{key}" if section else key
    if key not in data or (data[key] is None and default is not _REQUIRED):
        if default is _REQUIRED:
            raise ValueError(f"missing key {name!r}")
        return False, default, name
    return True, data[key], name


def config_int(data: Mapping[str, Any], key: str, default: Any = _REQUIRED, *, section: str = "") -> Any:
    """`data[key]` as an int (a JSON integer; bools, strings and floats are refused), or `default`
    when absent or null. Raises ValueError naming the key and the expected type."""
    present, value, name = _get(data, key, default, section)
    if not present:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return value


def config_float(data: Mapping[str, Any], key: str, default: Any = _REQUIRED, *, section: str = "") -> Any:
    """`data[key]` as a float (a JSON number, not a bool or string), or `default` when absent or null."""
    present, value, name = _get(data, key, default, section)
    if not present:
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    return float(value)


def config_bool(data: Mapping[str, Any], key: str, default: Any = _REQUIRED, *, section: str = "") -> Any:
    """`data[key]` as a bool (JSON true/false only), or `default` when absent or null."""
    present, value, name = _get(data, key, default, section)
    if not present:
        return value
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be true or false, got {value!r} ({type(value).__name__})")
    return value


def config_int_list(data: Mapping[str, Any], key: str, default: Any = _REQUIRED, *, section: str = "") -> Any:
    """`data[key]` as a tuple of ints (a JSON array of integers), or `default` when absent or null."""
    present, value, name = _get(data, key, default, section)
    if not present:
        return value
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ValueError(f"{name} must be a list of integers, got {value!r}")
    return tuple(value)
