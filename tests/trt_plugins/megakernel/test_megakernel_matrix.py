"""The megakernel verification scripts: benchmarks/megakernel_correctness.py (the correctness matrix against
an fp32 PyTorch reference) and benchmarks/megakernel_h200.py (megakernel vs conventional timings).

On CPU both run with the tiny models through the VM executor: the checks pass, can fail (zero tolerance),
the byte counts equal an independent count from the parameters, and Dynamo traces both conventional
paths without a graph break. On a GPU a reduced correctness matrix runs the CUDA megakernel on Llama-1B.
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch


def _load(name: str):
    """The benchmarks package sits at the repository root, where pytest runs (README: `python -m pytest`)."""
    return importlib.import_module(f"benchmarks.{name}")


@pytest.fixture(scope="module")
def correctness():
    return _load("megakernel_correctness")


@pytest.fixture(scope="module")
def bench():
    return _load("megakernel_h200")


VM_ARGS = [
    "--variant",
    "llama-tiny",
    "--device",
    "cpu",
    "--executor",
    "vm",
    "--num-sms",
    "5",
    "--batches",
    "1,3",
    "--contexts",
    "2,9",
    "--steps",
    "4",
    "--check-batch",
    "3",
    "--check-context",
    "9",
    "--check-steps",
    "3",
]


def test_correctness_matrix_on_the_vm_passes_with_bf16_tolerances(correctness, tmp_path, capsys):
    out = tmp_path / "matrix.json"
    assert correctness.main([*VM_ARGS, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] is True and report["complete"] is True
    assert [(c["batch"], c["context"]) for c in report["cells"]] == [(1, 2), (1, 9), (3, 2), (3, 9)]
    for cell in report["cells"]:
        assert cell["passed"] and cell["hard_mismatches"] == 0 and cell["self_argmax_violations"] == 0
        assert cell["tokens_compared"] == 4 * cell["batch"]
        # bf16 activations against an fp32 reference: never exact, and well inside the bound.
        assert 0 < cell["max_abs_logit_diff"] and cell["worst_diff_over_bound"] < 0.7
        assert cell["near_ties"] == cell["mismatches"]
        assert cell["bf16_conventional"]["max_abs_logit_diff"] > 0
        assert cell["context_per_row"] == [max(1, cell["context"] - min(2, cell["batch"] - 1)), cell["context"]]
    split = report["split_regions"]
    assert split["passed"] and split["bitwise_equal_steps"] == 3 and split["caches_bitwise_equal"]
    assert "needs --executor cuda" in report["cuda_graph_replay"]["skipped"]
    assert {"device", "date_utc", "commit", "torch_version", "reference", "tolerance"} <= set(report)
    assert "overall: PASS" in capsys.readouterr().out


def test_correctness_matrix_fails_at_zero_tolerance(correctness, tmp_path):
    """The checker can fail: bf16 logits are never within 0 of the fp32 reference."""
    out = tmp_path / "matrix.json"
    args = [*VM_ARGS, "--batches", "3", "--contexts", "9", "--atol", "0", "--rtol", "0", "--no-bf16-baseline"]
    assert correctness.main([*args, "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["passed"] is False
    (cell,) = report["cells"]
    assert not cell["logits_ok"] and not cell["passed"] and "bf16_conventional" not in cell
    # At zero tolerance a near-tie is impossible: every token mismatch is a failure.
    assert cell["near_ties"] == 0 and cell["hard_mismatches"] == cell["mismatches"]


def test_a_raising_cell_is_recorded_as_failed_and_the_matrix_goes_on(correctness, tmp_path, monkeypatch):
    """A megakernel error (watchdog, fault) in one cell fails that cell; the other cells still run."""
    real = correctness._run_cell

    def flaky(model, ref_model, b, context, *rest):
        if context == 2:
            raise RuntimeError("megakernel watchdog: queue 3 position 7")
        return real(model, ref_model, b, context, *rest)

    monkeypatch.setattr(correctness, "_run_cell", flaky)
    out = tmp_path / "matrix.json"
    assert correctness.main([*VM_ARGS, "--batches", "3", "--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert report["complete"] is True and report["passed"] is False
    bad, good = report["cells"]
    assert bad == {
        "batch": 3,
        "context": 2,
        "error": "RuntimeError: megakernel watchdog: queue 3 position 7",
        "passed": False,
    }
    assert good["context"] == 9 and good["passed"] is True
    assert report["split_regions"]["passed"] is True


def test_step_stats_classify_near_ties_and_failures(correctness):
    """Row 0 picks the runner-up at a gap within the bound (near-tie), row 1 at a gap beyond it
    (failure), row 2 agrees, row 3's token is not even an argmax of its own logits."""
    ref = torch.tensor([[1.0, 0.95, 0.0], [1.0, 0.0, 0.2], [0.0, 2.0, 0.1], [0.5, 0.0, 0.1]])
    mk_logits = torch.tensor([[0.96, 0.99, 0.0], [1.0, 0.0, 1.05], [0.0, 2.0, 0.1], [0.5, 0.0, 0.1]])
    mk_tokens = torch.tensor([1, 2, 1, 2])
    tol = correctness.Tolerance(atol=0.1, rtol=0.0)
    stats = correctness.step_stats(mk_logits, mk_tokens, ref, None, tol)
    values = dict(zip(correctness.STEP_FIELDS, stats.tolist(), strict=True))
    assert values["bound"] == pytest.approx(0.1)
    assert values["mismatches"] == 3 and values["near_ties"] == 1 and values["hard_mismatches"] == 2
    assert values["self_argmax_violations"] == 1
    assert values["max_abs_diff"] == pytest.approx(0.85)
    assert values["max_mismatch_gap"] == pytest.approx(0.8)


