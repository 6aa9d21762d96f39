"""`python -m tilevox.engine_builder.regions` compiles shape-only (meta) models and writes a loadable tile graph."""

from __future__ import annotations

import json

import pytest

from tilevox.engine_builder.regions import H200, load_tile_graph, simulate
from tilevox.engine_builder.regions.__main__ import main


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "llama-tiny", "--region", "decoder_step", "--batch", "3", "--max-context", "300"],
        [
            "--model",
            "random:llama-tiny",
            "--region",
            "decoder_step",
            "--layers",
            "1-2",
            "--batch",
            "2",
            "--max-context",
            "64",
        ],
        [
            "--model",
            "qwen3-tts-tiny",
            "--region",
            "code_predictor_loop",
            "--batch",
            "2",
            "--policy",
            "round_robin",
            "--check",
        ],
        ["--model", "qwen3-tts-tiny", "--region", "talker_step", "--batch", "1", "--max-context", "50"],
        [
            "--model",
            "random:nh-tts-tiny",
            "--region",
            "nh_decoder_step",
            "--batch",
            "2",
            "--max-context",
            "40",
            "--check",
        ],
    ],
)
def test_cli_writes_a_tile_graph(argv, tmp_path, capsys):
    out = tmp_path / "graph.json"
    assert main([*argv, "--num-sms", "7", "--out", str(out)]) == 0
    summary = json.loads(capsys.readouterr().out)
    program = load_tile_graph(out)
    assert len(program.queues) == 7
    assert summary["num_instructions"] == len(program.instructions) > 0
    assert summary["predicted_time_us"] == pytest.approx(simulate(program, H200).makespan_s * 1e6, abs=0.01)


def test_cli_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown preset"):
        main(["--model", "gpt-2", "--region", "decoder_step"])
    with pytest.raises(ValueError, match="does not apply"):
        main(["--model", "llama-tiny", "--region", "code_predictor_loop", "--max-context", "8"])
    with pytest.raises(ValueError, match="compiled whole"):
        main(["--model", "qwen3-tts-tiny", "--region", "code_predictor_loop", "--layers", "0-1"])
    with pytest.raises(ValueError, match="FIRST-STOP"):
        main(["--model", "llama-tiny", "--region", "decoder_step", "--layers", "1:2"])


def test_llama_1b_means_the_llasa_network_here_too(capsys):
    """The preset llama-1b is Llasa-1B everywhere: its decoder_step region has Llasa's 193,800-token head."""
    main(["--model", "llama-1b", "--region", "decoder_step", "--layers", "0-1", "--max-context", "64"])
    from tilevox.models.registry import meta_regions

    network = meta_regions("llama-1b")["decoder_step"]
    assert network.decoder_view().heads[0].shape[0] == 193800


def test_llama_3_2_1b_compiles_with_its_tied_table(capsys):
    """llama-3.2-1b's decoder_step (Llama-3.2-1B: 128,256 tokens, head tied to the embedding table) compiles
    whole: one tensor is both the EMBED gather's table and the head, and the weight bytes read per step are the
    head once plus one embedding row per stream, as for an untied network (the tie changes what is stored,
    not what a step reads)."""
    batch = 2
    assert (
        main(["--model", "llama-3.2-1b", "--region", "decoder_step", "--batch", str(batch), "--max-context", "64"]) == 0
    )
    summary = json.loads(capsys.readouterr().out)
    from tilevox.models.registry import meta_regions

    network = meta_regions("llama-3.2-1b")["decoder_step"]
    view = network.decoder_view()
    assert view.heads[0] is view.embed_tables[0] and view.heads[0].shape == (128256, 2048)
    matrices = sum(p.numel() for n, p in network.named_parameters() if n.endswith("proj.weight"))
    assert summary["weight_bytes"] == 2 * (matrices + 128256 * 2048 + batch * 2048)
