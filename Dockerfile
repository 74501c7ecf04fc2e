# streamproc container image: CPU by default, CUDA by build argument.
#
#   docker build -t streamproc:cpu .                               # python:3.11 base from a registry
#   docker build -t streamproc:cuda --build-arg VARIANT=cuda .
#   make images          # no registry: every base image built locally (deploy/images/build.sh),
#                        # then BASE_IMAGE=streamproc/python:3.11-bookworm
#
# Builds with the legacy builder and with BuildKit alike: no `# syntax=` line (it would pull a
# frontend image), no BuildKit-only flags. Every base image is the build argument BASE_IMAGE.
#
# Only requirements.lock (the runtime lock) is installed, never requirements-dev.lock.
# VARIANT=cpu   requirements.lock up to its "# cuda-only" marker: torch from PyPI cannot be
#               imported without its bundled CUDA libraries (nvidia-* wheels), even on CPU, so they
#               stay; triton (GPU kernels of torch.compile) and the CUDA libraries only a GPU
#               loads (see below) are left out.
# VARIANT=cuda  the whole requirements.lock: the host needs only the NVIDIA driver and container
#               toolkit (docker run --gpus all / the Kubernetes NVIDIA device plugin).
#
# Every stage uses the same BASE_IMAGE, because the virtualenv copied into the final stage links
# to that image's Python. The final stage has no compilers, no pip and runs as UID 10001; it works
# with a read-only root filesystem as long as /tmp is writable (HOME and every cache live there).
# PIP_INDEX_URL (optional) and deploy/docker/ca-certificates/*.crt (optional, git-ignored; extra
# CAs, e.g. of a TLS-inspecting proxy) serve the pip step only and never reach the final stage.

ARG BASE_IMAGE=python:3.11.13-slim-bookworm

# Three build stages, so that the final image's large layer (the dependencies, about 4 GB with
# torch) is rebuilt only when requirements.lock changes, not on every change to the package: a
# rebuild per change used to leave a 4 GB layer behind in the builder's cache and in a Kubernetes
# node's image store each time, until a host ran out of disk.
FROM ${BASE_IMAGE} AS deps
# Lets `deploy/images/build.sh` remove the untagged build-stage images the legacy builder leaves.
LABEL io.streamproc.stage=build
ARG VARIANT=cpu
ARG PIP_INDEX_URL=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /src
RUN python3 -m venv /opt/streamproc
ENV PATH=/opt/streamproc/bin:$PATH
COPY deploy/docker/ca-certificates/ /tmp/ca-certificates/
COPY requirements.lock ./
# --no-deps: requirements.lock is the complete, closed set (see its header for what it leaves out).
RUN if [ -z "$PIP_INDEX_URL" ]; then unset PIP_INDEX_URL; fi; \
    set -- /tmp/ca-certificates/*.crt; \
    if [ -e "$1" ]; then \
      cat /etc/ssl/certs/ca-certificates.crt /tmp/ca-certificates/*.crt > /tmp/ca-bundle.pem; \
      export PIP_CERT=/tmp/ca-bundle.pem; \
    fi; \
    case "$VARIANT" in \
      cpu) sed '/^# cuda-only/,$d' requirements.lock > /tmp/requirements.txt ;; \
      cuda) cp requirements.lock /tmp/requirements.txt ;; \
      *) echo "VARIANT must be cpu or cuda, got '$VARIANT'" >&2; exit 1 ;; \
    esac; \
    pip install --no-deps --requirement /tmp/requirements.txt
# CPU variant: drop the CUDA libraries that only a GPU ever loads (cuDNN's engine/graph/adv/ops
# sub-libraries, cusolverMg, the CUPTI profiler hosts): not mapped by `import torch` nor by CPU
# inference (measured via /proc/self/maps), about 1 GB. libcudnn.so itself stays (linked).
RUN if [ "$VARIANT" = cpu ]; then \
      site="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"; \
      rm -f "$site"/nvidia/cudnn/lib/libcudnn_*.so.* "$site"/nvidia/*/lib/libcusolverMg.so.* \
            "$site"/nvidia/*/lib/libnvperf_*.so; \
    fi

# The dependencies as the final stage copies them: without pip.
FROM deps AS deps-runtime
RUN pip uninstall --yes pip

# The package alone, under its own prefix (/opt/package, laid out as the virtualenv: bin/,
# lib/python3.X/site-packages/); its scripts name /opt/streamproc/bin/python.
FROM deps AS build
COPY pyproject.toml README.md ./
COPY streamproc ./streamproc
COPY deploy/docker/streamproc-render-config /opt/package/bin/streamproc-render-config
RUN pip install --no-deps --no-build-isolation --prefix /opt/package . \
 && chmod 0755 /opt/package/bin/streamproc-render-config \
 && site="$(python -c 'import sysconfig; \
print(sysconfig.get_paths(vars={"base": "/opt/package"})["purelib"])')" \
 && export PYTHONPATH="$site" \
 && python -c "import streamproc.cli, streamproc.workloads, torch; \
print('torch', torch.__version__, torch.nn.Conv2d(3, 8, 3)(torch.randn(1, 3, 32, 32)).shape)" \
 && /opt/package/bin/streamproc --help >/dev/null

FROM ${BASE_IMAGE} AS runtime
ARG VARIANT=cpu
LABEL org.opencontainers.image.title="streamproc" \
      org.opencontainers.image.description="Kafka consumer that runs PyTorch models over Kafka topics" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.streamproc.variant="${VARIANT}"
RUN groupadd --system --gid 10001 streamproc \
 && useradd --system --uid 10001 --gid 10001 --home-dir /tmp --no-create-home \
      --shell /usr/sbin/nologin streamproc
COPY --from=deps-runtime /opt/streamproc /opt/streamproc
COPY --from=build /opt/package/ /opt/streamproc/
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