def _independent_llama_bytes(model) -> int:
    """Every parameter once, except an untied embedding table (one row per stream is read instead)."""
    total = sum(p.numel() for p in model.parameters())  # a tied table appears once
    if not model.config.tie_word_embeddings:
        total -= model.model.embed_tokens.weight.numel()
    return total * model.dtype.itemsize


def test_benchmark_smoke_on_cpu_with_the_vm(bench, tmp_path):
    """Both Llama variants' tiny twins and the tiny Qwen3-TTS, eager megakernel (VM) and conventional,
    plus torch.compile with the eager backend at batch 1: fullgraph tracing, so a graph break fails."""
    out = tmp_path / "bench.json"
    args = [
        "--device",
        "cpu",
        "--executor",
        "vm",
        "--llama-variants",
        "llama-tiny,llama-tiny-tied",
        "--qwen-preset",
        "qwen3-tts-tiny",
        "--batches",
        "1,2",
        "--iters",
        "1",
        "--warmup",
        "3",
        "--compile-backend",
        "eager",
        "--compile-batches",
        "1",
        "--context",
        "7",
        "--qwen-context",
        "5",
        "--out",
        str(out),
    ]
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    assert {"device", "date_utc", "commit", "torch_version", "copy_bandwidth_gbs"} <= set(report)
    rows = {(r["variant"], r["batch"]): r for r in report["rows"]}
    assert set(rows) == {(v, b) for v in ("llama-tiny", "llama-tiny-tied", "qwen3-tts-tiny") for b in (1, 2)}
    for (variant, batch), row in rows.items():
        assert row["megakernel_eager"]["ms"] > 0 and row["conventional_eager"]["ms"] > 0
        assert "CUDA" in row["conventional_graph"]["skipped"]
        compiled, regional = row["conventional_compiled"], row["conventional_regional"]
        if batch == 1:
            assert compiled["ms"] > 0 and compiled["graph_breaks"] == 0, compiled
            # Regional: every decoder layer (Llama: 2; Qwen: 2 talker + 2 predictor layers), no graph break.
            assert regional["ms"] > 0 and regional["graph_breaks"] == 0 and not regional["captured"], regional
            assert regional["blocks_compiled"] == (2 if variant.startswith("llama") else 4)
        else:
            assert "--compile-batches" in compiled["skipped"] and "--compile-batches" in regional["skipped"]
        if variant.startswith("llama-tiny"):
            agreement = row["agreement_one_step"]
            assert agreement["max_abs_logit_diff"] < 0.1 * agreement["max_abs_logit"]
        else:
            assert row["agreement_one_frame"]["max_abs_hidden_diff"] < 0.1

    from benchmarks.megakernel_conventional import LLAMA_VARIANTS, o1_random_llama, random_talker

    for variant in ("llama-tiny", "llama-tiny-tied"):
        model = o1_random_llama(LLAMA_VARIANTS[variant], seed=0, device="cpu", dtype=torch.bfloat16)
        b = rows[(variant, 2)]["bytes"]
        assert b["weight_bytes"] == _independent_llama_bytes(model)
        c = model.config
        assert b["kv_bytes"] == 2 * 8 * c.num_hidden_layers * 2 * c.num_key_value_heads * c.resolved_head_dim * 2

    talker = random_talker("qwen3-tts-tiny", seed=0, device="cpu", dtype=torch.bfloat16)
    size = talker.codec_head.weight.itemsize
    stack_params = sum(p.numel() for p in talker.model.layers.parameters()) + talker.model.norm.weight.numel()
    predictor = talker.code_predictor
    pred_stack = sum(p.numel() for p in predictor.model.layers.parameters()) + predictor.model.norm.weight.numel()
    proj = sum(p.numel() for p in predictor.small_to_mtp_projection.parameters())
    heads = sum(p.numel() for p in predictor.lm_head.parameters())
    b = rows[("qwen3-tts-tiny", 1)]["bytes"]
    assert b["talker_weight_bytes"] == (stack_params + talker.codec_head.weight.numel()) * size
    assert b["predictor_weight_bytes"] == (predictor.num_steps * (pred_stack + proj) + heads) * size


