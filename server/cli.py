"""The `tilevox` command line: one subcommand per job (`synth`, `serve`, `voices`).

Parsing happens here only; each subcommand builds frozen config objects and calls into the
library. User mistakes (bad options, unknown models or voices, unreadable checkpoints, taken ports)
end with a one-line `tilevox: error: ...` message and exit code 2, never a traceback. Anything else
(a CUDA error, a bug) is not a user mistake: it prints its type, message and cause, the traceback
with -v, and exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

__all__ = ["main"]

log = logging.getLogger("tilevox")

RANDOM_WEIGHTS_NOTE = (
    "random weights: the audio is noise, and since no end-of-speech token is ever likely, it lasts until --max-duration"
)


class CommandError(Exception):
    """A user-facing failure: printed as one line, exit code 2."""


def _presets_epilog() -> str:
    from tilevox.models.registry import presets

    return (
        "models: a checkpoint directory, or random:<preset> with seeded random weights (noise), presets: "
        + ", ".join(presets())
        + ". List a model's voices with `tilevox voices --model M`."
    )


def _add_synth(subparsers) -> None:
    p = subparsers.add_parser("synth", help="synthesize one utterance to a WAV file", epilog=_presets_epilog())
    p.add_argument("--model", required=True, help="checkpoint directory or random:<preset> (e.g. random:llama-tiny)")
    p.add_argument("--text", required=True, help="text to speak")
    p.add_argument("--out", required=True, type=Path, help="output .wav path")
    p.add_argument("--voice", default=None, help="speaker/voice name (see the model's voices)")
    p.add_argument("--language", default=None, help="language (models that support it)")
    p.add_argument("--instructions", default=None, help="voice description (voice-design models)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=None, help="0 = greedy; default: the model's")
    p.add_argument("--max-duration", type=float, default=30.0, help="seconds of audio at most")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"], help="default: fp32 on cpu, bf16 on cuda")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="untimed runs of the same request first (graph capture, kernel selection), so that the reported "
        "time to first audio and real-time factor are the steady state's",
    )
    _add_model_options(p)
    p.set_defaults(handler=_run_synth)


def _add_model_options(p) -> None:
    """How the model is loaded and run: options shared by synth and serve."""
    from tilevox.models.region_backends import CODEC_DECODE, LLASA_REGIONS, QWEN3_TTS_REGIONS

    p.add_argument(
        "--fused-swiglu",
        default="auto",
        choices=["auto", "on", "off"],
        help="fused CUTLASS SwiGLU MLPs: auto = per shape and token count where measured faster on this GPU (Hopper, bf16), else the PyTorch path",
    )
    p.add_argument(
        "--decode-mode",
        default=None,
        choices=["exact", "official-chunked"],
        help="Qwen3-TTS codec decode of audio longer than 300 frames (24 s): exact (default) decodes every frame "
        "with its whole left context; official-chunked reproduces the official package's 300-frame chunks with "
        "25 frames of overlap (its output, sample for sample)",
    )
    p.add_argument(
        "--cuda-graphs",
        default="auto",
        choices=["auto", "on", "off"],
        help="run the model's decode regions that no megakernel runs through the executor's CUDA graphs "
        "(per batch and key-length bucket, predictor sampling on the GPU): auto = on a CUDA device; "
        "on = also on a CPU (the same code, eagerly); off = the plain PyTorch path",
    )
    p.add_argument(
        "--graph-prefill",
        default="auto",
        choices=["auto", "on", "off"],
        help="with the executor: also capture the batched prefill (Qwen3-TTS talker_prefill, Llasa "
        "decoder_prefill) in CUDA graphs, per batch and prompt-length bucket; auto = on whenever the "
        "executor runs (the serve warm-up captures the buckets of prompts up to about 500 words)",
    )
    p.add_argument(
        "--prefill-stream",
        default="off",
        choices=["on", "off"],
        help="with the executor on a GPU: prefill admissions on a CUDA stream of their own, beside the running "
        "streams' steps, which then never wait for a prefill; a new stream joins the steps once its prefill "
        "has finished (Qwen3-TTS; Llasa refuses it for now, see the README)",
    )
    p.add_argument(
        "--codec-stream",
        default="off",
        choices=["on", "off"],
        help="with the executor on a GPU: each step's codec decode on a CUDA stream of its own, overlapping the "
        "talker (decoder) step that follows it (Qwen3-TTS, Llasa)",
    )
    p.add_argument(
        "--compile",
        default="off",
        choices=["on", "off"],
        help="with the executor: compile its regions with torch.compile (Inductor) before capturing their "
        "CUDA graphs: fewer, fused kernels per frame, for minutes more start-up (compiled code is cached "
        "on disk, TORCHINDUCTOR_CACHE_DIR, so a restart is faster); the serve warm-up compiles every batch "
        "size before /ready",
    )
    p.add_argument(
        "--megakernel",
        default="none",
        metavar="REGIONS",
        help="regions run by the persistent megakernel: a comma list of the model's regions "
        f"(Llasa: {', '.join(LLASA_REGIONS)}; Qwen3-TTS: {', '.join(QWEN3_TTS_REGIONS)}, and {CODEC_DECODE}: the "
        "codec's transformer as a region inside the codec decode), all, or none; a region that cannot run there "
        "stays on the PyTorch path with a logged reason",
    )
    p.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="a plan written by `tilevox build` on this GPU: each region it covers (decoder regions, and the codec "
        "decode in plans since format 2) runs, per batch bucket, on the backend the plan chose (CUDA graph or "
        "megakernel); refused if built on another GPU, driver or kernel library; not with --megakernel",
    )
    p.add_argument(
        "--megakernel-executor",
        default="cuda",
        choices=["cuda", "vm"],
        help="cuda: the CUDA kernel (Hopper); vm: its pure-PyTorch interpreter (slow; for checking)",
    )
    _add_tiling_arg(p)


def _add_tiling_arg(p) -> None:
    p.add_argument(
        "--megakernel-tiling",
        default="",
        metavar="NAME=VALUE,...",
        help="region compiler tiling overrides (engine_builder.regions.TilingConfig fields, `on`/`off` for "
        "switches), e.g. split_qkv=on,attn_rows=16; a --plan brings the tiling it was built with instead",
    )


def _decode_mode(args: argparse.Namespace) -> str | None:
    return None if args.decode_mode is None else args.decode_mode.replace("-", "_")


def _megakernel_asked(args: argparse.Namespace) -> bool:
    return args.megakernel.strip() not in ("", "none")


def _fused_swiglu_mode(args: argparse.Namespace):
    """The fused SwiGLU swap replaces the MLP weights the megakernel regions read, so `auto` leaves it
    off when regions are asked for (`on` is honoured, and those regions then log why they cannot run)."""
    from tilevox.models.fused_swiglu import FusedSwiglu

    mode = FusedSwiglu(args.fused_swiglu)
    if mode is FusedSwiglu.AUTO and _megakernel_asked(args):
        log.info("fused SwiGLU off: --megakernel regions read the plain MLP weights")
        return FusedSwiglu.OFF
    return mode


# Warm-up text lengths in words beyond "Warm up.", doubling, so that the prompts (about a token a word for a
# BPE tokenizer, a few for a byte-level one) reach each prompt-length bucket of the captured prefill
# (executor.graphs.MIN_PROMPT_BUCKET doubling) up to the model's context or about 1,000 tokens.
WARMUP_WORDS: tuple[int, ...] = (0, 4, 8, 16, 32, 64, 128, 256, 512)


def _warmup_streams(max_streams: int) -> tuple[int, ...]:
    """The executor's batch buckets up to max_streams (and max_streams itself): the warm-up levels that
    capture every batch size's graphs before the server reports ready."""
    from tilevox.executor.graphs import BATCH_BUCKETS

    return tuple(sorted({b for b in BATCH_BUCKETS if b < max_streams} | {max_streams}))


