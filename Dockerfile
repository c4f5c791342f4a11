# syntax=docker/dockerfile:1
#
# One image for every recpipe stage, the one-shot init job and the locust load generator.
#
#   docker build -t recpipe:cpu  --build-arg VARIANT=cpu  .   # CPU-only: torch CPU wheel, faiss-cpu
#   docker build -t recpipe:cuda --build-arg VARIANT=cuda .   # NVIDIA GPUs: torch CUDA wheel, faiss-gpu-cu12
#
# The CUDA variant needs no CUDA base image: the torch and faiss-gpu wheels bring the CUDA runtime
# libraries with them, and the NVIDIA Container Toolkit mounts the host's driver when a container is
# given a GPU (docker-compose.yml reserves one for init, retrieval and ranking). Stages without a GPU,
# and the CUDA image on a machine without one, run on the CPU: recpipe detects the device at start-up.

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
# does not pull the default (CUDA) wheel into the CPU image.
FROM build-base AS build-cpu
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

# PyPI's Linux torch wheel is the CUDA build (its CUDA libraries come as nvidia-* wheels).
FROM build-base AS build-cuda
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://pypi.org/simple
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"

FROM build-${VARIANT} AS build
ARG VARIANT
COPY pyproject.toml README.md ./
COPY recpipe ./recpipe
# faiss-cpu (a dependency of recpipe) and faiss-gpu-cu12 install the same `faiss` module files, so the
# CUDA image swaps one for the other instead of installing both (`pip install .[gpu]` would reinstall
# faiss-cpu over the GPU build). A build has no GPU driver, so only the CPU image test-imports faiss.
ARG FAISS_GPU="faiss-gpu-cu12>=1.8"
RUN pip install . \
 && if [ "${VARIANT}" = "cuda" ]; then \
        pip uninstall -y faiss-cpu && pip install "${FAISS_GPU}"; \
    else \
        python -c "import faiss; print('faiss', faiss.__version__)"; \
    fi \
 && python -c "import recpipe, torch, grpc, polars; print('recpipe', recpipe.__version__, 'torch', torch.__version__)"

# ---- runtime: the venv, the load test, no compilers or pip caches --------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ARG VARIANT
LABEL org.opencontainers.image.title="recpipe" \
      org.opencontainers.image.description="recommender latency pipeline: gRPC feature, retrieval and ranking stages" \
      io.recpipe.variant="${VARIANT}"
# libgomp: OpenMP runtime that faiss and torch load on the CPU path.
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgomp1 \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --create-home --uid 10001 recpipe \
 && mkdir -p /artifacts && chown recpipe:recpipe /artifacts
COPY --from=build /opt/venv /opt/venv
COPY loadtest /app/loadtest
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    RECPIPE_VARIANT=${VARIANT} \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
WORKDIR /app
USER recpipe
EXPOSE 50051 50052 50053 50054 8089
# The services need --models/--data; docker-compose.yml gives each container its command.
CMD ["recpipe", "--help"]
