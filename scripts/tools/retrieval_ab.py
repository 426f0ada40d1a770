"""Run recipe variants side by side (seeds x variants) and summarise their learning quality.

Each run is ``python -m sparse_train.cli fit --config <recipe> <overrides> --seed_everything=<seed>``
in its own process and directory; up to ``--parallel`` run at once (on one GPU the small retrieval
models share it well; on a CPU use 1). ``--gpus G`` spreads the runs over G GPUs, run i on GPU i mod G. The summary
reads each run's ``metrics.csv`` and keeps, per
run, the last value of every metric that tells whether sparse attention learns what dense learns:
``val/acc``, ``val/needle_recall`` (and per layer), ``attn/mass_recall_mean`` / ``attn/mass_recall_p5``
(and per layer), ``attn/density``, the step time, plus the wall time and the final line.

    python -m scripts.tools.retrieval_ab --plan docs/benchmarks/plans/cpu_demo_ab.json --seeds 0 1 \\
        --parallel 8 --out runs/ab

The plan is a JSON list of ``{"name": ..., "config": <recipe name or path>, "args": [overrides]}``
(optionally ``"seeds": [...]`` to override ``--seeds`` for that variant). ``{seed}`` in an override is
replaced by the run's seed (e.g. a per-seed ``--ckpt_path`` written by a ``ForkPoint`` run).
``"resume": {"ckpt": <path with {seed}>, "hparams": {"model.sparse.dense_warmup_steps": 1700}}`` continues
a checkpoint with some of its stored hyperparameters changed: the CLI takes the model's arguments from
the checkpoint (it warns when they replace given ones), so the change is written into a copy of the
checkpoint in the run's directory, which the run resumes from.
Output: ``<out>/summary.json`` and ``<out>/summary.md`` (one row per run, then mean over seeds).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

KEEP_PREFIXES = (
    "val/",
    "attn/mass_recall",
    "attn/oracle_mass_recall",
    "attn/oracle_density",
    "attn/layers/",
    "attn/density",
    "attn/warmup",
    "train/acc",
    "time/step_ms",
    "throughput/tokens_per_s",
)


def last_values(run_dir: Path) -> dict[str, float]:
    """Last logged value of each kept metric in the run's CSV log(s)."""
    out: dict[str, float] = {}
    for path in sorted(run_dir.rglob("metrics.csv")):
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                for key, value in row.items():
                    if value in ("", None) or not key.startswith(KEEP_PREFIXES):
                        continue
                    try:
                        out[key] = float(value)
                    except ValueError:
                        continue
    return out


def resume_copy(resume: dict, seed: int, run_dir: Path) -> Path:
    """A copy of ``resume["ckpt"]`` (``{seed}`` replaced) in ``run_dir`` whose stored hyperparameters have
    ``resume["hparams"]`` set (dotted keys into ``hyper_parameters``; each key must exist)."""
    source = resume["ckpt"].replace("{seed}", str(seed))
    ckpt = torch.load(source, map_location="cpu", weights_only=False)
    for dotted, value in resume.get("hparams", {}).items():
        *parents, leaf = dotted.split(".")
        node = ckpt["hyper_parameters"]
        for key in parents:
            node = node[key]
        if leaf not in node:
            raise KeyError(f"{source}: hyper_parameters has no {dotted!r}")
        node[leaf] = value
    target = run_dir / "resume.ckpt"
    torch.save(ckpt, target)
    return target


def run_one(job: dict, out: Path, timeout: float, extra_env: dict[str, str]) -> dict:
    name, seed = job["name"], job["seed"]
    run_dir = out / f"{name}_s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = [arg.replace("{seed}", str(seed)) for arg in job.get("args", [])]
    if "resume" in job:
        overrides.append(f"--ckpt_path={resume_copy(job['resume'], seed, run_dir)}")
    cmd = [
        sys.executable,
        "-m",
        "sparse_train.cli",
        "fit",
        "--config",
        job["config"],
        *overrides,
        f"--seed_everything={seed}",
        f"--trainer.default_root_dir={run_dir}",
        "--trainer.enable_progress_bar=false",
    ]
    env = {**os.environ, **extra_env}
    start = time.perf_counter()
    with (run_dir / "log.txt").open("w") as log:
        try:
            proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    minutes = (time.perf_counter() - start) / 60
    final = [
        line.strip()
        for line in (run_dir / "log.txt").read_text(errors="replace").splitlines()
        if "[sparse-train] done" in line
    ]
    result = {
        "name": name,
        "seed": seed,
        "rc": rc,
        "minutes": round(minutes, 2),
        "final_line": final[-1] if final else None,
        "metrics": last_values(run_dir),
        "command": cmd,
    }
    print(f"{name} seed {seed}: rc={rc} {minutes:.1f} min  {result['final_line']}", flush=True)
    return result


def summarise(results: list[dict]) -> str:
    keys = [
        "val/acc",
        "val/loss",
        "val/needle_recall",
        "attn/mass_recall_mean",
        "attn/mass_recall_p5",
        "attn/oracle_mass_recall_mean",
        "attn/oracle_mass_recall_p5",
        "attn/oracle_density_r90",
        "attn/density",
    ]
    lines = ["| run | seed | " + " | ".join(keys) + " | minutes |", "|" + "---|" * (len(keys) + 3)]
    for r in results:
        cells = [f"{r['metrics'][k]:.3f}" if k in r["metrics"] else "-" for k in keys]
        lines.append(f"| {r['name']} | {r['seed']} | " + " | ".join(cells) + f" | {r['minutes']} |")
    lines += ["", "| run (mean over seeds) | " + " | ".join(keys) + " |", "|" + "---|" * (len(keys) + 1)]
    for name in dict.fromkeys(r["name"] for r in results):
        group = [r for r in results if r["name"] == name]
        cells = []
        for k in keys:
            values = [r["metrics"][k] for r in group if k in r["metrics"]]
            cells.append(f"{statistics.mean(values):.3f}" if values else "-")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", required=True, help="JSON list of {name, config, args}")
    parser.add_argument("--only", nargs="*", help="run only these variant names")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per run")
    parser.add_argument("--threads", type=int, default=None, help="OMP/MKL threads per run")
    parser.add_argument(
        "--gpus",
        type=int,
        default=0,
        help="spread the runs over this many GPUs (0: leave CUDA_VISIBLE_DEVICES as it is)",
    )
    parser.add_argument("--out", default="runs/ab")
    args = parser.parse_args(argv)
    plan = json.loads(Path(args.plan).read_text())
    jobs = [
        {**variant, "seed": seed}
        for variant in plan
        for seed in variant.get("seeds", args.seeds)
        if not args.only or variant["name"] in args.only
    ]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONUNBUFFERED": "1"}
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))

    def launch(numbered: tuple[int, dict]) -> dict:
        i, job = numbered
        gpu = {"CUDA_VISIBLE_DEVICES": str(i % args.gpus)} if args.gpus > 0 else {}
        return run_one(job, out, args.timeout, {**env, **gpu})

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        results = list(pool.map(launch, enumerate(jobs)))
    for run in out.rglob("resume.ckpt"):  # copies of checkpoints, not results
        run.unlink()
    (out / "summary.json").write_text(json.dumps(results, indent=1))
    table = summarise(results)
    (out / "summary.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
