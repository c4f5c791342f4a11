# One image for every recpipe stage, the one-shot init job and the locust load generator.
#
#   docker build -t recpipe:cpu  --build-arg VARIANT=cpu  .   # CPU-only: torch CPU wheel, faiss-cpu
#   docker build -t recpipe:cuda --build-arg VARIANT=cuda .   # NVIDIA GPUs: torch CUDA wheel, faiss-gpu-cu12
#
# The CUDA variant needs no CUDA base image: the torch and faiss-gpu wheels bring the CUDA runtime
# libraries with them, and the NVIDIA Container Toolkit mounts the host's driver when a container is
# given a GPU (docker-compose.yml reserves one for init, retrieval and ranking). Stages without a GPU,
# and the CUDA image on a machine without one, run on the CPU: recpipe detects the device at start-up.
#
# Offline or behind a mirror, build arguments alone redirect every download (README, "Containers"):
# PYTHON_IMAGE (a local base image, e.g. from .ci/base-image.sh), TORCH_INDEX_URL (a PEP 503 index
# holding torch and its dependencies), PIP_INDEX_URL (everything else). No `# syntax=` line: it would
# make BuildKit fetch a frontend image, and nothing here needs one.

ARG VARIANT=cpu
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# ---- build: a virtual environment with recpipe and its dependencies -----------------------------
FROM ${PYTHON_IMAGE} AS build-base
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

# torch first, from the index of the variant's build, so `pip install .` below finds it satisfied and
# does not pull the default (CUDA) wheel into the CPU image. The index is chosen here, in one stage,
# rather than in a stage per variant: the legacy builder runs every stage, so a CPU build would also
# download the CUDA torch. PyPI's Linux torch wheel is the CUDA build (CUDA libraries as nvidia-* wheels).
FROM build-base AS deps
ARG VARIANT
ARG TORCH_VERSION=2.13.0
# Empty: the variant's own index (cpu: PyTorch's CPU index; cuda: PyPI).
ARG TORCH_INDEX_URL=
ARG PIP_INDEX_URL=https://pypi.org/simple
RUN case "${VARIANT}" in \
        cpu) default_index=https://download.pytorch.org/whl/cpu ;; \
        cuda) default_index=https://pypi.org/simple ;; \
        *) echo "VARIANT must be cpu or cuda, not '${VARIANT}'" >&2; exit 1 ;; \
    esac \
 && pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL:-$default_index}"
# The dependencies next, from pyproject.toml alone (a stub package stands in for the code), so that a
# change to recpipe's code or README reuses this stage instead of downloading them all again.
# faiss-cpu (a dependency of recpipe) and faiss-gpu-cu12 install the same `faiss` module files, so the
# CUDA image swaps one for the other instead of installing both (`pip install .[gpu]` would reinstall
# faiss-cpu over the GPU build). A build has no GPU driver, so only the CPU image test-imports faiss.
COPY pyproject.toml ./
ARG FAISS_GPU="faiss-gpu-cu12>=1.8"
RUN mkdir recpipe && touch recpipe/__init__.py README.md \
 && pip install . && pip uninstall -y recpipe \
 && rm -rf recpipe README.md build recpipe.egg-info \
 && if [ "${VARIANT}" = "cuda" ]; then \
        pip uninstall -y faiss-cpu && pip install "${FAISS_GPU}"; \
    else \
        python -c "import faiss; print('faiss', faiss.__version__)"; \
    fi
# recpipe itself as a wheel: the runtime stage adds it over the dependencies' venv, so a change to the
# code costs a small layer, not a new copy of the venv.
FROM deps AS build
COPY README.md ./
COPY recpipe ./recpipe
RUN pip wheel --no-deps --wheel-dir /wheels .

# ---- runtime: the dependencies' venv as built (no copy of it: a copy of 1.5 GB costs minutes and a
# second layer as large), recpipe's wheel, the load test; no compilers or pip caches -----------------
FROM deps AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="recpipe" \
      org.opencontainers.image.description="recommender latency pipeline: gRPC feature, retrieval and ranking stages" \
      io.recpipe.variant="${VARIANT}"
# libgomp: OpenMP runtime that faiss and torch load on the CPU path.
# (A base image that has it already, like .ci/base-image.sh's, needs no package mirror here.)
RUN if ! ldconfig -p | grep -q 'libgomp\.so\.1'; then \
        apt-get update \
     && apt-get install -y --no-install-recommends libgomp1 \
     && rm -rf /var/lib/apt/lists/*; \
    fi
# A fixed, numeric non-root user (10001:10001): Kubernetes' runAsNonRoot can only verify a numeric USER,
# and deploy/k8s and docker-compose.yml run it with the same IDs. The image also runs with a read-only
# root filesystem: it writes only to /artifacts (a volume) and /tmp (a tmpfs or emptyDir), and HOME
# points there so no library's cache lands on the read-only root.
RUN groupadd --gid 10001 recpipe \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp recpipe \
 && mkdir -p /artifacts && chown 10001:10001 /artifacts
WORKDIR /app
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-deps /tmp/wheels/*.whl \
 && rm -rf /tmp/wheels /src \
 && python -c "import recpipe, torch, grpc, polars; print('recpipe', recpipe.__version__, 'torch', torch.__version__)"
COPY loadtest /app/loadtest
ENV PYTHONUNBUFFERED=1 \
    HOME=/tmp \
    RECPIPE_VARIANT=${VARIANT} \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
EXPOSE 50051 50052 50053 50054 8089
# The services need --models/--data; docker-compose.yml gives each container its command.
CMD ["recpipe", "--help"]