def _install_regions(model, args: argparse.Namespace, device: str) -> bool:
    """Route the asked regions through the megakernel (unknown names are a usage error, ValueError), and
    the model's other regions through the executor's CUDA graphs as --cuda-graphs says. Returns whether
    the executor's backends were installed."""
    from tilevox.models.region_backends import executor_region_names, region_names

    if args.plan is not None:
        return _install_plan(model, args, device)
    on_megakernel: set[str] = set()
    if _megakernel_asked(args):
        from tilevox.executor.megakernel import install_megakernel_regions, parse_regions

        names = parse_regions(model, args.megakernel)
        installed = install_megakernel_regions(model, names, _megakernel_options(args))
        on_megakernel = {name for name, reason in installed.items() if reason is None}
    if args.cuda_graphs == "off" or (args.cuda_graphs == "auto" and device != "cuda"):
        for flag, value in (
            ("--compile", args.compile),
            ("--graph-prefill", args.graph_prefill),
            ("--prefill-stream", args.prefill_stream),
            ("--codec-stream", args.codec_stream),
        ):
            if value == "on":
                raise CommandError(
                    f"{flag} on changes how the executor runs its regions: it needs --cuda-graphs on (or auto on a GPU)"
                )
        return False
    from tilevox.executor import install_graph_regions

    regions = (*region_names(model), *executor_region_names(model))
    installed = install_graph_regions(
        model, [name for name in regions if name not in on_megakernel], _graph_options(args)
    )
    _install_streams(model, args)
    return any(reason is None for reason in installed.values())


def _install_streams(model, args: argparse.Namespace) -> None:
    """--prefill-stream and --codec-stream on, after the executor's regions (the prefill gets a token sampler
    of its own)."""
    from tilevox.executor import install_codec_stream, install_prefill_stream

    if args.prefill_stream == "on":
        reason = install_prefill_stream(model, _graph_options(args))
        if reason is not None:
            raise CommandError(f"--prefill-stream on: {reason}")
    if args.codec_stream == "on":
        reason = install_codec_stream(model)
        if reason is not None:
            raise CommandError(f"--codec-stream on: {reason}")


def _megakernel_options(args: argparse.Namespace):
    """The megakernel backends' options: --megakernel-executor, regions compiled by the region compiler
    (build-time code, handed to the executor's run-time backends)."""
    from tilevox.engine_builder.regions import region_compiler
    from tilevox.executor.megakernel import BackendOptions, Executor

    return BackendOptions(executor=Executor(args.megakernel_executor), compiler=region_compiler(_tiling(args)))


