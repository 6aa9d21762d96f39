"""Qwen3-TTS `rope_scaling` in the talker and code-predictor configs (issue 11, loader defects).

The official code builds both rotary embeddings with transformers' ROPE_INIT_FUNCTIONS[rope_type];
tilevox used to ignore rope_scaling (talker logits off by up to 1.9 with linear x2). Now the static
types (default, linear, llama3, yarn) are computed as transformers does, checked here bit for bit,
and against the official package end to end for linear x2; the sequence-dependent types (dynamic,
longrope) and unknown types are refused with a CheckpointError naming the key and the file.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tilevox.models.errors import CheckpointError
from tilevox.models.qwen3_tts.config import TransformerConfig
from tilevox.models.qwen3_tts.layers import rope_inv_freq
from tilevox.models.qwen3_tts.loader import load_checkpoint
from tilevox.models.qwen3_tts.model import ModelOptions

SCALINGS = [
    {"rope_type": "default"},
    {"rope_type": "linear", "factor": 2.0},
    {"type": "linear", "factor": 3},  # transformers' older key, an int factor
    {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    {"rope_type": "yarn", "factor": 4.0},
    {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "beta_fast": 16,
        "mscale": 0.7,
        "mscale_all_dim": 1.0,
        "truncate": False,
    },
    {"rope_type": "yarn", "factor": 3.0, "attention_factor": 1.3},
]


def _stack(head_dim: int, scaling: dict | None) -> dict:
    return {
        "hidden_size": 4 * head_dim,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": head_dim,
        "rope_theta": 1e6,
        "max_position_embeddings": 32768,
        "rope_scaling": scaling,
    }


@pytest.mark.parametrize("head_dim", [8, 128])
@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: json.dumps(s, sort_keys=True))
def test_inv_freq_matches_transformers(scaling, head_dim):
    transformers = pytest.importorskip("transformers", reason="transformers' rope init functions are the reference")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.PretrainedConfig(
        rope_theta=1e6,
        head_dim=head_dim,
        hidden_size=4 * head_dim,
        num_attention_heads=4,
        max_position_embeddings=32768,
        rope_scaling=dict(scaling),
    )
    expected, expected_scaling = ROPE_INIT_FUNCTIONS[scaling.get("rope_type", scaling.get("type"))](hf, "cpu")
    ours, our_scaling = rope_inv_freq(TransformerConfig.from_dict(_stack(head_dim, scaling), "talker_config"))
    assert torch.equal(ours, expected)
    assert our_scaling == pytest.approx(expected_scaling, rel=1e-12)


def _copy_with_scaling(src, dst, talker_scaling, predictor_scaling):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    if talker_scaling is not None:
        config["talker_config"]["rope_scaling"] = talker_scaling
    if predictor_scaling is not None:
        config["talker_config"]["code_predictor_config"]["rope_scaling"] = predictor_scaling
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


@pytest.mark.oracle
def test_linear_scaling_matches_official(oracle_checkpoints, tmp_path):
    """Linear x2 in both stacks: per-step talker and predictor logits and the codes equal the official
    package's (greedy, batch of two); the unscaled model differs (so the test can fail)."""
    from test_qwen3_tts_oracle import CASES, LOGIT_TOL, _run_official, _run_ours

    mrope = {"mrope_section": [4, 2, 2], "interleaved": True}
    path = _copy_with_scaling(
        oracle_checkpoints["custom_voice"],
        tmp_path / "linear2",
        {"rope_type": "linear", "factor": 2.0, **mrope},
        {"rope_type": "linear", "factor": 2.0},
    )
    case = CASES["custom_voice"]
    official = _run_official(path, case)
    options = ModelOptions(max_streams=4, max_seq_len=512)
    ours = _run_ours(load_checkpoint(path, options=options), case)
    unscaled = _run_ours(load_checkpoint(oracle_checkpoints["custom_voice"], options=options), case)
    worst_unscaled = 0.0
    for row, sid in enumerate(ours.stream_ids):
        assert torch.equal(torch.stack(ours.frames[sid]), official.codes[row]), f"row {row}: codes differ"
        for step, logits in enumerate(ours.talker_logits[sid][: len(ours.frames[sid])]):
            ref = official.talker_logits[step][row]
            assert (logits - ref).abs().max().item() <= LOGIT_TOL, f"row {row} step {step}: talker logits differ"
            worst_unscaled = max(worst_unscaled, (unscaled.talker_logits[sid][step] - ref).abs().max().item())
        for head in range(ours.frames[sid][0].numel() - 1):
            for step, logits in enumerate(ours.predictor_logits[(sid, head)]):
                ref = official.predictor_logits[head][step][row]
                assert (logits - ref).abs().max().item() <= LOGIT_TOL, f"row {row} head {head}: predictor logits differ"
    assert worst_unscaled > 100 * LOGIT_TOL, "scaling changes nothing here: the parity check would be vacuous"


@pytest.mark.parametrize(
    ("section", "scaling", "match"),
    [
        (
            "talker",
            {"rope_type": "dynamic", "factor": 2.0},
            r"talker_config\.rope_scaling\.rope_type 'dynamic' is not supported",
        ),
        (
            "predictor",
            {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]},
            r"talker_config\.code_predictor_config\.rope_scaling\.rope_type 'longrope' is not supported",
        ),
        (
            "predictor",
            {"rope_type": "ntk-magic"},
            r"code_predictor_config\.rope_scaling\.rope_type 'ntk-magic' is not supported",
        ),
        ("talker", {"rope_type": "linear"}, r"talker_config\.rope_scaling of type 'linear' lacks 'factor'"),
        ("talker", {"rope_type": "linear", "factor": "2"}, r"talker_config\.rope_scaling\.factor must be a number"),
        ("talker", [2.0], r"talker_config\.rope_scaling must be an object or null"),
    ],
)
def test_unsupported_scaling_is_refused_naming_key_and_file(oracle_checkpoints, tmp_path, section, scaling, match):
    path = _copy_with_scaling(
        oracle_checkpoints["custom_voice"],
        tmp_path / "bad",
        scaling if section == "talker" else None,
        scaling if section == "predictor" else None,
    )
    with pytest.raises(CheckpointError, match=match) as info:
        load_checkpoint(path)
    assert str(path / "config.json") in str(info.value)


def test_the_scaled_rope_table_is_made_before_forward_and_follows_the_module():
    """Nothing _rope reads is created by a forward call: state a compiled forward makes on its first call makes
    Dynamo compile it again on the second, which the executor runs during a CUDA-graph capture."""
    from tilevox.models.qwen3_tts.layers import DecoderStack

    config = TransformerConfig.from_dict(_stack(8, {"rope_type": "linear", "factor": 2.0}), "talker_config")
    stack = DecoderStack(config)
    table = stack._inv_freq
    assert table.device == torch.device("cpu")
    torch.testing.assert_close(table, rope_inv_freq(config)[0], rtol=0, atol=0)
    stack._rope(torch.arange(5)[None], torch.float32)
    assert stack._inv_freq is table  # the forward's rope read it, made nothing
    stack.to(torch.bfloat16)
    assert stack._inv_freq.dtype == torch.float32
    torch.testing.assert_close(stack._inv_freq, table, rtol=0, atol=0)
    stack.to("meta")
    assert stack._inv_freq.device.type == "meta" and stack._inv_freq.dtype == torch.float32
