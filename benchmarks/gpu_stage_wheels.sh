#!/usr/bin/env bash
# The wheels a GPU machine without package registries lacks for kiln's pipeline, staged here and carried
# there in two device calls (issue 41, item 6). The GPU image (Python 3.12, torch 2.11+cu130,
# transformers, onnx, onnxruntime, numpy, pandas, pyarrow, matplotlib, rich, typer, grpcio, protobuf, ...;
# /work/.library/device/KINDS.md, "Python packages already there") lacks Prefect, MLflow, model-signing
# and what they need, and tritonserver.
#
# Here (a machine where pip reaches PyPI), from the repository root:
#   bash benchmarks/gpu_stage_wheels.sh            # .whl/ (first call) and .whl2/ (second call)
#
# .whl/  : the `pipeline` extra's closure (Prefect, MLflow, asyncpg, ...), `signing`'s (model-signing,
#          cryptography, sigstore, ...) and kiln's core needs, resolved for CPython 3.12 manylinux x86_64
#          against constraints.txt (the versions the suite runs), less every package the GPU image has.
#          Dask (task_runner: dask) is left out: the default thread runner never imports it. MLflow's
#          wheel is repacked without its web UI's JavaScript (mlflow/server/js, 7.7 MB): kiln uses the
#          embedded sqlite store and `mlflow models serve`, never the UI, and without it the first carry
#          fits with the working tree in one call's 64 MiB.
# .whl2/ : nvidia-pytriton (its tritonserver, 55 MB), tritonclient and python-rapidjson (tritonclient's
#          gRPC client; the HTTP one would need gevent).
#
# There (the device tool's `run`), on a warm machine, each call carrying one folder:
#   call 1, carry [".whl"]:  bash benchmarks/gpu_stage_wheels.sh install .whl
#   call 2, carry [".whl2"]: bash benchmarks/gpu_stage_wheels.sh install .whl2 && \
#                            bash benchmarks/gpu_stage_wheels.sh check
#   every later call:        export PYTHONPATH=$PWD:/tmp/site; export PATH=/tmp/site/bin:$PATH
# `install DIR` is `pip install --no-deps --no-index --target /tmp/site DIR/*.whl`; `check` imports
# Prefect, MLflow, model-signing, tritonclient and the server binary, and lists every requirement of an
# installed distribution that is missing (exit 1) or whose installed version is outside its bounds
# (printed: a GPU image package older than the lock).
set -euo pipefail

SITE=${KILN_GPU_SITE:-/tmp/site}
PY=${PYTHON:-python3}

# From KINDS.md (read 2026-11-17): the GPU image's packages, normalized names.
GPU_IMAGE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch
build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage
cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops
equinox etils execnet filelock flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch
grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna imageio iniconfig
interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro
nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13
nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers
setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
xxhash yarl zipp"

# pip matches manylinux tags exactly: every glibc level a wheel here is tagged with.
PLATFORMS=()
for tag in manylinux1 manylinux2014 manylinux_2_5 manylinux_2_17 manylinux_2_24 manylinux_2_27 \
    manylinux_2_28 manylinux_2_31 manylinux_2_34 manylinux_2_35; do
  PLATFORMS+=(--platform "${tag}_x86_64")
done
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}")

# What kiln needs there beyond the image: the pipeline and signing extras and the core dependencies
# (pyproject.toml), less Dask (lazy, for task_runner: dask only).
REQUIREMENTS=(
  "prefect>=3.9" "fastapi<0.155" "mlflow>=3.17" "pydantic>=2.6" "pyyaml>=6" "typer>=0.12" "rich>=13"
  "matplotlib>=3.8" "model-signing>=1.1,<2" "pyopenssl>=24" "platformdirs>=4" "filelock>=3.12"
  "safetensors>=0.4" "onnxscript>=0.3"
)
SERVING=("nvidia-pytriton==0.7.0" "tritonclient==2.73.0" "python-rapidjson==1.25")

