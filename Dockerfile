# tilevox server image for NVIDIA GPU hosts (Hopper: H100/H200).
#
#   docker build -t tilevox .
#   docker run --gpus all -p 8000:8000 -p 50051:50051 -v "$PWD/models:/models" tilevox \
#       --model /models/<checkpoint-dir>
#
# The fused SwiGLU kernel library is compiled with nvcc 13.0 in a first stage (sm_90a, CUTLASS
# headers from the nvidia-cutlass wheel), so hosts need a CUDA 13 driver (>= 580). The CUDA libraries
# themselves come with the PyTorch wheel. Ports: 8000 OpenAI HTTP + WebSocket, 50051 Riva gRPC. Set
# TILEVOX_API_KEY to require a key on all three APIs. Needs BuildKit (Docker's default builder since
# 23.0; DOCKER_BUILDKIT=1 before).
#
# Two targets share every step except the kernel library and torch's build: the default (the last stage)
# is the GPU image; `--target cpu` is the same image with a CPU torch and no kernel library, serving on
# the CPU (BuildKit then never builds the kernels stage). The build arguments below choose the base
# images and where torch comes from; their defaults are the GPU image's. CI cannot pull nvidia/cuda images
# or CUDA torch, so it builds and runs only `cpu`, on a Debian stand-in base built from the Debian archive
# (scripts/container/build-cpu.sh, tests/test_container.py). Elsewhere (RUNTIME_BASE may stay the default,
# or be any Debian or Ubuntu image):
#
#   docker build --target cpu -t tilevox:cpu \
#       --build-arg TORCH_VERSION=2.13.0+cpu --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu .
ARG KERNELS_BASE=nvidia/cuda:13.0.0-devel-ubuntu24.04
ARG RUNTIME_BASE=nvidia/cuda:13.0.0-base-ubuntu24.04
# An image whose root holds torch wheels, offered to pip as --find-links (for builds that cannot reach
# TORCH_INDEX_URL's torch); by default none (an empty stage).
ARG TORCH_WHEELS=scratch

FROM ${KERNELS_BASE} AS kernels
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/build \
    && /opt/build/bin/pip install --no-deps nvidia-cutlass==4.2.0.0
# The installed layout (tilevox/trt_plugins), so that the module path resolves from /src.
COPY tilevox/__init__.py /src/tilevox/__init__.py
COPY trt_plugins /src/tilevox/trt_plugins
RUN cd /src && /opt/build/bin/python -m tilevox.trt_plugins.build --out /out --jobs 4

FROM ${TORCH_WHEELS} AS torch-wheels

# Everything both targets have.
FROM ${RUNTIME_BASE} AS common

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
    && rm -rf /var/lib/apt/lists/*

RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# PyTorch first, from its own index (CUDA 13.0 builds by default; 2.13.0+cpu from
# https://download.pytorch.org/whl/cpu for the cpu target), so nothing installed later can replace it
# with another build.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu130
RUN --mount=type=bind,from=torch-wheels,target=/tmp/torch-wheels \
    pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" --find-links /tmp/torch-wheels

WORKDIR /opt/tilevox
# The whole build context: .dockerignore leaves out everything `pip install .` does not need, so a design
# folder that setup.py maps into the package is copied without being named here.
COPY . ./
# The Riva gRPC stubs ship with tilevox (server/riva_proto/): no nvidia-riva-client needed. EXTRAS adds
# optional dependencies, e.g. --build-arg EXTRAS=[ray] for the Ray Serve image that deploy/rayservice.yaml names.
ARG EXTRAS=""
RUN pip install ".${EXTRAS}"

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

# CPU: torch must be a CPU build (TORCH_VERSION=2.13.0+cpu), and the server runs on the CPU.
FROM common AS cpu
RUN python -c "import torch; assert not torch.version.cuda, 'a CUDA torch was installed: build cpu with a CPU torch (TORCH_VERSION=2.13.0+cpu)'"
CMD ["--model", "random:llama-tiny", "--device", "cpu"]

# GPU (the default target): a CUDA torch and the fused SwiGLU kernel library.
FROM common AS gpu
COPY --from=kernels /out/libtilevox_kernels.so /opt/tilevox/lib/libtilevox_kernels.so
ENV TILEVOX_KERNELS_LIB=/opt/tilevox/lib/libtilevox_kernels.so
RUN python -c "import torch; assert torch.version.cuda, 'a CPU-only torch was installed'"
