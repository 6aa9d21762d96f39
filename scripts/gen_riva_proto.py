"""Generate tilevox's Riva TTS protobuf/gRPC modules (server/riva_proto/) from the .proto files there.

    python scripts/gen_riva_proto.py           # rewrite server/riva_proto/*_pb2*.py
    python scripts/gen_riva_proto.py --check   # exit 1 if they differ from what the .proto files give

Needs grpcio-tools (`pip install grpcio-tools`). The committed modules were generated with
grpcio-tools==1.81.0 so that they load on protobuf >= 6.33.5 and grpcio >= 1.81.0 (generated code
refuses an older runtime than the generator's), the floors in pyproject.toml. To regenerate them with
that version without touching an environment's protobuf:

    pip install --no-deps --target /tmp/grpcio-tools-1.81 grpcio-tools==1.81.0
    PYTHONPATH=/tmp/grpcio-tools-1.81 python scripts/gen_riva_proto.py

`--check` ignores the generator's version stamps (they are the only lines that differ between
grpcio-tools releases), so any installed grpcio-tools can check that the modules are current.

The .proto files keep their upstream paths (`riva/proto/riva_tts.proto`, package `nvidia.riva.tts`) so
that the descriptors registered in protobuf's global pool are byte-identical to those of the
nvidia-riva-client wheel: the pool accepts an identical file twice, so tilevox's server and the stock
Riva client can be imported in one process. Imports between the generated modules are made relative
(as nvidia-riva-client does) so that they never import the `riva` package.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE_DIR = REPO / "server" / "riva_proto"
PROTO_ROOT = PACKAGE_DIR / "protos"
PACKAGE = "tilevox.server.riva_proto"
PROTOS = ("riva/proto/riva_audio.proto", "riva/proto/riva_common.proto", "riva/proto/riva_tts.proto")
# Only riva_tts has a service; the *_pb2_grpc modules of the other two would be empty.
OUTPUTS = ("riva_audio_pb2.py", "riva_common_pb2.py", "riva_tts_pb2.py", "riva_tts_pb2_grpc.py")

_STAMPS = (
    (re.compile(r"^# Protobuf Python Version: .*$", re.MULTILINE), "# Protobuf Python Version: <stamp>"),
    (
        re.compile(r"(_runtime_version\.Domain\.PUBLIC,\n)\s*\d+,\n\s*\d+,\n\s*\d+,\n"),
        r"\1    <major>,\n    <minor>,\n    <patch>,\n",
    ),
    (re.compile(r"^GRPC_GENERATED_VERSION = '.*'$", re.MULTILINE), "GRPC_GENERATED_VERSION = '<stamp>'"),
)


def _rewrite(text: str) -> str:
    """Relative imports between the generated modules, and their real module names."""
    text = re.sub(r"^from riva\.proto import (\w+_pb2) as ", r"from . import \1 as ", text, flags=re.MULTILINE)
    return re.sub(r"'riva\.proto\.(\w+_pb2)'", rf"'{PACKAGE}.\1'", text)


def without_stamps(text: str) -> str:
    """The module text with the generator's protobuf/grpc version stamps blanked out."""
    for pattern, repl in _STAMPS:
        text = pattern.sub(repl, text)
    return text


def generate() -> dict[str, str]:
    """Run protoc (grpcio-tools) on PROTOS; returns {output file name: module text}."""
    from grpc_tools import protoc  # imported here so that `--help` works without grpcio-tools

    with tempfile.TemporaryDirectory() as tmp:
        args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"--python_out={tmp}", f"--grpc_python_out={tmp}", *PROTOS]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out = Path(tmp) / "riva" / "proto"
        return {name: _rewrite((out / name).read_text()) for name in OUTPUTS}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with the committed modules; write nothing")
    args = parser.parse_args(argv)
    generated = generate()
    if args.check:
        stale = [
            name
            for name, text in generated.items()
            if not (PACKAGE_DIR / name).is_file()
            or without_stamps((PACKAGE_DIR / name).read_text()) != without_stamps(text)
        ]
        if stale:
            print(f"stale generated modules in {PACKAGE_DIR}: {', '.join(stale)}; run {sys.argv[0]}", file=sys.stderr)
            return 1
        print(f"{len(generated)} generated modules in {PACKAGE_DIR} are current")
        return 0
    for name, text in generated.items():
        (PACKAGE_DIR / name).write_text(text)
    print(f"wrote {', '.join(generated)} in {PACKAGE_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
