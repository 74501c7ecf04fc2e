# syntax=docker/dockerfile:1.7
#
# streamproc container image.
#
#   docker build -t streamproc:0.1.0 .                          # CPU image (default)
#   docker build -t streamproc:0.1.0-cuda --build-arg VARIANT=cuda .
#
# VARIANT=cpu   installs requirements.lock verbatim from PyPI by default (runs on CPU; the CUDA
#               libraries bundled with PyPI's torch are simply unused). For a much smaller image,
#               pass --build-arg TORCH_CPU_INDEX_URL=<PyTorch's CPU wheel index>: torch and
#               torchvision then come from there at the same versions and the nvidia-*/cuda-*/
#               triton wheels are left out.
# VARIANT=cuda  installs requirements.lock verbatim: the PyPI torch wheels bundle the CUDA runtime
#               libraries, so the host only needs the NVIDIA driver and container toolkit
#               (docker run --gpus all / the Kubernetes NVIDIA device plugin); no CUDA base image.
#
# Both stages use the same BASE_IMAGE, because the virtualenv copied into the final stage links
# to that image's Python. The final stage has no compilers, no pip and runs as UID 10001; it works
# with a read-only root filesystem as long as /tmp is writable (HOME and every cache live there).

ARG BASE_IMAGE=python:3.11.13-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG VARIANT=cpu
ARG TORCH_CPU_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
RUN python -m venv /opt/streamproc
ENV PATH=/opt/streamproc/bin:$PATH
COPY requirements.lock ./
# --no-deps everywhere: requirements.lock is the complete, closed set; `pip check` proves it.
RUN case "$VARIANT" in \
      cpu) \
        if [ -n "$TORCH_CPU_INDEX_URL" ]; then \
          grep -Ev '^(nvidia-|cuda-|triton==|torch==|torchvision==)' requirements.lock > /tmp/req.txt; \
          grep -E '^(torch|torchvision)==' requirements.lock > /tmp/torch.txt; \
          pip install --no-deps --requirement /tmp/req.txt; \
          pip install --no-deps --index-url "$TORCH_CPU_INDEX_URL" --requirement /tmp/torch.txt; \
        else \
          pip install --no-deps --requirement requirements.lock; \
        fi ;; \
      cuda) pip install --no-deps --requirement requirements.lock ;; \
      *) echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 1 ;; \
    esac
COPY pyproject.toml README.md ./
COPY streamproc ./streamproc
RUN pip install --no-deps --no-build-isolation . \
 && pip check \
 && python -c "import streamproc.cli, torch; print('torch', torch.__version__)" \
 && pip uninstall --yes pip
COPY --chmod=0755 deploy/docker/streamproc-render-config /opt/streamproc/bin/streamproc-render-config

FROM ${BASE_IMAGE} AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="streamproc" \
      org.opencontainers.image.description="Kafka consumer that runs PyTorch models over Kafka topics" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.streamproc.variant="${VARIANT}"
RUN groupadd --system --gid 10001 streamproc \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin streamproc
COPY --from=build /opt/streamproc /opt/streamproc
# Everything the process may write goes under /tmp (an emptyDir or tmpfs with a read-only root).
ENV PATH=/opt/streamproc/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    STREAMPROC_CACHE_DIR=/tmp/.cache/streamproc \
    TORCH_HOME=/tmp/.cache/torch \
    TRITON_CACHE_DIR=/tmp/.cache/triton \
    STREAMPROC_CONFIG=/etc/streamproc/config.yaml
WORKDIR /opt/streamproc
USER 10001:10001
EXPOSE 9108
# Liveness of the poll loop. The port follows STREAMPROC_METRICS__PORT when that override is used;
# with metrics.port set only in the config file, set STREAMPROC_METRICS__PORT to match.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('STREAMPROC_METRICS__PORT', '9108'), timeout=4)"]
ENTRYPOINT ["streamproc"]
CMD ["run"]
