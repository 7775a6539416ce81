# syntax=docker/dockerfile:1
# kvshare worker image, CPU (onnxruntime). The GPU variant is Dockerfile.gpu.
#
#   docker build -t kvshare:0.1.0 .
#   docker build -t kvshare:0.1.0-small --build-arg MODEL_PRESET=small .   # demo model baked in
#   docker run --rm -p 50051:50051 -v /path/to/model:/models/current:ro kvshare:0.1.0
#
# The entrypoint is `kvshare serve`; arguments are its flags, and every setting can also be given
# as a KVSHARE_* variable. The model folder is read from /models/current (KVSHARE_MODEL): mount it
# there, or bake the seeded demo model with --build-arg MODEL_PRESET=tiny|small|bench.
# The user is kvshare (uid/gid 10001); the root filesystem can be read-only (give /tmp a tmpfs).
#
# Python packages come from requirements/cpu.txt, a lock with a sha256 for every file (made by
# scripts/lock.sh from pyproject.toml's `cpu` extra): ONNX Runtime is the CPU build, onnxruntime, and
# nothing else. The lock is installed before the source is copied, so a code change reuses that layer.
#
# The base image is pinned by digest; the tag before the @ says which image the digest was read from.
# To move to a newer image of that tag, read its current digest and replace the one below (or pass
# --build-arg PYTHON_IMAGE=...):
#   docker buildx imagetools inspect python:3.11-slim-bookworm     # the "Digest:" line

# python:3.11-slim-bookworm (CPython 3.11.16), multi-platform index digest.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kvshare
WORKDIR /src
COPY requirements/cpu.txt requirements/cpu.txt
RUN /opt/kvshare/bin/pip install --require-hashes --no-deps -r requirements/cpu.txt
COPY pyproject.toml README.md ./
COPY services ./services
COPY cachestore ./cachestore
COPY kvshare ./kvshare
# A regular (not editable) install: the image carries no source tree. --no-deps: every dependency
# came from the lock, and pip check fails the build if the lock misses one.
RUN /opt/kvshare/bin/pip install --no-deps . \
 && /opt/kvshare/bin/pip check \
 && /opt/kvshare/bin/python -m compileall -q /opt/kvshare/lib
COPY docker/healthcheck.py /opt/kvshare/bin/kvshare-healthcheck.py

FROM ${PYTHON_IMAGE}
RUN groupadd --system --gid 10001 kvshare \
 && useradd --system --uid 10001 --gid kvshare --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin kvshare \
 && mkdir -p /models \
 && chown kvshare:kvshare /models
COPY --from=build /opt/kvshare /opt/kvshare
ENV PATH=/opt/kvshare/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    ORT_DISABLE_TELEMETRY=1 \
    KVSHARE_HOST=0.0.0.0 \
    KVSHARE_PORT=50051 \
    KVSHARE_MODEL=/models/current

# Optional: bake the seeded demo model (the same bytes as `kvshare build-model` anywhere).
ARG MODEL_PRESET=""
RUN if [ -n "$MODEL_PRESET" ]; then \
      kvshare build-model --arch decoder --preset "$MODEL_PRESET" /models/current \
      && chown -R kvshare:kvshare /models; \
    fi

USER 10001:10001
EXPOSE 50051
# gRPC health protocol: SERVING for kvshare.v1.Generator on KVSHARE_PORT (NOT_SERVING while draining).
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 \
  CMD ["python", "/opt/kvshare/bin/kvshare-healthcheck.py"]
# Above not_serving_s + drain_s (2 + 20 s by default): `docker stop -t 30` lets streams finish.
STOPSIGNAL SIGTERM
ENTRYPOINT ["kvshare", "serve"]