def test_regional_compile_covers_the_decoder_layers_and_is_undone(bench):
    """repeated_blocks finds the decoder layers (not the predictor's heads or embedding tables, leaf modules),
    and regionally_compiled compiles them for its duration only."""
    from benchmarks.megakernel_conventional import LLAMA_VARIANTS, o1_random_llama, random_talker

    talker = random_talker("qwen3-tts-tiny", seed=0, device="cpu", dtype=torch.bfloat16)
    layers = [*talker.model.layers, *talker.code_predictor.model.layers]
    assert [id(b) for b in bench.repeated_blocks(talker)] == [id(b) for b in layers]
    llama = o1_random_llama(LLAMA_VARIANTS["llama-tiny"], seed=0, device="cpu", dtype=torch.bfloat16)
    with bench.regionally_compiled(llama, "eager") as count:
        assert count == llama.config.num_hidden_layers
        assert all(block._compiled_call_impl is not None for block in bench.repeated_blocks(llama))
    assert all(block._compiled_call_impl is None for block in bench.repeated_blocks(llama))
    with pytest.raises(ValueError, match="no repeated blocks"):
        with bench.regionally_compiled(torch.nn.Linear(2, 2), "eager"):
            pass


def test_regional_compile_of_more_layers_than_the_recompile_limit(bench):
    """A 12-layer Llama (its attention reads an int attribute, layer_idx: one compile per layer) compiles
    regionally under fullgraph with the recompile limit as a hard failure, and gives decode's logits."""
    import dataclasses

    from benchmarks.megakernel_conventional import LLAMA_VARIANTS, o1_random_llama

    # Dynamo's default limit (other tests in a run raise it), a hit as a hard failure, for this test only
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8):
        torch._dynamo.reset()
        config = dataclasses.replace(LLAMA_VARIANTS["llama-tiny"], num_hidden_layers=12)
        assert config.num_hidden_layers > torch._dynamo.config.recompile_limit
        llama = o1_random_llama(config, seed=0, device="cpu", dtype=torch.float32)
        caches = [llama.new_cache(max_streams=2, max_seq_len=32) for _ in range(2)]
        for cache in caches:
            for slot in range(2):
                cache.allocate()
                llama.prefill(cache, slot, torch.tensor([1, 2, 3]))
        want = llama.decode(caches[0], [0, 1], torch.tensor([4, 5]))
        with bench.regionally_compiled(llama, "eager") as count:
            got = llama.decode(caches[1], [0, 1], torch.tensor([4, 5]))
    assert count == 12
    torch.testing.assert_close(got, want)