def _tiling(args: argparse.Namespace):
    """--megakernel-tiling as a TilingConfig (None: the defaults)."""
    from tilevox.engine_builder.regions import TilingConfig

    if not args.megakernel_tiling.strip():
        return None
    try:
        return TilingConfig.parse(args.megakernel_tiling)
    except ValueError as exc:
        raise CommandError(f"--megakernel-tiling: {exc}") from None


def _graph_options(args: argparse.Namespace):
    from tilevox.executor import GraphOptions

    return GraphOptions(compile=args.compile == "on", prefill=args.graph_prefill != "off")


def _install_plan(model, args: argparse.Namespace, device: str) -> bool:
    import torch

    from tilevox.engine_builder.build import apply_plan, provenance_here
    from tilevox.engine_builder.plan import load_plan

    if _megakernel_asked(args):
        raise CommandError("--plan chooses each region's backend: leave --megakernel out")
    if args.cuda_graphs == "off":
        raise CommandError("--plan runs through the executor: it needs --cuda-graphs on or auto")
    plan = load_plan(args.plan, here=provenance_here(torch.device(device)))
    if plan.tiling is not None and args.megakernel_tiling.strip():
        raise CommandError(
            "--plan compiles its megakernel regions with the tiling it was built with: leave --megakernel-tiling out"
        )
    dispatchers = apply_plan(
        model,
        plan,
        graphs=_graph_options(args),
        megakernel=_megakernel_options(args),
    )
    for name, dispatch in dispatchers.items():
        log.info("plan %s: region %s: %s", args.plan, name, ", ".join(f"<= {b}: {k}" for b, k, _ in dispatch.choices))
    _install_streams(model, args)
    return True


def _run_synth(args: argparse.Namespace) -> int:
    import soundfile

    from tilevox.models.registry import load_model, parse_dtype
    from tilevox.models.sampling import SamplingParams
    from tilevox.models.streaming import SynthesisRequest, synthesize

    dtype = parse_dtype(args.dtype or ("bf16" if args.device == "cuda" else "fp32"))
    if not args.text.strip():
        raise CommandError("--text is empty")
    if args.out.suffix.lower() != ".wav":
        raise CommandError(f"--out must end in .wav, got {args.out}")
    if not args.out.parent.exists():
        raise CommandError(f"--out directory {args.out.parent} does not exist")
    sampling = None if args.temperature is None else SamplingParams(temperature=args.temperature)
    request = SynthesisRequest(
        text=args.text,
        voice=args.voice,
        language=args.language,
        instructions=args.instructions,
        sampling=sampling,
        seed=args.seed,
        max_duration_s=args.max_duration,
    )
    model = load_model(
        args.model,
        device=args.device,
        dtype=dtype,
        fused_swiglu=_fused_swiglu_mode(args),
        decode_mode=_decode_mode(args),
    )
    if model.is_random:
        print(f"warning: {args.model} has {RANDOM_WEIGHTS_NOTE}", file=sys.stderr)
    _install_regions(model, args, str(args.device))
    model.validate(request)
    if args.warmup < 0:
        raise CommandError(f"--warmup must be >= 0, got {args.warmup}")
    if args.warmup:
        started = time.perf_counter()
        for _ in range(args.warmup):
            synthesize(model, request)
        print(f"warm-up: {args.warmup} untimed run(s), {time.perf_counter() - started:.2f} s", file=sys.stderr)
    from tqdm import tqdm

    with tqdm(
        total=round(args.max_duration, 2),
        unit="s",
        desc="audio",
        file=sys.stderr,
        leave=False,
        disable=args.quiet or not sys.stderr.isatty(),
        bar_format="{desc}: {n:.2f}/{total} s [{elapsed}, {rate_fmt}]",
    ) as bar:
        result = synthesize(
            model, request, on_chunk=lambda chunk: bar.update(chunk.samples.size / model.sample_rate_hz)
        )
    soundfile.write(str(args.out), result.samples, result.sample_rate_hz, subtype="PCM_16")
    print(
        f"wrote {args.out}: {result.duration_s:.2f} s at {result.sample_rate_hz} Hz, {result.num_frames} frames "
        f"({result.finish_reason.value}); time to first audio {result.time_to_first_audio_s * 1e3:.1f} ms; "
        f"real-time factor {result.real_time_factor:.3f}"
    )
    return 0


