# Triton's server image with torch and kiln installed into the Python its Python-backend stub embeds
# (the stub ignores PYTHONPATH; see serving/triton/backend/model.py). Pick the Triton release whose
# image carries Python 3.11 or newer, as kiln requires; the stub in /opt/tritonserver/backends/python
# is built for that image's Python. GPU models also need torch's CUDA build matching the image's CUDA.
ARG TRITON_IMAGE=nvcr.io/nvidia/tritonserver:25.01-py3
FROM ${TRITON_IMAGE}
COPY . /opt/kiln
RUN python3 -m pip install --no-cache-dir torch==2.13.0 -c /opt/kiln/constraints.txt /opt/kiln