def test_compile_scope_selects_the_columns(bench, tmp_path):
    out = tmp_path / "bench.json"
    args = ["--device", "cpu", "--executor", "vm", "--llama-variants", "llama-tiny", "--qwen-preset", "none"]
    args += ["--batches", "1", "--iters", "1", "--warmup", "3", "--compile-backend", "eager", "--context", "5"]
    assert bench.main([*args, "--compile-scope", "regional", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["conventional_compiled"] == {"skipped": "--compile-scope regional"}
    assert row["conventional_regional"]["ms"] > 0 and row["speedup_vs_conventional_regional"] > 0
    with pytest.raises(SystemExit):
        bench.parse_args([*args, "--compile-scope", "partial", "--out", str(out)])


def test_benchmark_records_a_megakernel_error_and_goes_on(bench, tmp_path, monkeypatch):
    """A megakernel that faults at batch 2: that row's megakernel columns hold the error, its
    conventional columns and the other rows still have times, and the table lists the error."""
    real = bench.Launcher.launch

    def faulty(self):
        if self.program.constants.batch_size == 2:
            raise RuntimeError("megakernel index out of range: queue 1 position 4")
        return real(self)

    monkeypatch.setattr(bench.Launcher, "launch", faulty)
    out = tmp_path / "bench.json"
    args = [
        "--device",
        "cpu",
        "--executor",
        "vm",
        "--llama-variants",
        "llama-tiny",
        "--qwen-preset",
        "none",
        "--batches",
        "1,2",
        "--iters",
        "1",
        "--warmup",
        "3",
        "--no-compile",
        "--context",
        "5",
        "--out",
        str(out),
    ]
    assert bench.main(args) == 0
    ok, bad = json.loads(out.read_text())["rows"]
    assert ok["megakernel_eager"]["ms"] > 0 and ok["speedup_vs_conventional_eager"] > 0
    message = "RuntimeError: megakernel index out of range: queue 1 position 4"
    assert bad["megakernel_eager"] == bad["megakernel_graph"] == {"error": message}
    assert bad["agreement_one_step"] == {"error": message}
    assert bad["conventional_eager"]["ms"] > 0 and bad["speedup_vs_conventional_eager"] is None


@pytest.mark.gpu
@pytest.mark.requires_megakernel
def test_reduced_correctness_matrix_on_the_gpu(correctness, tmp_path):
    """Llama-3.2-1B shapes (tied head), batches 1 and 7, contexts 1 and 300, 8 steps, plus the split and
    CUDA-graph checks: the CUDA megakernel against the fp32 reference."""
    out = tmp_path / "matrix.json"
    rc = correctness.main(
        [
            "--variant",
            "llama-3.2-1b",
            "--batches",
            "1,7",
            "--contexts",
            "1,300",
            "--steps",
            "8",
            "--check-batch",
            "7",
            "--check-context",
            "300",
            "--check-steps",
            "4",
            "--out",
            str(out),
        ]
    )
    report = json.loads(out.read_text())
    failed = [c for c in report["cells"] if not c["passed"]]
    assert rc == 0 and report["passed"], json.dumps(
        {"failed_cells": failed, "split": report["split_regions"], "graph": report["cuda_graph_replay"]}
    )
    assert report["cuda_graph_replay"]["passed"] is True and report["split_regions"]["passed"] is True


@pytest.mark.gpu
@pytest.mark.requires_megakernel
def test_benchmark_smoke_on_the_gpu(bench, tmp_path):
    """Tiny models through the CUDA megakernel: every eager and CUDA-graph variant yields a time."""
    out = tmp_path / "bench.json"
    assert (
        bench.main(
            [
                "--llama-variants",
                "llama-tiny-tied",
                "--qwen-preset",
                "qwen3-tts-tiny",
                "--batches",
                "1,3",
                "--iters",
                "5",
                "--no-compile",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    for row in json.loads(out.read_text())["rows"]:
        for name in ("megakernel_eager", "megakernel_graph", "conventional_eager", "conventional_graph"):
            assert row[name].get("ms", 0) > 0, (row["variant"], row["batch"], name, row[name])


@pytest.mark.gpu
@pytest.mark.requires_megakernel
def test_regional_compile_is_captured_on_the_gpu(bench, tmp_path):
    """Inductor-compiled decoder layers inside one captured CUDA graph of the conventional step (tiny models):
    no graph break, no recompile inside the capture (it would fail the capture), a time."""
    out = tmp_path / "bench.json"
    args = ["--llama-variants", "llama-tiny-tied", "--qwen-preset", "qwen3-tts-tiny", "--batches", "1"]
    assert bench.main([*args, "--iters", "5", "--compile-scope", "regional", "--out", str(out)]) == 0
    for row in json.loads(out.read_text())["rows"]:
        regional = row["conventional_regional"]
        assert regional.get("ms", 0) > 0 and regional["captured"] and regional["graph_breaks"] == 0, regional
