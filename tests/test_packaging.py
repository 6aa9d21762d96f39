"""Packaging: one installable `tilevox` that carries its CUDA sources and its own Riva gRPC stubs.

Fast: the generated Riva modules (server/riva_proto/) are current, load on the dependency floors that
pyproject.toml declares, and are byte-identical to nvidia-riva-client's descriptors (both load in one
process); the server imports no `riva`; the kernel build writes where TILEVOX_KERNELS_LIB says and
names the fix when it cannot write; qwen-tts imports without torchaudio; the set-up scripts only install.
Slow: the sdist and wheel built from a fresh clone's files, installed with plain pip (CPU torch first)
into a clean virtual environment, run `tilevox --help`, a tiny synth and `tilevox serve` answering
/ready and one request on each front end (scripts/smoke_serve.py, gRPC through the wheel's stubs).
pip's cache (~/.cache/pip, or $PIP_CACHE_DIR) makes reruns quick.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RIVA_PROTO = REPO / "server" / "riva_proto"
DESIGN_FOLDERS = ("trt_plugins", "models", "executor", "engine_builder", "server")


def _floor(requirement_name: str) -> tuple[int, ...]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        m = re.fullmatch(rf"{re.escape(requirement_name)}>=([\d.]+)", dep)
        if m:
            return tuple(int(x) for x in m.group(1).split("."))
    raise AssertionError(f"pyproject.toml has no `{requirement_name}>=X.Y.Z` dependency: {deps}")


def test_riva_stubs_are_current():
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip(
            "grpcio-tools is not installed (pip install grpcio-tools): cannot regenerate the Riva stubs to compare"
        )
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gen_riva_proto.py"), "--check"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_riva_stubs_load_on_the_declared_dependency_floors():
    # Generated code refuses a protobuf/grpcio runtime older than its generator's: the stamps must not
    # exceed what pyproject.toml promises (regenerating with a newer grpcio-tools raises them).
    for name in ("riva_audio_pb2.py", "riva_common_pb2.py", "riva_tts_pb2.py"):
        text = (RIVA_PROTO / name).read_text()
        m = re.search(r"Domain\.PUBLIC,\n\s*(\d+),\n\s*(\d+),\n\s*(\d+),", text)
        assert m, f"{name}: no protobuf version stamp"
        assert tuple(map(int, m.groups())) <= _floor("protobuf"), f"{name} needs protobuf {'.'.join(m.groups())}"
    m = re.search(
        r"^GRPC_GENERATED_VERSION = '([\d.]+)'$", (RIVA_PROTO / "riva_tts_pb2_grpc.py").read_text(), re.MULTILINE
    )
    assert m and tuple(map(int, m.group(1).split("."))) <= _floor("grpcio"), m


def test_riva_stubs_are_byte_identical_to_nvidia_riva_client():
    # protobuf's pool is process-global: the stock client's modules and ours register the same file
    # names, which it accepts only for identical descriptors (tests/server/test_grpc.py needs both).
    pytest.importorskip(
        "riva.client.proto",
        reason="nvidia-riva-client (requirements/riva-client-nodeps.txt) is the stock client to compare with",
    )
    from riva.client.proto import riva_audio_pb2 as their_audio
    from riva.client.proto import riva_common_pb2 as their_common
    from riva.client.proto import riva_tts_pb2 as their_tts

    from tilevox.server.riva_proto import riva_audio_pb2, riva_common_pb2, riva_tts_pb2

    for ours, other in ((riva_audio_pb2, their_audio), (riva_common_pb2, their_common), (riva_tts_pb2, their_tts)):
        assert ours.DESCRIPTOR.name == other.DESCRIPTOR.name
        assert ours.DESCRIPTOR.serialized_pb == other.DESCRIPTOR.serialized_pb, ours.DESCRIPTOR.name
    request = their_tts.SynthesizeSpeechRequest(
        text="hi", custom_configuration={"seed": "3"}, enable_word_time_offsets=True
    )
    assert riva_tts_pb2.SynthesizeSpeechRequest.FromString(request.SerializeToString()) == request


def test_server_imports_no_riva_package():
    code = (
        "import sys, tilevox.server.app, tilevox.server.grpc_service, tilevox.server.cli\n"
        "bad = sorted(m for m in sys.modules if m == 'riva' or m.startswith('riva.'))\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_kernel_build_writes_where_tilevox_kernels_lib_says_and_names_the_fix(tmp_path, monkeypatch, capsys):
    from tilevox.trt_plugins import build

    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    monkeypatch.setenv("TILEVOX_KERNELS_LIB", str(not_a_dir / build.LIBRARY_NAME))
    assert build.main([]) == 1
    err = capsys.readouterr().err
    assert str(not_a_dir) in err and "TILEVOX_KERNELS_LIB=" in err, err


@pytest.mark.oracle
def test_qwen_tts_imports_with_torchaudio_absent():
    if importlib.util.find_spec("qwen_tts") is None:  # (importing it here would need torchaudio)
        pytest.skip("the official qwen-tts==0.1.1 package is needed (requirements/oracle-nodeps.txt)")
    code = (
        "import sys\n"
        "sys.modules['torchaudio'] = None  # as if not installed: import fails, find_spec gives None\n"
        "from oracle_checkpoints import _import_qwen_tts\n"
        "_import_qwen_tts()\n"
        "from qwen_tts.core.models import Qwen3TTSForConditionalGeneration\n"
        "left = {m: sys.modules[m] for m in sys.modules if m.split('.')[0] == 'torchaudio'}\n"
        "assert left == {'torchaudio': None}, left\n"
    )
    env = os.environ | {"PYTHONPATH": str(REPO / "tests" / "models" / "qwen3_tts")}
    proc = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120, cwd=REPO, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_setup_scripts_change_no_installed_files():
    for script in ("setup_cpu.sh", "install_cpu_torch.sh"):
        text = (REPO / "scripts" / script).read_text()
        commands = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        for needle in ("site-packages", "getsitepackages", "unlink", "rm ", "mv ", "sed -i"):
            assert needle not in commands, f"scripts/{script} edits files ({needle!r})"


# ---------------------------------------------------------------- the wheel in a clean environment


def _clone_files() -> list[str]:
    """The files a fresh clone of this checkout has (tracked, and new files not ignored), that exist."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout and git to list a fresh clone's files")
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
        timeout=60,
    ).stdout.decode()
    return sorted(f for f in set(out.split("\0")) if f and (REPO / f).is_file())


