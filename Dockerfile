# tilevox server image for NVIDIA GPU hosts (Hopper: H100/H200).
#
#   docker build -t tilevox .
#   docker run --gpus all -p 8000:8000 -p 50051:50051 -v "$PWD/models:/models" tilevox \
#       --model /models/<checkpoint-dir>
#
# The CUDA 12.6 base runs on host drivers >= 535 through CUDA minor-version compatibility; the
# CUDA libraries themselves come with the PyTorch wheel. Ports: 8000 OpenAI HTTP + WebSocket,
# 50051 Riva gRPC. Set TILEVOX_API_KEY to require a key on all three APIs.
FROM nvidia/cuda:12.6.3-base-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# PyTorch first, from the CUDA index, so nothing installed later can replace it with another build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

WORKDIR /opt/tilevox
COPY pyproject.toml README.md ./
COPY trt_plugins ./trt_plugins
COPY models ./models
COPY engine_builder ./engine_builder
COPY server ./server
# The server's packages (see docs/serving.md); nvidia-riva-client is installed without its
# dependencies because it pins protobuf exactly and websockets<16, neither of which it needs here.
RUN pip install . \
        "fastapi>=0.115" "uvicorn>=0.30" "websockets>=13" "grpcio>=1.81" "grpcio-health-checking>=1.81" \
        "protobuf>=6.33" "prometheus-client>=0.20" "soxr>=0.5" "av>=14" \
    && pip install --no-deps "nvidia-riva-client==2.28.0" \
    && python -c "import torch; assert torch.version.cuda, 'a CPU-only torch was installed'"

RUN useradd --create-home --uid 10001 tilevox && mkdir -p /models && chown tilevox /models
USER tilevox
VOLUME ["/models"]
EXPOSE 8000 50051

# Healthy once the model is loaded and warmed up (/ready); it turns unhealthy while draining.
HEALTHCHECK --interval=15s --timeout=3s --start-period=600s --retries=3 \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/ready', timeout=2)"

# SIGTERM drains active streams (--drain-timeout, default 30 s): give `docker stop` longer, e.g. -t 40.
STOPSIGNAL SIGTERM
ENTRYPOINT ["tilevox", "serve", "--host", "0.0.0.0", "--http-port", "8000", "--grpc-port", "50051"]
CMD ["--model", "random:llama-tiny", "--device", "cuda"]
