"""A fleet recompiling one zoo: a local engine cache per worker vs one shared cache on S3 (moto).

The example zoo (deploy/zoo.yaml) plus repeated-block encoders (split per block, so their blocks
recur across models) is split round-robin over 2 and 4 worker processes, each with a cold cache of
its own; side by side, the same workers share one cache on an S3 server (moto, 127.0.0.1) with a
cold local layer each. Per configuration: engine builds in the fleet, cache hits, wall time of the
whole fleet. All workers of a configuration run at once, so the wall times are for this machine's
cores (named in the JSON), not a fleet's.

Then the projection docs/scaling.md quotes: a nightly recompile of a 1,000-model zoo on 4 device
classes, from these dedup ratios and the H100 TensorRT-RTX build times and engine sizes in
benchmarks/results/ (tensorrt_rtx_build_proof.json, gpu_runtime_h100.json).

Run: python3 -m benchmarks.fleet_cache [--workers 2,4]
Writes benchmarks/results/fleet_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# Repeated-block models: their blocks share fingerprints across models and depths.
EXTRA = [
    {
        "name": "enc4",
        "factory": "zoo.models:bert_encoder",
        "factory_kwargs": {"num_layers": 4},
        "split": "auto",
    },
    {
        "name": "enc6",
        "factory": "zoo.models:bert_encoder",
        "factory_kwargs": {"num_layers": 6},
        "split": "auto",
    },
    {
        "name": "rep6",
        "factory": "zoo.models:repeated_fallback",
        "factory_kwargs": {"depth": 6},
        "split": None,
    },
]


def model_list() -> list[dict]:
    import yaml

    zoo = yaml.safe_load((ROOT / "deploy" / "zoo.yaml").read_text())
    models = [
        {
            "name": m["name"],
            "factory": m["factory"],
            "factory_kwargs": m.get("factory_kwargs", {}),
            "split": None,
        }
        for m in zoo["models"]
        if "factory" in m
    ]
    return models + EXTRA


def worker(spec: dict) -> dict:
    """One worker: compile its models through its cache; report builds, hits, seconds."""
    import importlib

    import compiler

    cache = compiler.EngineCache(spec["cache"], local_dir=spec["local"])
    start = time.perf_counter()
    for model in spec["models"]:
        module, name = model["factory"].split(":")
        case = getattr(importlib.import_module(module), name)(**model["factory_kwargs"])
        program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        options = {"split_modules": model["split"]} if model["split"] else {}
        compiler.compile(program, cache=cache, **options)
    stats = cache.stats
    return {
        "models": [m["name"] for m in spec["models"]],
        "builds": stats.builds,
        "hits": stats.hits,
        "remote_hits": stats.remote_hits,
        "published": stats.remote_publishes,
        "seconds": round(time.perf_counter() - start, 2),
    }


def fleet(n: int, shared: bool, models: list[dict], tmp: Path, endpoint: str) -> dict:
    run = f"{'shared' if shared else 'local'}-{n}"
    specs = [
        {
            "cache": f"s3://kiln/{run}" if shared else str(tmp / run / f"w{i}" / "cache"),
            "local": str(tmp / run / f"w{i}" / "local"),
            "models": models[i::n],
        }
        for i in range(n)
    ]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "OMP_NUM_THREADS": "1",
    }
    start = time.perf_counter()
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.fleet_cache", "--worker", json.dumps(s)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for s in specs
    ]
    workers = []
    for proc in procs:
        out, _ = proc.communicate(timeout=3600)
        if proc.returncode != 0:
            raise RuntimeError(f"{run}: a worker failed ({proc.returncode})")
        workers.append(json.loads(out.strip().splitlines()[-1]))
    return {
        "workers": n,
        "cache": "shared (S3, moto)" if shared else "local per worker",
        "builds": sum(w["builds"] for w in workers),
        "hits": sum(w["hits"] for w in workers),
        "wall_s": round(time.perf_counter() - start, 2),
        "per_worker": workers,
    }


def projection(families: int = 50, models: int = 1000, classes: int = 4, workers_per_class: int = 8) -> dict:
    """A nightly recompile of ``models`` BERT-base-class models (fp16, split per block) on ``classes``
    device classes, from the H100 measurements: TensorRT-RTX build seconds and engine bytes per unique
    block (tensorrt_rtx_build_proof.json) and per model with and without dedup (gpu_runtime_h100.json).

    Assumption (stated in docs/scaling.md): the models come from ``families`` distinct structures
    (architecture x shapes x precision); fine-tunes of one family share every engine, as
    bert_base_768x12 and bert_encoder_768 share all three of theirs in the proof."""
    proof = json.loads((RESULTS / "tensorrt_rtx_build_proof.json").read_text())
    blocks = proof["models"]["bert_base_768x12"]["blocks"]["fp16"]["fingerprints"].values()
    unique_s = sum(r["full"]["seconds"] for r in blocks)
    unique_bytes = sum(r["full"]["engine_bytes"] for r in blocks)
    unique_stripped = sum(r["stripped"]["engine_bytes"] for r in blocks)
    per_instance_bytes = sum(r["full"]["engine_bytes"] * r["instances"] for r in blocks)
    n_unique, n_instances = len(blocks), sum(r["instances"] for r in blocks)
    gpu = json.loads((RESULTS / "gpu_runtime_h100.json").read_text())
    row = next(r for r in gpu["compile_seconds"] if r["model"] == "bert_base" and r["precision"] == "fp16")
    jobs = models * classes
    scenarios = {
        "no_dedup": (
            jobs * n_instances,
            jobs * row["trt_rtx_split_no_dedup_build_s"],
            jobs * per_instance_bytes,
        ),
        # kiln with no cache between models: each model's own blocks once
        "per_model_dedup": (jobs * n_unique, jobs * row["trt_rtx_split_dedup_build_s"], jobs * unique_bytes),
        # a cold local cache per worker: every worker meets (nearly) every family once
        "cache_per_worker": (
            workers_per_class * families * classes * n_unique,
            workers_per_class * families * classes * unique_s,
            workers_per_class * families * classes * unique_bytes,
        ),
        # one fleet cache, cold (first night, or a TensorRT upgrade changed every key)
        "fleet_cache_cold": (
            families * classes * n_unique,
            families * classes * unique_s,
            families * classes * unique_bytes,
        ),
        # one fleet cache, a usual night: weights changed (refit, no build), 1 family's structure new
        "fleet_cache_warm": (classes * n_unique, classes * unique_s, classes * unique_bytes),
    }
    return {
        "assumptions": {
            "models": models,
            "device_classes": classes,
            "structure_families": families,
            "workers_per_class": workers_per_class,
            "model": "BERT-base 768x12, fp16, split per block, TensorRT-RTX 1.7.1 on an H100 for every class",
            "blocks_per_model": n_instances,
            "unique_blocks_per_model": n_unique,
            "unique_block_build_s_sum": round(unique_s, 2),
            "model_build_s_no_dedup": row["trt_rtx_split_no_dedup_build_s"],
            "model_build_s_dedup": row["trt_rtx_split_dedup_build_s"],
            "unique_engine_bytes_sum": unique_bytes,
            "unique_stripped_engine_bytes_sum": unique_stripped,
        },
        "engine_builds": {k: int(v[0]) for k, v in scenarios.items()},
        "build_gpu_hours": {k: round(v[1] / 3600, 2) for k, v in scenarios.items()},
        "cache_gib_full_engines": {k: round(v[2] / 1024**3, 2) for k, v in scenarios.items()},
        "cache_gib_stripped_fleet": round(families * classes * unique_stripped / 1024**3, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument(
        "--projection-only", action="store_true", help="recompute the projection into the existing JSON"
    )
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    if args.projection_only:
        path = RESULTS / "fleet_cache.json"
        stored = json.loads(path.read_text())
        stored["projection_1000_models_4_classes"] = projection()
        path.write_text(json.dumps(stored, indent=2, sort_keys=True))
        print(json.dumps(stored["projection_1000_models_4_classes"], indent=1))
        return
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="t", aws_secret_access_key="t"
    ).create_bucket(Bucket="kiln")
    models = model_list()
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-fleet-") as tmp:
            for n in (int(x) for x in args.workers.split(",")):
                for shared in (False, True):  # side by side, same model split
                    rows.append(fleet(n, shared, models, Path(tmp), endpoint))
                    last = rows[-1]
                    print(
                        f"{last['cache']:>20}  workers {n}: builds {last['builds']}, wall {last['wall_s']}s"
                    )
    finally:
        server.stop()
    local = [r for r in rows if r["cache"].startswith("local")]
    shared = [r for r in rows if r["cache"].startswith("shared")]
    ratio_rows = []
    for lo, sh in zip(local, shared, strict=True):
        ratio_rows.append(
            {
                "workers": lo["workers"],
                "builds_local": lo["builds"],
                "builds_shared": sh["builds"],
                "builds_shared_over_local": round(sh["builds"] / lo["builds"], 3) if lo["builds"] else None,
                "wall_local_s": lo["wall_s"],
                "wall_shared_s": sh["wall_s"],
                "wall_shared_over_local": round(sh["wall_s"] / lo["wall_s"], 3),
            }
        )
    from benchmarks._common import print_table, write_json

    print_table(
        f"fleet recompile of {len(models)} models ({cpu_model()})",
        [
            "workers",
            "builds local",
            "builds shared",
            "shared/local",
            "wall local s",
            "wall shared s",
            "wall ratio",
        ],
        [list(r.values()) for r in ratio_rows],
    )
    plan = projection()
    print_table(
        "nightly 1,000 models x 4 device classes (H100 TensorRT-RTX build times and sizes)",
        ["", "no dedup", "per-model dedup", "cache per worker", "fleet cache, cold", "fleet, usual night"],
        [
            ["engine builds", *plan["engine_builds"].values()],
            ["GPU build hours", *plan["build_gpu_hours"].values()],
            ["cache GiB (full engines)", *plan["cache_gib_full_engines"].values()],
        ],
    )
    write_json(
        "fleet_cache",
        {
            "cpu_model": cpu_model(),
            "models": [m["name"] for m in models],
            "runs": rows,
            "ratios": ratio_rows,
            "projection_1000_models_4_classes": plan,
            "note": "workers of one configuration run at once on this machine's cores; cold caches each run",
        },
    )


if __name__ == "__main__":
    main()