def _run(cmd: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, check=False, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_wheel_installs_and_serves_in_a_clean_venv(tmp_path):
    files = _clone_files()
    src = tmp_path / "src"
    for f in files:
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / f, src / f)
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PIP_NO_CACHE_DIR", "TILEVOX_API_KEY")
    }
    env |= {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "OMP_NUM_THREADS": "1"}
    work = tmp_path / "work"  # cwd of everything below: the checkout's tilevox/ folder must not shadow the install
    work.mkdir()

    # sdist, then the wheel built from the sdist (so the sdist is checked too)
    _run([sys.executable, "-m", "build", "--outdir", str(tmp_path / "dist"), str(src)], env, work, 180)
    (wheel,) = (tmp_path / "dist").glob("tilevox-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        top_level = zf.read(next(n for n in names if n.endswith(".dist-info/top_level.txt"))).decode().split()
    assert top_level == ["tilevox"]
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"tilevox"}
    # every file of the design folders ships (the CUDA sources and data included), and no build output
    shipped = [f for f in files if f.split("/")[0] in DESIGN_FOLDERS]
    missing = [f for f in shipped if f"tilevox/{f}" not in names]
    assert not missing, f"files missing from the wheel: {missing}"
    assert any(n.startswith("tilevox/trt_plugins/csrc/") and n.endswith(".cu") for n in names)
    assert not [n for n in names if n.endswith((".so", ".o"))]

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], env, work, 120)
    py, tilevox = venv / "bin" / "python", venv / "bin" / "tilevox"
    _run(["bash", str(src / "scripts" / "install_cpu_torch.sh"), str(py)], env, work, 240)
    _run([str(py), "-m", "pip", "install", "--quiet", str(wheel)], env, work, 240)

    where = _run(
        [
            str(py),
            "-c",
            "import importlib.util, tilevox; print(tilevox.__file__); print(importlib.util.find_spec('riva'))",
        ],
        env,
        work,
        60,
    )
    location, riva = where.stdout.split()
    assert location.startswith(str(venv)) and riva == "None", where.stdout
    help_text = _run([str(tilevox), "--help"], env, work, 60).stdout
    assert "serve" in help_text and "synth" in help_text
    num_cu = sum(1 for f in files if f.startswith("trt_plugins/csrc/") and f.endswith(".cu"))
    _run(
        [
            str(py),
            "-c",
            f"from tilevox.trt_plugins.build import list_sources; assert len(list_sources()) == {num_cu}, list_sources()",
        ],
        env,
        work,
        60,
    )

    wav = work / "hello.wav"
    _run(
        [
            str(tilevox),
            "synth",
            "--model",
            "random:llama-tiny",
            "--text",
            "Hello there",
            "--out",
            str(wav),
            "--max-duration",
            "0.5",
            "--device",
            "cpu",
            "--quiet",
        ],
        env,
        work,
        120,
    )
    assert wav.read_bytes()[:4] == b"RIFF" and wav.stat().st_size > 44

    serve = subprocess.Popen(
        [
            str(tilevox),
            "serve",
            "--model",
            "random:llama-tiny",
            "--device",
            "cpu",
            "--host",
            "127.0.0.1",
            "--http-port",
            "0",
            "--grpc-port",
            "0",
        ],
        env=env,
        cwd=work,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ports = None
        for (
            line
        ) in serve.stderr:  # JSON logs, then "tilevox: serving ... on http://H:P and grpc H:Q" once bound and ready
            m = re.search(r"on http://127\.0\.0\.1:(\d+) and grpc 127\.0\.0\.1:(\d+)", line)
            if m:
                ports = m.groups()
                break
        assert ports, f"tilevox serve exited {serve.poll()} before serving"
        smoke = _run(
            [
                str(py),
                str(src / "scripts" / "smoke_serve.py"),
                "--http-port",
                ports[0],
                "--grpc-port",
                ports[1],
                "--wait",
                "60",
            ],
            env,
            work,
            180,
        )
        assert '"websocket"' in smoke.stdout and '"grpc"' in smoke.stdout, smoke.stdout
    finally:
        serve.send_signal(signal.SIGTERM)
        try:
            serve.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.communicate()
    assert serve.returncode == 0, f"tilevox serve exited {serve.returncode} after SIGTERM"
