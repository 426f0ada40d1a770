"""FSDP and DDP check of the Hugging Face stage-3 recipe on two GPUs, offline, in about five minutes.

Builds everything it needs without a network: a byte-level BPE tokenizer trained on the Python standard
library's sources, a randomly initialised Llama (about 125M parameters, GQA) saved with ``save_pretrained``,
and a JSONL corpus of those sources. Then runs ``finetune_hf_stage3_sparse`` through the ``sparse-train`` CLI
(selectors freshly initialised, ``init_from=null``), each run in its own process, on the same global
batches (``TextDataModule`` deals each global batch's rows round-robin to the ranks, so 1 GPU x 2B rows and
2 GPUs x B rows read the same rows at every step):

* ``single``:      1 GPU, ``2B`` rows per step, bf16-mixed (the recipe's precision)
* ``fsdp``:        ``--trainer.strategy=fsdp --trainer.devices=2``, ``B`` rows per GPU
* ``ddp``:         ``--trainer.strategy=ddp --trainer.devices=2``, ``B`` rows per GPU
* ``single_fp32`` and ``fsdp_fp32``: the same pair in ``32-true`` for fewer steps (bf16 noise removed, so
  sharding mistakes are not hidden by it; the sparse kernels' fp32 dots use TF32 on the GPU)

The logged ``train/lm_loss`` of a multi-GPU run is the global batch's token mean (each rank normalises by
all ranks' labelled tokens and the logged value is averaged over ranks), the number one GPU logs. Under
FSDP, Lightning's ``bf16-mixed`` also keeps parameters, buffers and the gradient reduction in bf16 (FSDP
``MixedPrecision``), while one GPU keeps fp32 parameters under autocast: the bf16 pair differs by more
than the DDP pair; the fp32 pair shows what the sharding itself changes.

Outputs (``--out``): ``losses.csv`` (per step, every run), ``summary.md`` (loss differences over the first
steps and all steps, tokens/s per GPU, peak memory per GPU, final-weight differences read from the
checkpoints Lightning wrote, ``load_weights`` of the FSDP checkpoint), ``logs/<run>.log``.

    source scripts/tools/gpu_env.sh && python3 -m scripts.tools.fsdp_check --out "$OUT/fsdp"
    python3 -m scripts.tools.fsdp_check --cpu-smoke --out /tmp/fsdp_smoke     # CPU dry run: tiny model, gloo, 3 steps

``--cpu-smoke`` runs the same pipeline on the CPU with a tiny model: one process, DDP on two gloo
processes, and FSDP on two gloo processes through Lightning's FSDPStrategy with the CPU shims of
:func:`install_cpu_fsdp_shims` (Lightning's FSDP is meant for GPUs; tests/parallel/test_fsdp.py uses the same shims).
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import math
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import lightning.pytorch.strategies.fsdp as lightning_fsdp
import torch
import transformers
from lightning.pytorch.strategies import FSDPStrategy
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    StateDictType,
)

from sparse_train.cli import main as cli_main
from sparse_train.lightning import HFCausalLMModule, load_weights

REPO = Path(__file__).resolve().parents[2]

# NVLink multicast off for every process (scripts/tools/gpu_env.sh sets the same; repeated here so that the
# script is safe when run without it).
MULTI_GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

GPU_SHAPE = dict(
    vocab_size=16384,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)
CPU_SHAPE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
FIRST_STEPS = 10
"""Loss differences are reported over the first steps (before the runs can drift apart) and over all."""


# ----------------------------------------------------------------------------------------- CPU shims
def install_cpu_fsdp_shims() -> type:
    """Make Lightning's ``FSDPStrategy`` run on the CPU (gloo) and return a strategy class for it.

    Three things stand in the way, each patched in this process only: Lightning refuses FSDP without a
    GPU (a check on the strategy name and on the exact class ``FSDPStrategy``; an empty subclass passes
    it); Lightning gives FSDP ``device_id=root_device.index``, None on a CPU, which FSDP1 refuses
    (``device_id=cpu`` is filled in); Lightning gathers the full state dict with ``offload_to_cpu=True``,
    which crashes FSDP1 (SIGSEGV, torch 2.13) when the parameters already live on the CPU (the same
    context is opened without the offload). The returned class is also ``CPUFSDPStrategy`` of this module.
    """
    if getattr(FullyShardedDataParallel.__init__, "_cpu_shim", False):
        return globals()["CPUFSDPStrategy"]
    init = FullyShardedDataParallel.__init__

    def init_on_cpu(self, module, *args, device_id=None, **kwargs):
        init(self, module, *args, device_id=torch.device("cpu") if device_id is None else device_id, **kwargs)

    init_on_cpu._cpu_shim = True
    FullyShardedDataParallel.__init__ = init_on_cpu

    def full_state_dict_without_offload(module, world_size, rank0_only=True):
        return FullyShardedDataParallel.state_dict_type(
            module,
            StateDictType.FULL_STATE_DICT,
            FullStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
            FullOptimStateDictConfig(offload_to_cpu=False, rank0_only=rank0_only),
        )

    lightning_fsdp._get_full_state_dict_context = full_state_dict_without_offload

    class CPUFSDPStrategy(FSDPStrategy):
        """Lightning's FSDPStrategy unchanged; the subclass only passes Lightning's no-GPU check."""

    CPUFSDPStrategy.__module__ = __name__
    globals()["CPUFSDPStrategy"] = CPUFSDPStrategy
    return CPUFSDPStrategy


# ----------------------------------------------------------------------------------------- workspace
def write_corpus(path: Path, max_chars: int) -> int:
    """The standard library's ``.py`` files (sorted, each one document) as JSONL, up to ``max_chars``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    total, lines = 0, []
    for file in sorted(root.rglob("*.py")):
        if "site-packages" in file.parts or "test" in file.parts:
            continue
        try:
            text = file.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text) < 200:
            continue
        lines.append(json.dumps({"text": text}))
        total += len(text)
        if total >= max_chars:
            break
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def build_model_dir(model_dir: Path, corpus: Path, shape: dict) -> int:
    """Train a byte-level BPE tokenizer on ``corpus`` and save it with a random Llama of ``shape`` (its
    ``vocab_size`` replaced by the tokenizer's) into ``model_dir``. Returns the parameter count."""
    texts = [json.loads(line)["text"] for line in corpus.read_text().splitlines() if line]
    specials = ["<unk>", "<pad>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=shape["vocab_size"],
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    fast.save_pretrained(model_dir)
    config = transformers.LlamaConfig(
        **{**shape, "vocab_size": tok.get_vocab_size()},
        tie_word_embeddings=False,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(model_dir)
    return sum(p.numel() for p in model.parameters())


# ----------------------------------------------------------------------------------------- runs
def run_plan(args) -> list[dict]:
    """The runs: name, devices, strategy, precision, steps, rows per device."""
    b = args.rows_per_gpu
    if args.cpu_smoke:
        return [
            dict(
                name="single",
                devices=1,
                strategy="auto",
                precision="32-true",
                steps=args.steps,
                rows=2 * b,
                checkpoint=True,
            ),
            dict(name="ddp", devices=2, strategy="ddp", precision="32-true", steps=args.steps, rows=b),
            dict(
                name="fsdp",
                devices=2,
                strategy='{"class_path": "__main__.CPUFSDPStrategy"}',
                precision="32-true",
                steps=args.steps,
                rows=b,
                cpu_fsdp=True,
                checkpoint=True,
            ),
        ]
    runs = [
        dict(
            name="single",
            devices=1,
            strategy="auto",
            precision="bf16-mixed",
            steps=args.steps,
            rows=2 * b,
            checkpoint=True,
        ),
        dict(
            name="fsdp", devices=2, strategy="fsdp", precision="bf16-mixed", steps=args.steps, rows=b, checkpoint=True
        ),
        dict(name="ddp", devices=2, strategy="ddp", precision="bf16-mixed", steps=args.steps, rows=b),
    ]
    if args.fp32_steps:
        runs += [
            dict(
                name="single_fp32",
                devices=1,
                strategy="auto",
                precision="32-true",
                steps=args.fp32_steps,
                rows=2 * b,
                checkpoint=True,
            ),
            dict(
                name="fsdp_fp32",
                devices=2,
                strategy="fsdp",
                precision="32-true",
                steps=args.fp32_steps,
                rows=b,
                checkpoint=True,
            ),
        ]
    return runs


def cli_command(run: dict, args, work: Path, model_dir: Path, corpus: Path) -> list[str]:
    root = work / "runs" / run["name"]
    callbacks = [{"class_path": "sparse_train.lightning.StepTimer"}]
    if run.get("checkpoint"):  # written at the last step: Lightning's full state dict (FSDP: gathered on rank 0)
        callbacks.append(
            {
                "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                "init_args": {"dirpath": str(root / "ckpt"), "save_last": True, "every_n_train_steps": run["steps"]},
            }
        )
    entry = (
        ["-m", "scripts.tools.fsdp_check", "--cli-with-cpu-fsdp"] if run.get("cpu_fsdp") else ["-m", "sparse_train.cli"]
    )
    cmd = [
        sys.executable,
        *entry,
        "fit",
        "--config",
        "finetune_hf_stage3_sparse",
        f"--model.init_args.pretrained_path={model_dir}",
        "--model.init_args.init_from=null",
        f"--data.init_args.paths=[{corpus}]",
        f"--data.init_args.seq_len={args.seq_len}",
        f"--data.init_args.batch_size={run['rows']}",
        "--data.init_args.val_fraction=0.0",
        f"--trainer.devices={run['devices']}",
        f"--trainer.strategy={run['strategy']}",
        f"--trainer.precision={run['precision']}",
        f"--trainer.max_steps={run['steps']}",
        "--trainer.log_every_n_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={root}",
        f"--trainer.callbacks={json.dumps(callbacks)}",
        "--logger_backend=csv",
    ]
    if args.cpu_smoke:
        cmd += [
            "--trainer.accelerator=cpu",
            "--model.init_args.sparse.block_q=16",
            "--model.init_args.sparse.block_k=16",
            "--model.init_args.sparse.top_k=2",
            "--model.init_args.sparse.window=1",
        ]
    return cmd


def read_metrics(root: Path) -> dict[int, dict[str, float]]:
    """Per step, the metrics of rank 0's ``metrics.csv`` (rows of one step merged)."""
    files = sorted(root.glob("logs/version_*/metrics.csv"))
    if not files:
        return {}
    steps: dict[int, dict[str, float]] = {}
    with open(files[-1]) as f:
        for row in csv.DictReader(f):
            if not row.get("step"):
                continue
            slot = steps.setdefault(int(row["step"]), {})
            for key, value in row.items():
                if key != "step" and value not in ("", None):
                    slot.setdefault(key, float(value))
    return steps


def median(values: list[float]) -> float:
    values = sorted(v for v in values if not math.isnan(v))
    if not values:
        return float("nan")
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else 0.5 * (values[mid - 1] + values[mid])


def loss_diffs(a: dict, b: dict, key: str = "train/lm_loss") -> dict[str, float]:
    common = sorted(s for s in a if s in b and key in a[s] and key in b[s])
    if not common:
        return {}
    diffs = [(s, abs(a[s][key] - b[s][key]), abs(a[s][key] - b[s][key]) / max(abs(b[s][key]), 1e-12)) for s in common]
    first = [d for d in diffs if d[0] < common[0] + FIRST_STEPS]
    return {
        "steps": len(common),
        "first_abs": max(d[1] for d in first),
        "first_rel": max(d[2] for d in first),
        "all_abs": max(d[1] for d in diffs),
        "all_rel": max(d[2] for d in diffs),
    }


def checkpoint_report(single: Path, sharded: Path) -> list[str]:
    """Final weights of two runs compared from their checkpoints, and ``load_weights`` of the sharded run's
    checkpoint into a freshly built module (selector tensors must load under their own names)."""
    a = torch.load(single, map_location="cpu", weights_only=False)
    b = torch.load(sharded, map_location="cpu", weights_only=False)
    sa, sb = a["state_dict"], b["state_dict"]
    lines = [
        f"- checkpoint keys equal: {sorted(sa) == sorted(sb)} ({len(sb)} tensors, "
        f"{sum('sparse_attention' in k for k in sb)} of them selector state)"
    ]
    for label, selector in (("model", False), ("selector", True)):
        keys = [k for k in sa if k in sb and sa[k].is_floating_point() and ("sparse_attention" in k) == selector]
        if keys:
            worst = max(float((sa[k].float() - sb[k].float()).abs().max()) for k in keys)
            scale = max(float(sa[k].float().abs().max()) for k in keys)
            lines.append(f"- final {label} weights: max |single - sharded| = {worst:.3e} (max |w| = {scale:.3e})")
    accepted = inspect.signature(HFCausalLMModule).parameters
    hp = {k: v for k, v in b["hyper_parameters"].items() if k in accepted}  # the CLI adds _class_path etc.
    module = HFCausalLMModule(**{**hp, "init_from": None})
    info = load_weights(module.model, str(sharded))
    lines.append(
        f"- load_weights(sharded checkpoint): missing {len(info['missing'])}, unexpected {len(info['unexpected'])}"
    )
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/fsdp_check")))
    parser.add_argument(
        "--work",
        type=Path,
        default=None,
        help="workspace: model, corpus, runs, checkpoints (default: a fresh temporary directory, deleted unless "
        "--keep)",
    )
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on the CPU, gloo, 3 steps")
    parser.add_argument("--steps", type=int, default=None, help="bf16 steps (default 30; CPU smoke 3)")
    parser.add_argument("--fp32-steps", type=int, default=None, help="steps of the fp32 pair, 0 = skip (default 10)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 2048; CPU smoke 128)")
    parser.add_argument("--rows-per-gpu", type=int, default=2, help="B: rows per GPU in the 2-GPU runs")
    parser.add_argument("--run-timeout", type=int, default=200, help="seconds per run at most")
    parser.add_argument(
        "--budget",
        type=int,
        default=540,
        help="seconds for everything: a run that cannot get 60 s before the budget (less a "
        "reserve for the summary) is skipped and reported",
    )
    parser.add_argument("--keep", action="store_true", help="keep the workspace (model, corpus, checkpoints)")
    args = parser.parse_args(argv)
    smoke = args.cpu_smoke
    args.steps = args.steps or (3 if smoke else 30)
    args.fp32_steps = (0 if smoke else 10) if args.fp32_steps is None else args.fp32_steps
    args.seq_len = args.seq_len or (128 if smoke else 2048)
    out = args.out
    # Not under --out: the checkpoints are gigabytes, and --out is what a runner copies back.
    work = args.work or Path(tempfile.mkdtemp(prefix="fsdp_check_"))
    (out / "logs").mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **MULTI_GPU_ENV, "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    os.environ.update(MULTI_GPU_ENV)

    t0 = time.perf_counter()
    corpus, model_dir = work / "corpus.jsonl", work / "model"
    docs = write_corpus(corpus, max_chars=300_000 if smoke else 3_000_000)
    params = build_model_dir(model_dir, corpus, CPU_SHAPE if smoke else GPU_SHAPE)
    print(
        f"[fsdp_check] workspace {work}: corpus {docs} documents, model {params / 1e6:.1f}M parameters "
        f"({time.perf_counter() - t0:.0f} s)",
        flush=True,
    )

    results, status = {}, {}
    reserve = 60  # the summary loads up to four checkpoints and builds two modules
    for run in run_plan(args):
        cmd = cli_command(run, args, work, model_dir, corpus)
        log = out / "logs" / f"{run['name']}.log"
        start = time.perf_counter()
        left = args.budget - (start - t0) - reserve
        with open(log, "w") as f:
            f.write(" ".join(cmd) + "\n\n")
            f.flush()
            if left < 60:
                rc = "skipped (budget)"
            else:
                try:
                    rc = subprocess.run(
                        cmd, cwd=work, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=min(args.run_timeout, left)
                    ).returncode
                except subprocess.TimeoutExpired:
                    rc = "timeout"
        status[run["name"]] = (rc, time.perf_counter() - start)
        results[run["name"]] = read_metrics(work / "runs" / run["name"])
        print(
            f"[fsdp_check] {run['name']}: rc={rc}, {status[run['name']][1]:.0f} s, "
            f"{len(results[run['name']])} logged steps",
            flush=True,
        )

    names = list(results)
    all_steps = sorted({s for r in results.values() for s in r})
    with open(out / "losses.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step"] + [f"{n}/{k}" for n in names for k in ("lm_loss", "loss", "selector_loss")])
        for s in all_steps:
            writer.writerow(
                [s]
                + [
                    results[n].get(s, {}).get(f"train/{k}", "")
                    for n in names
                    for k in ("lm_loss", "loss", "selector_loss")
                ]
            )

    lines = [
        f"# FSDP / DDP check ({'CPU smoke' if smoke else 'GPU'})",
        "",
        f"Model: random-init Llama, {params / 1e6:.1f}M parameters; recipe finetune_hf_stage3_sparse; "
        f"seq_len {args.seq_len}; {args.rows_per_gpu} rows per GPU on 2 GPUs = {2 * args.rows_per_gpu} rows "
        f"per step on 1 GPU (the same rows). Total {time.perf_counter() - t0:.0f} s.",
        "",
        "| run | rc | wall s | steps | lm_loss first -> last | tokens/s per GPU (median after warm-up) | "
        "tokens/s all GPUs | peak GiB per GPU |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in run_plan(args):
        r, (rc, wall) = results[run["name"]], status[run["name"]]
        steps = sorted(s for s in r if "train/lm_loss" in r[s])
        warm = 5 if len(r) > 10 else 1  # the first steps compile and warm up
        tps = median([r[s].get("throughput/tokens_per_s", float("nan")) for s in r if s >= warm])
        peak = max((r[s].get("memory/peak_allocated_gib", float("nan")) for s in r), default=float("nan"))
        first_last = f"{r[steps[0]]['train/lm_loss']:.4f} -> {r[steps[-1]]['train/lm_loss']:.4f}" if steps else "-"
        strategy = "fsdp (CPU shims)" if run.get("cpu_fsdp") else run["strategy"]
        lines.append(
            f"| {run['name']} ({run['devices']} dev, {strategy}, {run['precision']}) | "
            f"{rc} | {wall:.0f} | {len(steps)} | {first_last} | {tps:,.0f} | {tps * run['devices']:,.0f} | {peak:.2f} |"
        )
    lines += [
        "",
        f"Loss differences (train/lm_loss, global batch mean; first {FIRST_STEPS} steps and all steps):",
        "",
        "| pair | steps | max abs (first) | max rel (first) | max abs (all) | max rel (all) |",
        "|---|---|---|---|---|---|",
    ]
    for a, b in (("fsdp", "single"), ("ddp", "single"), ("fsdp", "ddp"), ("fsdp_fp32", "single_fp32")):
        if a in results and b in results:
            d = loss_diffs(results[a], results[b])
            if d:
                lines.append(
                    f"| {a} vs {b} | {d['steps']} | {d['first_abs']:.2e} | {d['first_rel']:.2e} | "
                    f"{d['all_abs']:.2e} | {d['all_rel']:.2e} |"
                )
    for a, b in (("fsdp", "single"), ("fsdp_fp32", "single_fp32")):
        ca, cb = work / "runs" / b / "ckpt" / "last.ckpt", work / "runs" / a / "ckpt" / "last.ckpt"
        if ca.is_file() and cb.is_file() and time.perf_counter() - t0 < args.budget - 20:
            lines += ["", f"Checkpoints, {a} vs {b}:"]
            try:
                lines += checkpoint_report(ca, cb)
            except Exception as exc:  # reported, not raised: the rest of the summary still matters
                lines.append(f"- checkpoint comparison failed: {type(exc).__name__}: {exc}")
    summary = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(summary)
    print(summary, flush=True)
    if not args.keep and args.work is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if all(rc == 0 for rc, _ in status.values()) else 1


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cli-with-cpu-fsdp"]:
        # A CLI run whose FSDP strategy is CPUFSDPStrategy (CPU smoke); Lightning's launcher re-runs this
        # same command line for the second rank, which installs the shims too.
        install_cpu_fsdp_shims()
        cli_main(sys.argv[2:])
    else:
        sys.exit(main())
