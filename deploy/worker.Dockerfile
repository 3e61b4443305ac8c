# A Prefect worker for kiln: the code at /opt/kiln, ready to run recompile-zoo flow runs.
#
# CPU (ONNX Runtime engines), polls the kiln-cpu pool:
#   docker build -f deploy/worker.Dockerfile -t kiln-worker:cpu .
#   docker run --rm -e PREFECT_API_URL=http://prefect.internal:4200/api \
#       -v kiln-state:/opt/kiln/.kiln -v "$PWD/out:/opt/kiln/out" kiln-worker:cpu
#
# GPU (TensorRT engines; one image per device class, one pool per device):
#   docker build -f deploy/worker.Dockerfile -t kiln-worker:h100 \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 \
#       --build-arg EXTRAS=models,pipeline,signing,tensorrt --build-arg POOL=kiln-gpu-h100 .
#   docker run --rm --gpus '"device=0"' -e PREFECT_API_URL=... kiln-worker:h100
#
# Register deployments for these workers with `kiln deploy --repo /opt/kiln` (the flow runs'
# working directory is where the code lives inside the image).
#
# Signing (deploy/README.md, 2c): mount the key made by `kiln signing init` as a secret and point the
# worker at it; every package it records is then signed, and its flow runs verify what they read:
#   docker run --rm -e PREFECT_API_URL=... \
#       -v /secure/kiln:/run/secrets/kiln:ro \
#       -e KILN_SIGNING_PRIVATE_KEY=/run/secrets/kiln/kiln-signing.pem \
#       -e KILN_SIGNING_PUBLIC_KEY=/run/secrets/kiln/kiln-signing.pub kiln-worker:cpu

ARG PYTHON=3.11
FROM python:${PYTHON}-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=models,pipeline,signing
ARG POOL=kiln-cpu

ENV PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    KILN_REPO=/opt/kiln \
    KILN_POOL=${POOL} \
    PREFECT_SERVER_ANALYTICS_ENABLED=false \
    KILN_SIGNING_PRIVATE_KEY= \
    KILN_SIGNING_PUBLIC_KEY=

WORKDIR /opt/kiln

# Dependencies first, so a code change does not reinstall torch.
COPY pyproject.toml ./
RUN mkdir -p compiler tasks flows zoo && touch README.md compiler/__init__.py tasks/__init__.py \
        flows/__init__.py zoo/__init__.py \
    && pip install --extra-index-url "${TORCH_INDEX}" ".[${EXTRAS}]" \
    && pip uninstall -y kiln

COPY compiler compiler
COPY tasks tasks
COPY flows flows
COPY zoo zoo
COPY registry registry
COPY deploy deploy
COPY README.md ./
RUN pip install --no-deps -e . \
    && useradd --create-home --uid 1000 kiln \
    && mkdir -p /opt/kiln/.kiln /opt/kiln/out \
    && chown -R kiln /opt/kiln/.kiln /opt/kiln/out

USER kiln
# Workspace, Prefect task cache and the persistent engine cache live under .kiln: mount a volume there
# so a restarted worker rebuilds nothing.
VOLUME ["/opt/kiln/.kiln"]

CMD ["sh", "-c", "exec prefect worker start --pool \"$KILN_POOL\""]
