"""Loader defects of issue 11 for Llama/Llasa, XCodec2 and the Qwen3-TTS speech tokenizer, and the
shared config rules (models.checkpoint_io, models.config_fields):

1. a truncated .safetensors file (single, or one shard of a sharded save) is a CheckpointError naming
   the file, and `tilevox synth` prints one `tilevox: error:` line and exits 2;
3. a non-float tensor where a float is expected is refused naming the tensor and the file;
4. unknown config fields are accepted and logged once (WARNING) naming the field and the file;
5. a wrongly typed numeric field is refused naming the key, the file and the expected type.
Qwen3-TTS talker checkpoints: tests/models/qwen3_tts/test_qwen3_tts_loader_defects.py.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import save_file

from tilevox.models.errors import CheckpointError
from tilevox.models.llama.weights import load_llama, load_llama_config
from tilevox.models.llasa.loader import load_preset as load_llasa_preset
from tilevox.models.qwen3_tts.config import Qwen3TTSConfig
from tilevox.models.qwen3_tts.loader import preset_config_dict
from tilevox.models.qwen3_tts.speech_tokenizer import (
    PRESETS as CODEC_PRESETS,
)
from tilevox.models.qwen3_tts.speech_tokenizer import (
    SpeechTokenizerConfig,
    load_speech_tokenizer,
    random_speech_tokenizer,
    save_speech_tokenizer,
)
from tilevox.models.xcodec2.config import XCodec2Config
from tilevox.models.xcodec2.weights import checkpoint_name, load_xcodec2_decoder

FIELDS_LOGGER = "tilevox.models.config_fields"


def _truncate(path, keep: float = 0.6) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# ---- Llama / Llasa ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llasa():
    return load_llasa_preset("llama-tiny", device="cpu", dtype=torch.float32, max_streams=1)


def _write_llasa(model, root, *, shards: int = 1):
    """A Llasa checkpoint folder (Llama config + safetensors, optionally sharded with an index,
    tokenizer.json, xcodec2/ beside it)."""
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(model.llama.config.to_hf_config()))
    state = {k: v.contiguous() for k, v in model.llama.state_dict().items()}
    names = sorted(state)
    if shards == 1:
        save_file(state, str(root / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(shards):
            file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = names[i::shards]
            save_file({k: state[k] for k in part}, str(root / file))
            weight_map |= {k: file for k in part}
        (root / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model.tokenizer.backend.save(str(root / "tokenizer.json"))
    codec_dir = root / "xcodec2"
    codec_dir.mkdir()
    (codec_dir / "config.json").write_text(json.dumps(model.codec.config.to_dict()))
    save_file(
        {checkpoint_name(n): p.contiguous() for n, p in model.codec.named_parameters()},
        str(codec_dir / "model.safetensors"),
    )
    return root


@pytest.mark.parametrize("shards", [1, 2])
def test_truncated_llama_file_names_the_file(llasa, tmp_path, shards):
    root = _write_llasa(llasa, tmp_path / "ckpt", shards=shards)
    victim = sorted(root.glob("*.safetensors"))[-1]
    _truncate(victim)
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        load_llama(root, device="cpu", dtype=torch.float32)
    assert str(victim) in str(info.value)


def test_truncated_checkpoint_cli_prints_one_line_and_exits_2(llasa, tmp_path, capsys):
    from tilevox.server.cli import main

    root = _write_llasa(llasa, tmp_path / "ckpt", shards=2)
    victim = root / "model-00002-of-00002.safetensors"
    _truncate(victim, keep=0.3)
    code = main(["synth", "--model", str(root), "--text", "hi", "--out", str(tmp_path / "o.wav"), "--quiet"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("tilevox: error: ") and str(victim) in err[0], err


def test_int_llama_tensor_is_refused_naming_tensor_and_file(llasa, tmp_path):
    root = _write_llasa(llasa, tmp_path / "ckpt")
    state = {k: v.contiguous() for k, v in llasa.llama.state_dict().items()}
    state["model.layers.0.mlp.up_proj.weight"] = state["model.layers.0.mlp.up_proj.weight"].to(torch.int32)
    save_file(state, str(root / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has dtype torch\.int32"
    ) as info:
        load_llama(root, device="cpu", dtype=torch.float32)
    assert str(root / "model.safetensors") in str(info.value)


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("hidden_size", "64", "hidden_size must be an integer, got '64' (str)"),
        ("num_key_value_heads", 2.0, "num_key_value_heads must be an integer, got 2.0 (float)"),
        ("rms_norm_eps", "1e-5", "rms_norm_eps must be a number, got '1e-5' (str)"),
        ("tie_word_embeddings", "no", "tie_word_embeddings must be true or false, got 'no' (str)"),
    ],
)
def test_llama_wrongly_typed_field_names_key_file_and_type(llasa, tmp_path, key, value, expected):
    root = _write_llasa(llasa, tmp_path / "ckpt")
    config = json.loads((root / "config.json").read_text())
    config[key] = value
    (root / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as info:
        load_llama_config(root)
    assert str(info.value) == f"{root / 'config.json'}: {expected}"


def test_llama_unknown_fields_logged_once_naming_field_and_file(llasa, tmp_path, caplog):
    root = _write_llasa(llasa, tmp_path / "ckpt")
    config = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps(config | {"sliding_window_pattern": 4, "bos_token_id": 1}))
    with caplog.at_level(logging.WARNING, logger=FIELDS_LOGGER):
        load_llama_config(root)
        load_llama_config(root)
    lines = [r.getMessage() for r in caplog.records if r.name == FIELDS_LOGGER]
    assert len(lines) == 1, lines  # once per file and field; HF's generic keys (bos_token_id) are not logged
    assert str(root / "config.json") in lines[0] and "sliding_window_pattern" in lines[0]
    assert "bos_token_id" not in lines[0] and "torch_dtype" not in lines[0]


# ---- XCodec2 ---------------------------------------------------------------------------------


def _write_codec(codec, directory, config: dict | None = None, edit=None):
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config if config is not None else codec.config.to_dict()))
    state = {checkpoint_name(n): p.detach().contiguous() for n, p in codec.named_parameters()}
    if edit:
        edit(state)
    save_file(state, str(directory / "model.safetensors"))
    return directory


def test_xcodec2_truncated_and_int_tensors_are_named(llasa, tmp_path):
    directory = _write_codec(llasa.codec, tmp_path / "codec")
    _truncate(directory / "model.safetensors")
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        load_xcodec2_decoder(directory)
    assert str(directory / "model.safetensors") in str(info.value)
    key = "generator.backbone.embed.weight"

    def to_int(state):
        assert key in state, sorted(state)[:5]
        state[key] = state[key].to(torch.int32)

    directory = _write_codec(llasa.codec, tmp_path / "codec_int", edit=to_int)
    with pytest.raises(CheckpointError, match=rf"tensor '{key}' has dtype torch\.int32, expected a floating-point"):
        load_xcodec2_decoder(directory)


def test_xcodec2_config_rules(llasa, tmp_path, caplog):
    ours = llasa.codec.config.to_dict()
    directory = _write_codec(llasa.codec, tmp_path / "typed", config=ours | {"hidden_size": "64"})
    with pytest.raises(CheckpointError, match="hidden_size must be an integer, got '64' \\(str\\)") as info:
        load_xcodec2_decoder(directory)
    assert str(directory / "config.json") in str(info.value)
    # Unknown keys, in our own layout and in the package's: accepted, logged naming field and file.
    with caplog.at_level(logging.WARNING, logger=FIELDS_LOGGER):
        assert XCodec2Config.from_dict(ours | {"depth": 12}, source="/x/ours.json") == llasa.codec.config
        package = {"model_type": "xcodec2", "codec_decoder_hidden_size": 1024, "use_vocos": True, "extra_knob": 1}
        assert XCodec2Config.from_dict(package, source="/x/package.json") == XCodec2Config.preset("full")
    lines = [r.getMessage() for r in caplog.records if r.name == FIELDS_LOGGER]
    assert any("/x/ours.json" in m and "depth" in m for m in lines), lines
    assert any("/x/package.json" in m and "extra_knob" in m for m in lines), lines


# ---- Qwen3-TTS speech tokenizer and config (no official package needed) ----------------------------


@pytest.fixture(scope="module")
def saved_speech_tokenizer(tmp_path_factory):
    config = CODEC_PRESETS["tiny"]
    decoder, encoder = random_speech_tokenizer(config, seed=3)
    directory = tmp_path_factory.mktemp("st") / "speech_tokenizer"
    save_speech_tokenizer(directory, config, decoder, encoder)
    return directory


def _copy_speech_tokenizer(src, dst, *, config_edit=None, tensor_edit=None):
    import shutil

    shutil.copytree(src, dst)
    if config_edit:
        data = json.loads((dst / "config.json").read_text())
        config_edit(data)
        (dst / "config.json").write_text(json.dumps(data))
    if tensor_edit:
        from safetensors.torch import load_file

        tensors = load_file(str(dst / "model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_speech_tokenizer_truncated_file(saved_speech_tokenizer, tmp_path):
    directory = _copy_speech_tokenizer(saved_speech_tokenizer, tmp_path / "st")
    _truncate(directory / "model.safetensors")
    with pytest.raises(CheckpointError, match="truncated or corrupt") as info:
        load_speech_tokenizer(directory, with_encoder=False)
    assert str(directory / "model.safetensors") in str(info.value)


def test_speech_tokenizer_int_tensor_is_refused(saved_speech_tokenizer, tmp_path):
    name = "decoder.pre_conv.conv.weight"

    def to_int(tensors):
        tensors[name] = tensors[name].to(torch.int32)

    directory = _copy_speech_tokenizer(saved_speech_tokenizer, tmp_path / "st", tensor_edit=to_int)
    with pytest.raises(
        CheckpointError, match=rf"tensor '{name}' has dtype torch\.int32, expected a floating-point"
    ) as info:
        load_speech_tokenizer(directory, with_encoder=False)
    assert str(directory / "model.safetensors") in str(info.value)


def test_speech_tokenizer_typed_and_unknown_fields(saved_speech_tokenizer, tmp_path, caplog):
    def bad_type(data):
        data["decoder_config"]["hidden_size"] = "32"

    directory = _copy_speech_tokenizer(saved_speech_tokenizer, tmp_path / "typed", config_edit=bad_type)
    with pytest.raises(CheckpointError) as info:
        load_speech_tokenizer(directory, with_encoder=False)
    assert (
        str(info.value) == f"{directory / 'config.json'}: decoder_config.hidden_size must be an integer, got '32' (str)"
    )

    def extra(data):
        data["new_top_knob"] = 1
        data["decoder_config"]["new_decoder_knob"] = 2

    directory = _copy_speech_tokenizer(saved_speech_tokenizer, tmp_path / "extra", config_edit=extra)
    with caplog.at_level(logging.WARNING, logger=FIELDS_LOGGER):
        load_speech_tokenizer(directory, with_encoder=False)
    text = " | ".join(r.getMessage() for r in caplog.records if r.name == FIELDS_LOGGER)
    assert str(directory / "config.json") in text
    assert "new_top_knob" in text and "decoder_config.new_decoder_knob" in text
    # what save_speech_tokenizer (the official form) writes is all known: nothing else logged
    assert "architectures" not in text and "hidden_act" not in text


def test_speech_tokenizer_config_round_trip_logs_nothing(caplog):
    with caplog.at_level(logging.WARNING, logger=FIELDS_LOGGER):
        SpeechTokenizerConfig.from_dict(CODEC_PRESETS["tiny"].to_dict(), source="/x/st-roundtrip.json")
    assert not [r for r in caplog.records if r.name == FIELDS_LOGGER]


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (
            lambda d: d["talker_config"].update(hidden_size="32"),
            "talker_config.hidden_size must be an integer, got '32' (str)",
        ),
        (
            lambda d: d["talker_config"]["code_predictor_config"].update(num_attention_heads=[4]),
            "talker_config.code_predictor_config.num_attention_heads must be an integer, got [4] (list)",
        ),
        (
            lambda d: d["talker_config"].update(rms_norm_eps="1e-6"),
            "talker_config.rms_norm_eps must be a number, got '1e-6' (str)",
        ),
        (
            lambda d: d["talker_config"].update(codec_bos_id=41.0),
            "talker_config.codec_bos_id must be an integer, got 41.0 (float)",
        ),
        (lambda d: d.update(tts_pad_token_id="1"), "tts_pad_token_id must be an integer, got '1' (str)"),
    ],
)
def test_qwen3_config_wrongly_typed_field_names_key_and_type(edit, expected):
    data = preset_config_dict("qwen3-tts-tiny")
    edit(data)
    with pytest.raises(ValueError) as info:
        Qwen3TTSConfig.from_dict(data)
    assert str(info.value) == expected


def test_qwen3_config_unknown_fields_logged_per_section(caplog):
    data = preset_config_dict("qwen3-tts-tiny")
    data["top_knob"] = 1
    data["talker_config"]["talker_knob"] = 2
    data["talker_config"]["code_predictor_config"]["predictor_knob"] = 3
    data["talker_config"]["code_predictor_config"]["architectures"] = ["X"]  # HF generic: not logged
    with caplog.at_level(logging.WARNING, logger=FIELDS_LOGGER):
        Qwen3TTSConfig.from_dict(data, source="/x/qwen3.json")
        Qwen3TTSConfig.from_dict(data, source="/x/qwen3.json")
    lines = [r.getMessage() for r in caplog.records if r.name == FIELDS_LOGGER]
    text = " | ".join(lines)
    assert len(lines) == 3, lines  # one line per section, and only the first parse of the file logs
    assert all("/x/qwen3.json" in m for m in lines)
    for name in ("top_knob", "talker_config.talker_knob", "talker_config.code_predictor_config.predictor_knob"):
        assert name in text
    assert "architectures" not in text
