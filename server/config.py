"""ServerConfig: every knob of `tilevox serve`, validated once, passed down explicitly."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServerConfig"]

DEFAULT_MODEL = "random:llama-tiny"


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerConfig:
    model: str = DEFAULT_MODEL
    host: str = "0.0.0.0"
    http_port: int = 8000  # 0 = pick a free port (tests)
    grpc_port: int = 50051  # 0 = pick a free port (tests)
    device: str = "cpu"
    dtype: str = "fp32"
    max_streams: int = 32  # running streams (continuous batch size)
    max_queued: int = 32  # accepted streams waiting for a slot; beyond: 429 / RESOURCE_EXHAUSTED
    max_batch: int | None = None  # streams per model step; None = max_streams
    api_key: str | None = None  # required on synthesis routes of all three surfaces when set
    max_text_chars: int = 4096  # OpenAI's input limit
    max_message_bytes: int = 1 << 20  # HTTP body, WebSocket message, gRPC message
    default_max_duration_s: float = 60.0
    idle_timeout_s: float = 30.0  # WebSocket/gRPC stream with no client message for this long is closed
    drain_timeout_s: float = 30.0  # SIGTERM: active streams get this long to finish
    warmup: bool = True  # short syntheses before /ready turns true
    # Concurrency levels of the warm-up: each level's streams are submitted at once, level after level.
    # `tilevox serve` passes the executor's batch buckets when CUDA graphs are on, so that their graphs are
    # captured before the first client instead of while clients' streams wait.
    warmup_streams: tuple[int, ...] = (1,)
    # Text lengths of the warm-up, in words added to a short sentence: each level runs once per length, so
    # that prompt-length buckets (captured prefill) and key-length buckets (captured steps) are captured
    # before /ready too. `tilevox serve` passes WARMUP_WORDS with the executor on, (0,) otherwise.
    warmup_words: tuple[int, ...] = (0,)
    # First audio first (Scheduler): steps carry streams still waiting for first audio alone while every
    # playing stream has this much audio buffered; None (default) = every step carries every running stream.
    newcomer_slack_s: float | None = None
    # Prefill budget (Scheduler, PrefillBudget): an iteration admits fewer newcomers when their prefill
    # would make a playing stream's next audio arrive after its client's buffer has run dry. Off by default:
    # on the H200 its first form cut Qwen3-TTS's stalls at 64 streams but doubled TTFA p95 (README).
    prefill_budget: bool = False
    # `--profile-steps`: profile this many worker iterations that step >= profile_min_batch streams, after
    # profile_skip of them, into profile_out (server.profiling.WorkerProfile); 0 = off.
    profile_steps: int = 0
    profile_skip: int = 50
    profile_min_batch: int = 1
    profile_out: str = "tilevox-worker-profile.txt"
    strict_voices: bool = (
        False  # Riva surface: refuse voice names that match nothing (default: the default voice + one warning)
    )

    def __post_init__(self) -> None:
        for name in ("http_port", "grpc_port"):
            port = getattr(self, name)
            if not (0 <= port <= 65535):
                raise ValueError(f"{name} must be in [0, 65535], got {port}")
        if self.http_port and self.http_port == self.grpc_port:
            raise ValueError(f"http_port and grpc_port must differ, both are {self.http_port}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype not in ("fp32", "fp16", "bf16"):
            raise ValueError(f"dtype must be fp32, fp16 or bf16, got {self.dtype!r}")
        if self.max_streams < 1:
            raise ValueError(f"max_streams must be >= 1, got {self.max_streams}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.max_batch is not None and not (1 <= self.max_batch <= self.max_streams):
            raise ValueError(f"max_batch must be in [1, max_streams={self.max_streams}], got {self.max_batch}")
        if not self.warmup_streams or not all(1 <= n <= self.max_streams for n in self.warmup_streams):
            raise ValueError(
                f"warmup_streams must be levels in [1, max_streams={self.max_streams}], got {self.warmup_streams}"
            )
        if not self.warmup_words or not all(n >= 0 for n in self.warmup_words):
            raise ValueError(f"warmup_words must be word counts >= 0, got {self.warmup_words}")
        if self.newcomer_slack_s is not None and not self.newcomer_slack_s >= 0:
            raise ValueError(f"newcomer_slack_s must be >= 0 or None, got {self.newcomer_slack_s}")
        if self.profile_steps < 0 or self.profile_skip < 0 or self.profile_min_batch < 1:
            raise ValueError(
                "profile_steps and profile_skip must be >= 0 and profile_min_batch >= 1, got "
                f"{self.profile_steps}, {self.profile_skip}, {self.profile_min_batch}"
            )
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("api_key must not be empty (leave it unset to disable authentication)")
        if self.max_text_chars < 1:
            raise ValueError(f"max_text_chars must be >= 1, got {self.max_text_chars}")
        if self.max_message_bytes < 1024:
            raise ValueError(f"max_message_bytes must be >= 1024, got {self.max_message_bytes}")
        if not (0 < self.default_max_duration_s <= 3600):
            raise ValueError(f"default_max_duration_s must be in (0, 3600], got {self.default_max_duration_s}")
        for name in ("idle_timeout_s", "drain_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