def _add_serve(subparsers) -> None:
    p = subparsers.add_parser(
        "serve", help="serve the OpenAI HTTP, Riva gRPC and WebSocket APIs", epilog=_presets_epilog()
    )
    p.add_argument(
        "--model", default=None, help="checkpoint directory or random:<preset>; default: random:llama-tiny on CPU"
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP and WebSocket port")
    p.add_argument("--grpc-port", type=int, default=50051, help="Riva gRPC port")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if visible, else cpu")
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"], help="default: fp32 on cpu, bf16 on cuda")
    p.add_argument(
        "--max-streams",
        type=int,
        default=None,
        help="concurrent streams (default: the model's limit: on a GPU, the KV-cache slots that fit in free memory "
        "beside a reserve, at most 256; see the README's serving section)",
    )
    p.add_argument(
        "--max-queued", type=int, default=None, help="streams waiting for a slot before 429 (default: max-streams)"
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require this key on every synthesis call (default: $TILEVOX_API_KEY; neither set = no auth; "
        "an empty or blank key is refused)",
    )
    p.add_argument("--max-text-chars", type=int, default=4096)
    p.add_argument(
        "--strict-voices",
        action="store_true",
        help="refuse Riva voice names that match no voice (default: serve the default voice, warn once per name)",
    )
    p.add_argument("--idle-timeout", type=float, default=30.0, help="seconds a WebSocket/gRPC stream may stay silent")
    p.add_argument(
        "--drain-timeout", type=float, default=30.0, help="seconds active streams get to finish after SIGTERM"
    )
    p.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="the interpreter's thread switch interval (sys.setswitchinterval) while serving: how long the model "
        "worker may wait for the GIL while the event loop sends audio (default: Python's, 5 ms)",
    )
    p.add_argument(
        "--newcomer-slack-ms",
        default="off",
        help="first audio first: while streams wait for their first audio, steps carry them alone as long as "
        "every playing stream has this many ms of audio buffered beyond real time (default 'off': every step "
        "carries every running stream; 200 helped Qwen3-TTS at 32 streams and hurt Llasa on the H200)",
    )
    p.add_argument(
        "--prefill-budget",
        default="off",
        choices=["on", "off"],
        help="on: a worker iteration admits fewer new streams when their prefill would make a playing stream's "
        "next audio arrive after its client's buffer has run dry (measured prefill and step times); off "
        "(default): up to 16 admissions an iteration whatever the buffers (README: what it did on the H200)",
    )
    p.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="profile this many model-worker steps (cProfile of the worker thread; on a GPU also torch.profiler's "
        "operator and kernel tables) into --profile-out, then serve on unprofiled (default 0: off)",
    )
    p.add_argument("--profile-skip", type=int, default=50, help="qualifying steps to let pass before profiling")
    p.add_argument(
        "--profile-min-batch", type=int, default=1, help="profile only steps that batch at least this many streams"
    )
    p.add_argument("--profile-out", default="tilevox-worker-profile.txt", help="where --profile-steps writes")
    ray = p.add_argument_group("Ray Serve (many GPUs and hosts behind one endpoint; README: More than one GPU)")
    ray.add_argument(
        "--ray",
        action="store_true",
        help="serve on Ray Serve ($RAY_ADDRESS, else a local Ray): one replica = one model on one GPU (or CPU); "
        "each replica's stream capacity is --max-streams, or without it what the first replica measures",
    )
    ray.add_argument("--num-replicas", type=int, default=None, help="with --ray: this many replicas (default 1)")
    ray.add_argument(
        "--autoscale", default=None, metavar="MIN:MAX", help="with --ray: autoscale between MIN and MAX replicas"
    )
    ray.add_argument(
        "--gpus-per-replica",
        type=float,
        default=None,
        help="with --ray: GPUs per replica (default 1 on cuda, 0 on cpu)",
    )
    _add_model_options(p)
    p.set_defaults(handler=_run_serve)


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else $TILEVOX_API_KEY, else None (no auth). A given but empty or blank key is an error
    (`--api-key "$KEY"` with KEY unset must not silently turn authentication off)."""
    import os

    for source, key in (("--api-key", args.api_key), ("TILEVOX_API_KEY", os.environ.get("TILEVOX_API_KEY"))):
        if key is not None:
            if not key.strip():
                raise CommandError(f"{source} is empty: give a key, or leave it unset to serve without authentication")
            return key
    return None


def _newcomer_slack_s(value: str) -> float | None:
    """--newcomer-slack-ms: milliseconds (>= 0) as seconds, or 'off' as None."""
    if value.strip().lower() == "off":
        return None
    try:
        ms = float(value)
    except ValueError:
        raise CommandError(f"--newcomer-slack-ms must be milliseconds >= 0 or 'off', got {value!r}") from None
    if not ms >= 0:
        raise CommandError(f"--newcomer-slack-ms must be milliseconds >= 0 or 'off', got {value!r}")
    return ms / 1000.0


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _run_serve_ray(args: argparse.Namespace) -> int:
    """`tilevox serve --ray ...`: the same options, served by replicas on Ray Serve (server/ray_serve.py)."""
    if not args.ray:
        raise CommandError("--num-replicas, --autoscale and --gpus-per-replica need --ray")
    try:
        from tilevox.server.ray_serve import RayOptions, parse_autoscale, run_cli, serve_args_of
    except ImportError as exc:
        raise CommandError(f"--ray needs Ray Serve: pip install 'tilevox[ray]' ({exc})") from exc
    try:
        options = RayOptions(
            serve_args=serve_args_of(args),
            num_replicas=args.num_replicas,
            autoscale=None if args.autoscale is None else parse_autoscale(args.autoscale),
            gpus_per_replica=args.gpus_per_replica,
        )
    except ValueError as exc:
        raise CommandError(str(exc)) from exc

    def on_ready() -> None:
        print(
            f"tilevox: serving on Ray Serve: http://{args.host}:{args.http_port} and grpc {args.host}:{args.grpc_port}",
            file=sys.stderr,
            flush=True,
        )

    run_cli(options, host=args.host, http_port=args.http_port, on_ready=on_ready)
    return 0


def _run_serve(args: argparse.Namespace) -> int:
    import torch

    from tilevox.models.registry import load_model, parse_dtype
    from tilevox.server.app import PortInUseError, bind_ports, serve
    from tilevox.server.config import DEFAULT_MODEL, ServerConfig
    from tilevox.server.logs import configure_logging

    if args.ray or args.num_replicas is not None or args.autoscale is not None or args.gpus_per_replica is not None:
        return _run_serve_ray(args)
    # Everything that can be checked without the model is checked before it loads (minutes on a GPU).
    if args.max_streams is not None and args.max_streams < 1:
        raise CommandError(f"--max-streams must be >= 1, got {args.max_streams}")
    if args.max_queued is not None and args.max_queued < 0:
        raise CommandError(f"--max-queued must be >= 0, got {args.max_queued}")
    if args.switch_interval_ms is not None and not args.switch_interval_ms > 0:
        raise CommandError(f"--switch-interval-ms must be > 0, got {args.switch_interval_ms}")
    api_key = _api_key(args)
    newcomer_slack_s = _newcomer_slack_s(args.newcomer_slack_ms)
    if args.model is None:
        print(f"tilevox: no --model given: serving {DEFAULT_MODEL} (random weights, noise) on CPU", file=sys.stderr)
        model_spec, device = DEFAULT_MODEL, args.device or "cpu"
    else:
        model_spec, device = args.model, args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype_name = args.dtype or ("bf16" if device == "cuda" else "fp32")
    probe = ServerConfig(
        model=model_spec,
        host=args.host,
        http_port=args.http_port,
        grpc_port=args.grpc_port,
        device=device,
        dtype=dtype_name,
        api_key=api_key,
        max_text_chars=args.max_text_chars,
        strict_voices=args.strict_voices,
        idle_timeout_s=args.idle_timeout,
        drain_timeout_s=args.drain_timeout,
        newcomer_slack_s=newcomer_slack_s,
        prefill_budget=args.prefill_budget == "on",
        profile_steps=args.profile_steps,
        profile_skip=args.profile_skip,
        profile_min_batch=args.profile_min_batch,
        profile_out=args.profile_out,
    )  # validates the options
    try:
        ports = bind_ports(args.host, args.http_port, args.grpc_port)
    except PortInUseError as exc:
        raise CommandError(str(exc)) from exc
    configure_logging(logging.INFO)
    if api_key is None and not _is_loopback(args.host):
        log.warning(
            "no API key: anyone who can reach %s:%d (HTTP) and :%d (gRPC) can use this server; "
            "set --api-key or TILEVOX_API_KEY",
            args.host,
            args.http_port,
            args.grpc_port,
        )
    model = load_model(
        model_spec,
        device=device,
        dtype=parse_dtype(dtype_name),
        fused_swiglu=_fused_swiglu_mode(args),
        decode_mode=_decode_mode(args),
    )
    if model.is_random:
        print(f"warning: {model_spec} has {RANDOM_WEIGHTS_NOTE}", file=sys.stderr)
    graphs = _install_regions(model, args, device)
    if args.max_streams is not None and args.max_streams > model.max_streams:
        raise CommandError(
            f"--max-streams {args.max_streams} exceeds what {model.model_id} supports ({model.max_streams})"
        )
    max_streams = args.max_streams or model.max_streams
    config = dataclasses.replace(
        probe,
        max_streams=max_streams,
        max_queued=max_streams if args.max_queued is None else args.max_queued,
        warmup_streams=_warmup_streams(max_streams) if graphs else (1,),
        warmup_words=WARMUP_WORDS if graphs else (0,),
    )

    def on_ready(handle) -> None:
        print(
            f"tilevox: serving {model.model_id} ({model.sample_rate_hz} Hz) on http://{args.host}:{handle.http_port} "
            f"and grpc {args.host}:{handle.grpc_port}",
            file=sys.stderr,
            flush=True,
        )

    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    serve(config, model, ports=ports, on_ready=on_ready)
    return 0


def _add_voices(subparsers) -> None:
    p = subparsers.add_parser(
        "voices", help="list a model's voices and the OpenAI / NVIDIA names mapped onto them", epilog=_presets_epilog()
    )
    p.add_argument("--model", required=True, help="checkpoint directory or random:<preset>")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=_run_voices)


def _run_voices(args: argparse.Namespace) -> int:
    import json

    from tilevox.models.registry import load_model
    from tilevox.server.voices import VoiceCatalog

    catalog = VoiceCatalog.for_model(load_model(args.model, device="cpu"))
    listed = catalog.listed()
    if args.json:
        print(json.dumps({"model": catalog.model_id, "languages": list(catalog.languages), "voices": listed}, indent=2))
        return 0
    print(f"{catalog.model_id}: languages {', '.join(catalog.languages) or '(any)'}")
    for v in listed:
        maps = f" -> {v['maps_to']}" if "maps_to" in v else ""
        print(f"  {v['id']:<40} {v['kind']}{maps}")
    return 0


def _add_bench(subparsers) -> None:
    p = subparsers.add_parser(
        "bench",
        help="load benchmark: TTFA, RTF, stalls and throughput at several stream counts (JSON + PNG)",
        description="Streaming pcm requests to POST /v1/audio/speech, closed loop (N clients back to back) or "
        "open loop (Poisson arrivals, at most N in flight), against --url or a server started with --model.",
    )
    p.add_argument("--url", default=None, help="a running server (default: start one with --model)")
    p.add_argument("--model", default="random:llama-tiny", help="model of the started server")
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="device of the started server")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG", help="an extra serve argument (repeat)")
    p.add_argument("--levels", default="1,8,32,64,128", help="comma list of stream counts")
    p.add_argument("--mode", default="closed", choices=["closed", "open"])
    p.add_argument("--rounds", type=int, default=2, help="closed loop: requests per client")
    p.add_argument(
        "--min-requests",
        type=int,
        default=8,
        help="closed loop: at least this many requests per level (more rounds at low stream counts)",
    )
    p.add_argument("--rate", type=float, default=None, help="open loop: requests per second (default: streams / 4)")
    p.add_argument("--duration", type=float, default=20.0, help="open loop: seconds of arrivals per level")
    p.add_argument("--max-duration", type=float, default=4.0, help="seconds of audio per request")
    p.add_argument("--api-key", default=None, help="default: $TILEVOX_API_KEY")
    p.add_argument("--out", type=Path, default=Path("bench.json"), help="JSON report")
    p.add_argument("--plot", type=Path, default=None, help="PNG plot (default: the JSON path with .png)")
    p.add_argument("--no-plot", action="store_true", help="JSON only (no matplotlib needed)")
    p.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import asyncio
    import contextlib
    import datetime
    import os

    import httpx

    from tilevox.server.bench import ServerProcess, run_level, write_report

    levels = [int(x) for x in args.levels.split(",")]
    if not levels or min(levels) < 1:
        raise CommandError(f"--levels must be positive stream counts, got {args.levels!r}")
    api_key = args.api_key or os.environ.get("TILEVOX_API_KEY")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        base, device = args.url, f"remote server {args.url}"
        if base is None:
            serve_args = ["--model", args.model, "--max-queued", str(2 * max(levels)), *args.serve_arg]
            if args.device:
                serve_args += ["--device", args.device]
            log_path = args.out.with_suffix(".server.log")
            server = stack.enter_context(ServerProcess(serve_args, log_path=log_path))
            base = server.base_url
            device = _device_name(args.device)
        auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
        ready = httpx.get(base + "/ready", timeout=10).json()
        model_id = httpx.get(base + "/v1/models", headers=auth, timeout=10).json()["data"][0]["id"]
        warm = httpx.post(
            base + "/v1/audio/speech",
            json={"input": "warm up", "response_format": "pcm", "max_duration_s": 0.5},
            headers=auth,
            timeout=600,
        )
        if warm.status_code != 200:
            raise CommandError(f"the warm-up request failed: {warm.status_code} {warm.text[:200]}")
        rate = int(warm.headers["x-sample-rate"])
        results = []
        for streams in levels:
            level = asyncio.run(
                run_level(
                    base,
                    streams,
                    sample_rate_hz=rate,
                    max_duration_s=args.max_duration,
                    mode=args.mode,
                    rounds=max(args.rounds, -(-args.min_requests // streams)),
                    rate_per_s=args.rate or streams / 4,
                    duration_s=args.duration,
                    api_key=api_key,
                )
            ).summary()
            results.append(level)
            print(
                f"{streams:>5} streams: TTFA p50 {level['ttfa_ms_p50']} p95 {level['ttfa_ms_p95']} ms, "
                f"RTF p50 {level['rtf_p50']}, {level['audio_s_per_s']} audio s/s, stalls {level['stalls']}, "
                f"errors {level['errors']}"
                + (
                    f" | server: step {srv['step_ms_mean']} ms x {srv['streams_per_step_mean']} streams "
                    f"({srv['step_share']:.0%} of the time), prefill {srv['prefill_ms_mean']} ms "
                    f"x {srv['admissions_per_prefill_mean']} ({srv['prefill_share']:.0%})"
                    if (srv := level["server"])
                    else ""
                ),
                flush=True,
            )
    report = {
        "benchmark": "tilevox bench",
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "device": device,
        "model": model_id,
        "server_max_streams": ready.get("max_streams"),
        "mode": args.mode,
        "max_duration_s": args.max_duration,
        "serve_args": args.serve_arg,
        "ttfa_definition": "client-side, request sent -> first audio byte of a streaming pcm response",
        "stall_definition": "a chunk arriving after a player started at the first byte has played all audio so far",
        "levels": results,
    }
    png = None if args.no_plot else (args.plot or args.out.with_suffix(".png"))
    write_report(report, args.out, png)
    print(f"wrote {args.out}" + (f" and {png}" if png else ""))
    return 0


def _device_name(device: str | None) -> str:
    import torch

    if device == "cuda" or (device is None and torch.cuda.is_available()):
        return torch.cuda.get_device_name(0)
    return "cpu"


def _add_build(subparsers) -> None:
    p = subparsers.add_parser(
        "build",
        help="profile a model's regions on this GPU, search where to run each, write a plan for --plan",
        epilog=_presets_epilog(),
    )
    p.add_argument("--model", required=True, help="checkpoint directory or random:<preset>")
    p.add_argument("--device", default=None, help="cuda (default when present) or cpu")
    p.add_argument("--dtype", default=None, choices=["fp32", "fp16", "bf16"], help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--batches", default="1,8,32,64", help="batch buckets to plan, comma separated")
    p.add_argument(
        "--backends",
        default="graph,megakernel",
        help="backends to profile, comma separated: graph, compiled, megakernel",
    )
    p.add_argument("--megakernel-executor", default="cuda", choices=["cuda", "vm"])
    _add_tiling_arg(p)
    p.add_argument(
        "--warmup",
        type=int,
        default=4,
        help="untimed steps per measurement, at least (then more until every stream has given audio)",
    )
    p.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds of untimed steps before the first measurement (GPU clocks up to speed; 0: none)",
    )
    p.add_argument(
        "--steps", type=int, default=10, help="timed steps per measurement (10: two of Llasa's 5-frame audio blocks)"
    )
    p.add_argument(
        "--measure",
        type=int,
        default=0,
        metavar="N",
        help="also run each bucket's N best predicted candidates end to end, with the two fixed choices (all "
        "conventional, all megakernel), and keep the fastest measured (report: predicted vs measured, "
        "build_report.png)",
    )
    p.add_argument(
        "--measure-rounds",
        type=int,
        default=3,
        metavar="R",
        help="time each whole step R times and keep the median: each bucket's anchor (back to back) and, with "
        "--measure, the candidates in R interleaved rounds (timings of one composition drift by more than "
        "candidates differ)",
    )
    p.add_argument(
        "--splits",
        action="store_true",
        help="also search compositions that cut the Llama decoder step, the Qwen3-TTS talker step or the NH-TTS "
        "decoder step at layer boundaries (each piece priced as its share of the measured region by simulated tile "
        "graphs, plus the price of a cut); with --measure, each bucket's best cut candidate is measured too and the "
        "price of a cut is fitted and kept in the profile cache",
    )
    p.add_argument(
        "--context",
        type=int,
        default=512,
        help="keys per stream assumed by the simulated tile graphs (--splits' prices, the SM-queue timelines of "
        "the chosen megakernel pieces)",
    )
    p.add_argument(
        "--onnx",
        action="store_true",
        help="also write <out>/onnx/<region>_b<batch>.onnx per bucket: megakernel regions as MegakernelRegion "
        "plugin nodes, conventional ones as ONNX ops with swiglu_mlp plugin nodes, a cut step as its chained pieces "
        "(decoder steps of Llama networks, NH-TTS; the Qwen3-TTS talker and code predictor; not the codec decode)",
    )
    p.add_argument("--out", required=True, type=Path, help="directory for plan.json and build_report.json")
    p.add_argument(
        "--profile-cache",
        default=None,
        help="measurements kept between builds, like TensorRT's timing cache: reused where the GPU, driver, kernel "
        "library, torch version, model and measurement settings match, added otherwise (default: "
        "<out>/profile_cache.json; `none`: measure everything and keep nothing)",
    )
    p.set_defaults(handler=_run_build)


def _run_build(args: argparse.Namespace) -> int:
    import json
    import math

    import torch
    from tqdm import tqdm

    from tilevox.engine_builder.build import build_plan, profile_cache_for
    from tilevox.engine_builder.composition import Backend, classify
    from tilevox.engine_builder.plan import save_plan
    from tilevox.engine_builder.profile_cache import ProfileCacheError
    from tilevox.models.registry import load_model, parse_dtype

    if args.measure < 0 or args.context < 1 or args.measure_rounds < 1:
        raise CommandError(
            "--measure must be >= 0, --measure-rounds >= 1 and --context >= 1, "
            f"got {args.measure}, {args.measure_rounds}, {args.context}"
        )
    if not args.settle >= 0:  # NaN too
        raise CommandError(f"--settle must be >= 0 seconds, got {args.settle}")
    try:
        batches = [int(b) for b in args.batches.split(",")]
        backends = [Backend(b.strip()) for b in args.backends.split(",")]
    except ValueError as exc:
        raise CommandError(f"--batches or --backends: {exc}") from None
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = parse_dtype(args.dtype or ("bf16" if device == "cuda" else "fp32"))
    model = load_model(args.model, device=device, dtype=dtype)
    largest = max(batches)
    if largest > model.max_streams:
        raise CommandError(f"batch {largest} is above the model's {model.max_streams} streams")
    args.out.mkdir(parents=True, exist_ok=True)
    cache_path = None if args.profile_cache == "none" else Path(args.profile_cache or args.out / "profile_cache.json")
    try:
        cache = profile_cache_for(model, args.model, cache_path)
    except ProfileCacheError as exc:
        raise CommandError(f"--profile-cache: {exc}") from None
    # per bucket: each backend's profile; with --measure its N best, the best cut and the two fixed choices (at most)
    measured = (args.measure + (1 if args.splits else 0) + 2) * args.measure_rounds if args.measure else 0
    steps_of_work = len(batches) * (len(backends) + measured)
    with tqdm(total=steps_of_work, desc="profiling", file=sys.stderr, leave=False) as bar:

        def progress(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update(1)

        result = build_plan(
            model,
            args.model,
            batches,
            backends=backends,
            megakernel=_megakernel_options(args),
            warmup=args.warmup,
            steps=args.steps,
            settle_s=args.settle,
            commit=_commit(),
            progress=progress,
            measure_top=args.measure,
            measure_rounds=args.measure_rounds,
            cache=cache,
            splits=args.splits,
            split_context=args.context,
        )
    cache.save()
    save_plan(result.plan, args.out / "plan.json")
    category = classify({bucket.batch: bucket.composition for bucket in result.plan.buckets})
    report = {
        "plan": result.plan.to_dict(),
        "measured_ms": [
            {"region": r, "backend": b, "batch": n, "ms_per_step": ms if math.isfinite(ms) else None}
            for (r, b, n), ms in result.measured_ms.items()
        ],
        "not_profiled": result.unavailable,
        "anchor_step_ms": {str(batch): ms for batch, ms in result.anchor_ms.items()},
        "anchor_step_times_ms": {str(batch): times for batch, times in result.anchor_times_ms.items()},
        "candidates": {str(batch): ranked for batch, ranked in result.ranked.items()},
        "cut_costs": result.cut_costs,
        "category": category.category.value,
        "category_why": category.reason,
        "profile_cache": {
            "path": None if cache_path is None else str(cache_path),
            "reused": cache.hits,
            "measured": cache.misses,
        },
        "note": "per-region step times measured with synchronisation around each region (engine_builder.profile); "
        "a candidate's predicted_step_ms is its regions' times plus what the anchor (a whole step with every region "
        "conventional, timed end to end, anchor_step_ms) spent outside its regions"
        + (
            "; cut candidates (--splits) price a megakernel piece as the region's measured megakernel time scaled by "
            "the simulated time of the piece over the whole region"
            if args.splits
            else "; only whole-region compositions are candidates (--splits adds layer cuts)"
        ),
    }
    (args.out / "build_report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    if args.measure:
        from tilevox.engine_builder.report import plot_predicted_vs_measured

        plot_predicted_vs_measured(report["candidates"], args.out / "build_report.png")
    simulable = {r.name for r in result.plan.layout if not r.executor}  # executor regions have no simulated cost
    chosen = [
        (b.batch, p)
        for b in result.plan.buckets
        for p in b.composition.pieces
        if p.backend is Backend.MEGAKERNEL and p.region in simulable
    ]
    if chosen:  # the simulated SM queues of every megakernel piece of a decoder region the plan chose
        from tilevox.engine_builder.simulated_costs import SimulatedMegakernelCost

        simulated = SimulatedMegakernelCost(model, context=args.context)
        for batch, piece in chosen:
            simulated.timeline(piece, batch, args.out / f"timeline_{piece.region}_b{batch}.png")
    for bucket in result.plan.buckets:
        print(
            f"{bucket.batch:>5} streams: {bucket.composition.label()}  ({bucket.predicted_step_s * 1e3:.2f} ms per step, "
            f"best of {bucket.num_candidates})"
        )
    for what, why in result.unavailable.items():
        print(f"not profiled: {what}: {why}")
    print(f"category: {category.category.value} ({category.reason})")
    if args.splits:
        costs = result.cut_costs
        line = f"price of a cut: {costs['used_cut_s'] * 1e6:.1f} us ({costs['source']})"
        if "fitted_cut_s" in costs:
            line += (
                f"; fitted from this build's measured cuts: {costs['fitted_cut_s'] * 1e6:.1f} us "
                f"(median of {len(costs['samples_s'])}; kept in the profile cache for the next build)"
            )
        print(line)
    print(f"profile cache {cache_path or '(none)'}: {cache.hits} measurements reused, {cache.misses} made")
    print(f"wrote {args.out / 'plan.json'} and {args.out / 'build_report.json'}")
    if args.onnx:
        try:
            from tilevox.engine_builder.onnx_lowering import OnnxLoweringError, export_plan
        except ImportError as exc:  # onnx is not a dependency of the server itself
            raise CommandError(f"--onnx needs the onnx package (pip install onnx): {exc}") from exc

        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device == "cuda" else 132
        try:
            for path in export_plan(model, result.plan, args.out / "onnx", num_sms=num_sms):
                print(f"wrote {path}")
        except OnnxLoweringError as exc:
            raise CommandError(f"--onnx: {exc}") from None
    return 0


def _commit() -> str:
    """The source's commit for the plan's provenance: $TILEVOX_COMMIT where a copy's git metadata is not its
    source's (a device copy), else the checkout's, with `-dirty` when files differ from it (`unknown`
    outside a git checkout)."""
    import os
    import shutil
    import subprocess

    if os.environ.get("TILEVOX_COMMIT"):
        return os.environ["TILEVOX_COMMIT"]
    if shutil.which("git") is None:
        return "unknown"
    out = subprocess.run(
        ["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parent,
    )
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tilevox", description="Streaming text-to-speech for Hopper GPUs", epilog=_presets_epilog()
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    subparsers = parser.add_subparsers(dest="command", required=True)
    _add_synth(subparsers)
    _add_serve(subparsers)
    _add_voices(subparsers)
    _add_bench(subparsers)
    _add_build(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    from tilevox.models.errors import CheckpointError

    try:
        return args.handler(args)
    except (CommandError, CheckpointError, ValueError, OSError) as exc:
        # user mistakes: bad options and requests (ValueError, RequestError), unknown models, unreadable
        # or broken checkpoints, missing files, taken ports (OSError)
        print(f"tilevox: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # not the user's mistake (a CUDA error, a bug): say what and why
        cause = exc.__cause__ or exc.__context__
        print(
            f"tilevox: internal error: {type(exc).__name__}: {exc}"
            + (f" (caused by {type(cause).__name__}: {cause})" if cause else ""),
            file=sys.stderr,
        )
        if args.verbose:
            import traceback

            traceback.print_exc()
        else:
            print("tilevox: run with -v for the traceback", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
