# syntax=docker/dockerfile:1
# megatron-serve runtime image: engine, coordinator, OpenAI server and Kubernetes operator.
#
#   make image            # docker or podman; tags ghcr.io/megatron-serve/megatron-serve:<version>
#   docker run --gpus all -v /models:/models ghcr.io/megatron-serve/megatron-serve:0.1.0 \
#       run --model /models/llama-3.2-1b-instruct --host 0.0.0.0
#
# The install path is the one the release check (tests/release) runs on every change: the wheel
# built from this tree, installed with the `triton` extra (already satisfied by the base image).
# VERSION equals megatron_serve.__version__ (a test keeps them equal; `make image` passes it).
# Another BASE_IMAGE works when its `python`/`pip` on PATH are a venv or conda environment with
# torch (a distribution's own python3 refuses pip installs as "externally managed"). Stopping a
# serving container drains the engines first: give it time (`docker stop -t 45`).
#
# The base is an official CUDA build of PyTorch (runtime flavour: no CUDA toolkit); torch and
# triton come from it, the project and its other dependencies from the wheel built below.
ARG BASE_IMAGE=pytorch/pytorch:2.7.1-cuda12.8-cudnn9-runtime
ARG VERSION=0.1.0

# ---------------------------------------------------------------- build: the project's wheel
FROM ${BASE_IMAGE} AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY runtime/ runtime/
COPY kernels/ kernels/
COPY operator/ operator/
RUN python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---------------------------------------------------------------- runtime
FROM ${BASE_IMAGE}
ARG VERSION
LABEL org.opencontainers.image.title="megatron-serve" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.description="Kubernetes-native LLM inference: engine, coordinator, OpenAI server, operator" \
      org.opencontainers.image.licenses="Apache-2.0"

# Triton JIT-compiles a small launcher with the system C compiler the first time a kernel runs
# on a GPU, so gcc and the C headers are the one exception to "no build tools at runtime".
# Versions follow the base image's distribution (its security updates), hence not pinned.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# The wheel pins nothing new for torch: the base's CUDA build satisfies torch>=2.4,<3 and stays.
COPY --from=build /wheels /wheels
# UID 1000 is what the operator's pods run as (runAsUser); some bases already have such a user.
RUN python -m pip install --no-cache-dir "/wheels/megatron_serve-${VERSION}-py3-none-any.whl[triton]" \
    && rm -rf /wheels \
    && (getent passwd 1000 >/dev/null || useradd --uid 1000 --user-group --no-create-home --shell /usr/sbin/nologin megatron) \
    && mkdir -p /home/megatron \
    && chown 1000:1000 /home/megatron

ENV PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    HOME=/home/megatron
WORKDIR /home/megatron
USER 1000:1000

# coordinator 5555, OpenAI server 8000, operator health 8080, engine rank rendezvous 29500
EXPOSE 5555 8000 8080 29500
ENTRYPOINT ["megatron-serve"]
CMD ["--help"]
