# syntax=docker/dockerfile:1
# kvpilot images, one per target:
#   docker build --target engine   -t kvpilot/engine:0.1.0 .     # `kvpilot serve` on a CUDA GPU
#   docker build --target operator -t kvpilot/operator:0.1.0 .   # `kvpilot operator` (no torch)
# Both run as a non-root user and carry no credentials: API keys and hub tokens come from Secrets
# at run time (InferenceService apiKeySecretRef / model.tokenSecretRef).

ARG PYTHON_VERSION=3.11
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# ---- wheel: the kvpilot wheel, built once for both images -------------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS wheel
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvpilot/ kvpilot/
COPY engine/ engine/
COPY kernels/ kernels/
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- operator: slim Python, kopf and the cluster operator only ------------------------------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS operator
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY --from=wheel /wheels /wheels
# The [operator] extra pulls kopf and aiohttp; torch and transformers stay out of this image. The local
# platform and the demo (`kvpilot up`, `make demo`) are not part of the cluster operator and are removed.
# DL3013: the package installed is the wheel built above; its dependencies' ranges live in pyproject.toml.
# hadolint ignore=DL3013
RUN WHEEL="$(find /wheels -name 'kvpilot-*.whl')" \
    && pip install --no-cache-dir "${WHEEL}[operator]" \
    && rm -rf /wheels \
    && SITE="$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    && rm -rf "${SITE}/kvpilot/operator/local" "${SITE}/kvpilot/operator/demo" \
    && useradd --uid 65532 --user-group --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kvpilot
USER 65532:65532
EXPOSE 8080
ENTRYPOINT ["kvpilot"]
CMD ["operator", "--all-namespaces", "--liveness=http://0.0.0.0:8080/healthz", "--log-format=json"]

# ---- engine: CUDA runtime, torch and triton, the engine and its OpenAI server ------------------------
FROM ${CUDA_IMAGE} AS engine
ARG TORCH_VERSION=2.13.0
ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/kvpilot \
    PATH=/opt/kvpilot/bin:$PATH \
    HF_HOME=/var/cache/huggingface \
    TRITON_CACHE_DIR=/tmp/triton \
    XDG_CACHE_HOME=/tmp/cache
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev build-essential \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv "${VIRTUAL_ENV}"
COPY --from=wheel /wheels /wheels
# torch's CUDA wheels bring their CUDA libraries and triton (used for the paged-attention kernels);
# the runtime base image provides the driver-facing CUDA runtime. Triton compiles kernels at run time,
# hence the compiler from build-essential and the Python headers. DL3013: as in the operator image.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && WHEEL="$(find /wheels -name 'kvpilot-*.whl')" \
    && pip install --no-cache-dir "${WHEEL}[engine]" \
    && rm -rf /wheels \
    && python -c "import triton, torch; print('torch', torch.__version__, 'triton', triton.__version__)" \
    && useradd --uid 1000 --user-group --create-home --home-dir /home/kvpilot --shell /usr/sbin/nologin kvpilot \
    && mkdir -p "${HF_HOME}" && chown kvpilot:kvpilot "${HF_HOME}"
USER 1000:1000
WORKDIR /home/kvpilot
EXPOSE 8000
ENTRYPOINT ["kvpilot"]
CMD ["serve", "--help"]