download() {
  [[ -f pyproject.toml && -f constraints.txt ]] || { echo "run from the kiln repository root" >&2; exit 2; }
  work=$(mktemp -d)  # global: the EXIT trap reads it after this function returned
  trap 'rm -rf "$work"' EXIT
  # The lock's pins (nvidia-pytriton's line carries a --no-deps note pip cannot read as a constraint).
  sed 's/ *#.*//' constraints.txt | grep -v -e '^$' -e '^nvidia-pytriton' >"$work/constraints.txt"
  echo "resolving for CPython 3.12 manylinux x86_64 against constraints.txt ..."
  "$PY" -m pip install -q --dry-run --ignore-installed "${TARGET[@]}" --target "$work/t" \
    --report "$work/report.json" -c "$work/constraints.txt" "${REQUIREMENTS[@]}"
  "$PY" - "$work/report.json" "$GPU_IMAGE" >"$work/need.txt" <<'EOF'
import json, re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
have = {norm(n) for n in sys.argv[2].split()}
for item in json.load(open(sys.argv[1]))["install"]:
    meta = item["metadata"]
    if norm(meta["name"]) not in have:
        print(f"{meta['name']}=={meta['version']}")
EOF
  echo "$(wc -l <"$work/need.txt") packages the GPU image lacks; downloading into .whl/ ..."
  rm -rf .whl .whl2
  "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d .whl -r "$work/need.txt"
  strip_mlflow_ui .whl
  echo "downloading the server and its client into .whl2/ ..."
  "$PY" -m pip download -q --no-deps "${TARGET[@]}" -d .whl2 "${SERVING[@]}"
  grep -qx '/.whl2/' .gitignore || echo "note: add /.whl2/ to .gitignore (it must not be committed)" >&2
  echo
  du -sh .whl .whl2
  local tree
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
  for dir in .whl .whl2; do
    local bytes
    bytes=$(du -cb "$dir" | tail -1 | cut -f1)
    echo "$dir: $((bytes / 1048576)) MiB of wheels + $((tree / 1048576)) MiB of working tree =" \
      "$(((bytes + tree) / 1048576)) MiB of a call's 64 MiB"
    if ((bytes + tree > 64 * 1048576)); then
      echo "$dir does not fit one device call with the working tree" >&2
      exit 1
    fi
  done
  cat <<EOF

On the GPU machine, warm, one call each:
  carry [".whl"]:  bash benchmarks/gpu_stage_wheels.sh install .whl
  carry [".whl2"]: bash benchmarks/gpu_stage_wheels.sh install .whl2 && bash benchmarks/gpu_stage_wheels.sh check
then in each later call: export PYTHONPATH=\$PWD:$SITE PATH=$SITE/bin:\$PATH
EOF
}

strip_mlflow_ui() {
  # MLflow's wheel without mlflow/server/js (the web UI's build): its RECORD loses those lines too.
  local wheel
  wheel=$(ls "$1"/mlflow-[0-9]*.whl 2>/dev/null | head -1)
  [[ -n "$wheel" ]] || return 0
  "$PY" - "$wheel" <<'EOF'
import os, sys, zipfile
path = sys.argv[1]
tmp = path + ".tmp"
dropped = 0
with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if info.filename.startswith("mlflow/server/js/"):
            dropped += info.compress_size
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            data = b"".join(l for l in data.splitlines(True) if not l.startswith(b"mlflow/server/js/"))
        dst.writestr(info, data)
os.replace(tmp, path)
print(f"mlflow: its web UI left out of the wheel ({dropped / 1e6:.1f} MB)")
EOF
}

install() {
  local dir=${1:?install DIR: the carried wheel folder}
  compgen -G "$dir/*.whl" >/dev/null || { echo "no wheels in $dir (was it carried?)" >&2; exit 2; }
  local start=$SECONDS
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$dir"/*.whl
  echo "installed $(ls "$dir"/*.whl | wc -l) wheels from $dir into $SITE in $((SECONDS - start)) s"
}

check() {
  PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" "$PY" - "$SITE" <<'EOF'
import importlib, importlib.metadata as md, shutil, sys
from pathlib import Path
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

site = sys.argv[1]
installed = {canonicalize_name(d.metadata["Name"]): d for d in md.distributions()}
missing, outside = [], []
for dist in md.distributions(path=[site]):
    name = dist.metadata["Name"]
    if canonicalize_name(name) == "nvidia-pytriton":
        continue  # kiln runs its tritonserver only (its Python package pins numpy<2)
    for text in dist.requires or []:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        found = installed.get(canonicalize_name(req.name))
        if found is None:
            missing.append(f"{name} needs {req}")
        elif req.specifier and not req.specifier.contains(found.version, prereleases=True):
            outside.append(f"{name} needs {req}, found {found.version}")
for line in outside:
    print("version outside bounds:", line)
for line in missing:
    print("MISSING:", line)
failed = []
for module in ("prefect", "mlflow", "model_signing", "tritonclient.grpc", "asyncpg"):
    try:
        importlib.import_module(module)
    except Exception as exc:
        failed.append(f"import {module}: {type(exc).__name__}: {exc}")
server = Path(site, "pytriton", "tritonserver", "bin", "tritonserver")
if not server.is_file():
    failed.append(f"no tritonserver at {server} (install .whl2)")
print("\n".join(failed) or "prefect, mlflow, model_signing, tritonclient.grpc, asyncpg import; tritonserver is there")
print(f"mlflow CLI: {shutil.which('mlflow') or 'not on PATH (add ' + site + '/bin)'}")
sys.exit(1 if missing or failed else 0)
EOF
}

case ${1:-download} in
download) download ;;
install) install "${2:-}" ;;
check) check ;;
*) echo "usage: $0 [download | install DIR | check]" >&2; exit 2 ;;
esac
