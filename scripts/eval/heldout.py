"""Held-out selector evaluation in a plain PyTorch training loop: dense twin, learned selectors and oracles
trained at equal steps on task families no recipe was tuned for.

Every (family, sequence length, mode, seed) is one job: the model of :mod:`scripts.eval.model` built from
the seed (the same initial weights and the same training rows in every mode), trained for ``--steps``
steps (the first ``--short-steps`` on rows of ``--short-len`` tokens, then ``--mid-steps`` on rows of ``--mid-len``
tokens, a length curriculum: the lookups are learnt where attention at initialisation is not spread over
thousands of keys) with one AdamW over ``model.parameters()``, loss = cross-entropy on the answer positions
+ ``st.collect_selector_losses(model)``, ``st.clip_grad_norms(model, 1.0)``, bf16 autocast on CUDA; then
evaluated on held-out rows (another seed stream, the same rows for every mode and seed). Jobs run
``--jobs`` at a time in spawned worker processes; each finished job appends one JSON line to
``OUT/results.jsonl`` (a rerun skips the jobs found there), and ``OUT/summary.md``, ``summary.json`` and
``plot.png`` are rebuilt from that file (``--summarize OUT`` does only that).

    python -m scripts.eval.heldout --families needles,multihop,vartrack,copy,assoc \\
        --modes dense,pooled,token,oracle --seeds 0,1 --seq-len 2048 --steps 800 --short-steps 300 --batch 16 \\
        --jobs 8 --device cuda --stop-after-min 7 --out runs/heldout_2k

Modes (``MODES``): ``dense`` (causal SDPA), ``row_oracle`` (this runner's own: each query row keeps its
``top_k`` key blocks of largest dense attention mass, plus window and sinks, as a mask on SDPA), and
``st.SparseAttention`` with the keyword arguments of the table on top of the shared ones
(:func:`sparse_kwargs`: 64-token key and query blocks, ``--block-q`` for fewer query rows per selection,
``top_k`` = the facts the family's question needs or ``--top-k``, window 1, sink 1, the model's RoPE base and
convention, a dense warm-up of the short-row steps and ``--warmup-fraction`` of the full-length steps; the row
oracle keeps the same warm-up). ``token_cand`` is
``token_kl`` with ``selector_candidates`` = :data:`CANDIDATES_PER_TOP_K` x ``top_k`` at every length; ``default`` is
the module's selector defaults (``SparseAttentionConfig``'s, whatever they are).
A mode whose keywords this sparse_train's ``SparseAttentionConfig`` does not accept is reported as not
supported and skipped; ``pooled`` then runs without the selector keywords (the module's only selector,
scoring the rotated q and k as given, since un-rotating with another RoPE convention would be wrong).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import sparse_train as st

from .model import EvalModel, RowOracleCore
from .tasks import FAMILIES, IGNORE, VOCAB_SIZE, family, make_batch, stream_seed

# mode -> SparseAttentionConfig keyword arguments on top of sparse_kwargs(); None = not st.SparseAttention
# (dense: causal SDPA; row_oracle: RowOracleCore). Each mode names the selector fields its meaning depends on,
# not the module's defaults: token = block-level KL on exact scores, token_kl = token-level KL on exact scores;
# default = whatever this sparse_train's SparseAttentionConfig defaults to.
MODES: dict[str, dict | None] = {
    "dense": None,
    "pooled": {"selector": "pooled"},
    "token": {"selector": "token", "selector_distill": "block", "selector_candidates": None},
    "token_kl": {"selector": "token", "selector_distill": "token", "selector_candidates": None},
    "token_cand": {"selector": "token", "selector_distill": "token"},
    "default": {},
    "oracle": {"selector": "oracle"},
    "row_oracle": None,
}
LEARNED = ("pooled", "token", "token_kl", "token_cand", "default")
DEFAULT_MODE_FIELDS = ("selector", "selector_distill", "selector_candidates", "distill", "selector_dim")
"""The ``SparseAttentionConfig`` defaults a ``default`` job's key records (with the shortest sequence that takes
candidates), so a rerun under other defaults runs the job again instead of resuming from it."""
CANDIDATES_PER_TOP_K = 2
"""``token_cand``: ``selector_candidates`` = this many times the family's ``top_k``."""
BLOCK = 64
BLOCK_Q_CHOICES = (16, 32, 64)
"""``--block-q`` values: query blocks the token selector's kernels take, up to the key block."""
WINDOW = 1
SINKS = 1

# Wall-time estimate. Aggregate bf16 throughput of several small-model jobs sharing one H200, and the cost
# of a sparse training step relative to a dense one, both derived from
# docs/benchmarks/selector_quality_lm8k_hard4k.json (lm8k_dense / lm8k_sparse_k8: a 4-layer
# d_model 256 model at 8K, batch 4, 600 steps, runs sharing the GPU: 1.4 min dense, 3.2 min sparse).
EST_AGGREGATE_FLOPS = 100e12
EST_STEP_FACTOR = {"dense": 1.0, "pooled": 2.3, "token": 2.3, "oracle": 2.3, "row_oracle": 4.0}
EST_STARTUP_S = 30.0


@dataclass(frozen=True)
class JobConfig:
    """Everything that defines one run (its identity in results.jsonl), plus the device it runs on."""

    family: str
    mode: str
    seed: int
    seq_len: int
    steps: int
    batch: int
    lr: float
    layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    rope_theta: float
    warmup_fraction: float
    short_steps: int
    short_len: int
    eval_rows: int
    log_every: int
    mid_steps: int = 0
    mid_len: int = 2048
    top_k: int = 0
    block_q: int = 0
    device: str = "cpu"

    @property
    def key(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if k != "device"}
        if not self.mid_steps:  # no middle stage: the key of a two-stage job
            del fields["mid_steps"], fields["mid_len"]
        if not self.top_k:  # the family's budget: the key of a job without the override
            del fields["top_k"]
        if not self.block_q:  # BLOCK query rows: the key of a job without the override
            del fields["block_q"]
        if self.mode == "default":
            defaults = st.SparseAttentionConfig()
            fields["defaults"] = {name: getattr(defaults, name) for name in DEFAULT_MODE_FIELDS}
            fields["defaults"]["candidates_min_len"] = defaults.resolved_selector_candidates_min_len
        return json.dumps(fields, sort_keys=True)

    @property
    def budget(self) -> int:
        """Dynamic key blocks per query block: ``top_k``, or when it is 0 the facts the family's question needs."""
        return self.top_k or family(self.family).top_k

    @property
    def query_block(self) -> int:
        """Query rows that share one selection in every ``st.SparseAttention`` mode (``block_q``): ``block_q``, or
        :data:`BLOCK` when it is 0. Key blocks stay :data:`BLOCK` tokens; the row oracle selects per row."""
        return self.block_q or BLOCK

    def row_length(self, step: int) -> int:
        """Row length at ``step``: ``short_len`` for the first ``short_steps`` steps, then ``mid_len`` for
        ``mid_steps`` steps, then ``seq_len``."""
        if step < self.short_steps:
            return self.short_len
        if step < self.short_steps + self.mid_steps:
            return self.mid_len
        return self.seq_len

    @property
    def dense_warmup_steps(self) -> int:
        """The short-row steps (one block: attention is dense there anyway) and ``warmup_fraction`` of the
        steps at full length."""
        short = min(self.steps, self.short_steps)
        return short + round(self.warmup_fraction * (self.steps - short))


class ModeUnsupported(Exception):
    """The installed sparse_train has no configuration for this mode."""


def sparse_kwargs(cfg: JobConfig) -> dict:
    """The SparseAttentionConfig keyword arguments every st.SparseAttention mode shares."""
    return {
        "block_q": cfg.query_block,
        "block_k": BLOCK,
        "top_k": cfg.budget,
        "window": WINDOW,
        "sinks": SINKS,
        "selector_rope_theta": cfg.rope_theta,
        "selector_rope_style": "interleaved",
        "dense_warmup_steps": cfg.dense_warmup_steps,
        "metrics_every": max(1, cfg.log_every),
    }


def sparse_config(cfg: JobConfig) -> tuple[st.SparseAttentionConfig, str]:
    """(config, note) of a st.SparseAttention mode. Raises ModeUnsupported when this sparse_train does
    not know the mode's keywords (``pooled`` then falls back to the config without them, with a note)."""
    kwargs = {**sparse_kwargs(cfg), **MODES[cfg.mode]}
    if cfg.mode == "token_cand":
        kwargs["selector_candidates"] = CANDIDATES_PER_TOP_K * kwargs["top_k"]
    try:
        return st.SparseAttentionConfig(**kwargs), ""
    except TypeError as error:
        if cfg.mode != "pooled":
            raise ModeUnsupported(f"mode {cfg.mode!r} not supported by this sparse_train ({error})") from None
        for name in ("selector", "selector_rope_style", "selector_rope_theta"):
            kwargs.pop(name)
        note = (
            f"this sparse_train has no selector / selector_rope_style ({error}): pooled runs the module's "
            "selector on the rotated q and k (selector_rope_theta=None)"
        )
        return st.SparseAttentionConfig(**kwargs), note


def build_model(cfg: JobConfig) -> tuple[EvalModel, dict, str]:
    """The model of ``cfg`` with its attention cores: (model, the SparseAttentionConfig as a dict or {}, note).
    The model's own weights come from ``cfg.seed`` alone, whatever the mode."""
    torch.manual_seed(cfg.seed)
    model = EvalModel(
        VOCAB_SIZE,
        d_model=cfg.d_model,
        layers=cfg.layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        rope_theta=cfg.rope_theta,
    )
    if cfg.mode == "dense":
        return model, {}, ""
    if cfg.mode == "row_oracle":
        top_k = cfg.budget
        model.set_cores(
            lambda: RowOracleCore(
                top_k=top_k, block=BLOCK, window=WINDOW, sinks=SINKS, dense_warmup_steps=cfg.dense_warmup_steps
            )
        )
        return model, {}, ""
    config, note = sparse_config(cfg)
    model.set_cores(lambda: st.SparseAttention(config, cfg.num_heads, cfg.num_kv_heads, model.head_dim))
    return model, config.to_dict(), note


def _density(model: EvalModel) -> float | None:
    """Fraction of the causal area the last forward attended (None when it was dense)."""
    cores = [block.core for block in model.blocks]
    if isinstance(cores[0], RowOracleCore):
        return _row_oracle_mean(cores, "last_density")
    if isinstance(cores[0], st.SparseAttention):
        return st.collect_attention_stats(model).get("density")
    return None


def _row_oracle_mean(cores: list[RowOracleCore], name: str) -> float | None:
    """Mean over the layers of a row oracle's ``last_density`` or ``last_mass_recall`` (None when it was dense)."""
    values = [float(getattr(c, name)) for c in cores if getattr(c, name) is not None]
    return sum(values) / len(values) if values else None


def run_job(cfg: JobConfig, verbose: bool = False) -> dict:
    """Train and evaluate one job; the record written to results.jsonl (``error`` set when it failed).
    ``verbose`` prints the training curve as it is logged."""
    try:
        return _run_job(cfg, verbose)
    except Exception:  # noqa: BLE001  (any failure of one job is reported and the sweep goes on)
        return {"key": cfg.key, "config": asdict(cfg), "error": traceback.format_exc()}


def _run_job(cfg: JobConfig, verbose: bool) -> dict:
    device = torch.device(cfg.device)
    cuda = device.type == "cuda"
    fam = family(cfg.family)
    model, sparse_cfg, note = build_model(cfg)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, cfg.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / cfg.steps))))
    )
    train_gen = torch.Generator().manual_seed(stream_seed(cfg.family, "train", cfg.seq_len, cfg.seed))

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory().to(device, non_blocking=True) if cuda else t

    def forward_loss(tokens, targets):
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            logits = model(tokens)
        return F.cross_entropy(logits.float().view(-1, VOCAB_SIZE), targets.view(-1), ignore_index=IGNORE), logits

    model.train()
    losses, selector_losses, curve = [], [], []
    timestamps = {}
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for step in range(cfg.steps):
        if step == cfg.dense_warmup_steps and step > 0 and cfg.mode != "dense":
            if cuda:
                torch.cuda.synchronize(device)
            timestamps["after_warmup"] = (step, time.perf_counter())
        length = cfg.row_length(step)
        tokens, targets = (to_device(t) for t in make_batch(cfg.family, length, cfg.batch, train_gen))
        task_loss, _ = forward_loss(tokens, targets)
        selector_loss = st.collect_selector_losses(model)
        (task_loss + selector_loss).backward()
        st.clip_grad_norms(model, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        losses.append(task_loss.detach())
        selector_losses.append(selector_loss.detach())
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            task = torch.stack(losses).float().mean().item()
            sel = torch.stack(selector_losses).float().mean().item()
            curve.append([step + 1, task, sel])
            if verbose:
                print(
                    f"[heldout] {cfg.family}/{cfg.mode}/seed {cfg.seed}/N {cfg.seq_len} step {step + 1}: "
                    f"loss {task:.4f}, selector loss {sel:.4f}",
                    flush=True,
                )
            losses, selector_losses = [], []
    if cuda:
        torch.cuda.synchronize(device)
    end = time.perf_counter()
    train_stats = {k: v for k, v in st.collect_attention_stats(model).items() if not k.startswith("replay/")}
    cores = [block.core for block in model.blocks]
    if isinstance(cores[0], RowOracleCore):  # the row oracle's, which st.collect_attention_stats does not see
        for stat, name in (("density", "last_density"), ("mass_recall_mean", "last_mass_recall")):
            if (value := _row_oracle_mean(cores, name)) is not None:
                train_stats[stat] = value

    eval_gen = torch.Generator().manual_seed(stream_seed(cfg.family, "eval", cfg.seq_len))
    model.eval()
    correct = torch.zeros((), dtype=torch.int64, device=device)
    total = torch.zeros((), dtype=torch.int64, device=device)
    densities = []
    eval_start = time.perf_counter()
    with torch.no_grad():
        done = 0
        while done < cfg.eval_rows:
            rows = min(cfg.batch, cfg.eval_rows - done)
            tokens, targets = (to_device(t) for t in make_batch(cfg.family, cfg.seq_len, rows, eval_gen))
            _, logits = forward_loss(tokens, targets)
            asked = targets != IGNORE
            correct += ((logits.argmax(-1) == targets) & asked).sum()
            total += asked.sum()
            density = _density(model)
            if density is not None:
                densities.append(density)
            done += rows
    eval_seconds = time.perf_counter() - eval_start
    after = timestamps.get("after_warmup")
    record = {
        "key": cfg.key,
        "config": asdict(cfg),
        "sparse_config": sparse_cfg,
        "note": note,
        "chance": fam.chance,
        "top_k": cfg.budget,
        "accuracy": correct.item() / max(1, total.item()),
        "answers": total.item(),
        "train_curve": curve,
        "final_train_loss": curve[-1][1] if curve else None,
        "steps_per_s": cfg.steps / (end - start),
        "steps_per_s_after_warmup": (cfg.steps - after[0]) / (end - after[1]) if after else cfg.steps / (end - start),
        "train_seconds": end - start,
        "eval_seconds": eval_seconds,
        "eval_density": sum(densities) / len(densities) if densities else 1.0,
        "train_stats": train_stats,
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "sparse_train": st.__version__,
    }
    return record


def _worker_init(threads: int) -> None:
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------- sweep
def step_flops(cfg: JobConfig) -> float:
    """Training FLOPs of one dense step (forward + backward) of the model of ``cfg``."""
    d, n = cfg.d_model, cfg.seq_len
    kv = d * cfg.num_kv_heads // cfg.num_heads
    linear = d * d * 2 + 2 * d * kv + 8 * d * d  # q, o, k, v, MLP
    attention = 2 * 2 * (n / 2) * d  # QK^T and PV over the causal half, per token
    per_token = cfg.layers * (6 * linear + 3.5 * attention) + 6 * d * VOCAB_SIZE
    return per_token * n * cfg.batch


def estimate_seconds(configs: list[JobConfig], jobs: int) -> float:
    """Expected wall time of the sweep on one H200 (see EST_* above): GPU-bound aggregate compute plus
    one start-up per wave of ``jobs`` processes."""
    compute = sum(
        (cfg.steps - min(cfg.steps, cfg.short_steps))
        * step_flops(cfg)
        * EST_STEP_FACTOR.get(cfg.mode, 2.3)
        / EST_AGGREGATE_FLOPS
        for cfg in configs
    )
    return compute + math.ceil(len(configs) / max(1, jobs)) * EST_STARTUP_S


def read_results(out: Path) -> list[dict]:
    path = out / "results.jsonl"
    if not path.exists():
        return []
    records = {}
    with path.open() as f:
        for line in f:
            line = line.strip()
            if line:
                record = json.loads(line)
                records[record["key"]] = record
    return list(records.values())


def _parse_list(text: str, kind, name: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{name} must be a comma-separated list of {kind.__name__}, got {text!r}") from None
    if not values:
        raise ValueError(f"{name} is empty")
    return values


def run_sweep(args: argparse.Namespace) -> Path:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    families = _parse_list(args.families, str, "--families")
    modes = _parse_list(args.modes, str, "--modes")
    for name in families:
        family(name)
    for mode in modes:
        if mode not in MODES:
            raise ValueError(f"--modes: {mode!r} is not one of {', '.join(MODES)}")
    seeds = _parse_list(args.seeds, int, "--seeds")
    lengths = _parse_list(args.seq_len, int, "--seq-len")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    configs, skipped = [], {}
    for n in lengths:
        for name in families:
            for mode in modes:
                for seed in seeds:
                    cfg = JobConfig(
                        family=name,
                        mode=mode,
                        seed=seed,
                        seq_len=n,
                        steps=args.steps,
                        batch=args.batch,
                        lr=args.lr,
                        layers=args.layers,
                        d_model=args.d_model,
                        num_heads=args.num_heads,
                        num_kv_heads=args.num_kv_heads,
                        rope_theta=args.rope_theta,
                        warmup_fraction=args.warmup_fraction,
                        short_steps=args.short_steps,
                        short_len=args.short_len,
                        mid_steps=args.mid_steps,
                        mid_len=args.mid_len,
                        top_k=args.top_k,
                        block_q=args.block_q,
                        eval_rows=args.eval_rows,
                        log_every=args.log_every,
                        device=device,
                    )
                    if MODES[mode] is not None:
                        try:
                            _, note = sparse_config(cfg)
                            if note:
                                skipped.setdefault(f"note/{mode}", note)
                        except ModeUnsupported as error:
                            skipped[mode] = str(error)
                            continue
                    configs.append(cfg)
    for mode, message in skipped.items():
        print(f"[heldout] {message}" if mode.startswith("note/") else f"[heldout] skipping: {message}", flush=True)
    done = {record["key"] for record in read_results(out)}
    # seed by seed, so that a sweep cut short holds complete comparisons of its first seeds
    todo = sorted(
        (cfg for cfg in configs if cfg.key not in done),
        key=lambda c: (c.seq_len, seeds.index(c.seed), families.index(c.family), modes.index(c.mode)),
    )
    print(
        f"[heldout] {len(configs)} jobs, {len(configs) - len(todo)} already in {out / 'results.jsonl'}, "
        f"{len(todo)} to run on {device} with {args.jobs} at a time",
        flush=True,
    )
    for name in families:
        fam = family(name)
        budget = args.top_k or fam.top_k
        print(f"[heldout]   {name}: {fam.description}; top_k {budget}, chance {fam.chance:.3f}", flush=True)
    if todo:
        estimate = estimate_seconds(todo, args.jobs)
        print(
            f"[heldout] expected wall time on one H200: {estimate / 60:.1f} min (aggregate "
            f"{EST_AGGREGATE_FLOPS / 1e12:.0f} TFLOP/s, sparse step {EST_STEP_FACTOR['pooled']}x dense, "
            f"{EST_STARTUP_S:.0f} s start-up per wave)",
            flush=True,
        )
    start = time.perf_counter()
    threads = max(1, (os.cpu_count() or 1) // max(1, args.jobs))
    with (out / "results.jsonl").open("a") as results, (out / "errors.jsonl").open("a") as errors:

        def finished(record: dict, index: int) -> None:
            cfg = record["config"]
            label = f"{cfg['family']}/{cfg['mode']}/seed {cfg['seed']}/N {cfg['seq_len']}"
            if "error" in record:
                errors.write(json.dumps(record) + "\n")
                errors.flush()
                print(f"[heldout] FAILED {label}:\n{record['error']}", flush=True)
            else:
                results.write(json.dumps(record) + "\n")
                results.flush()
                elapsed = time.perf_counter() - start
                eta = elapsed / index * (len(todo) - index)  # jobs finish in waves: a rough guide
                print(
                    f"[heldout] {index}/{len(todo)} {label}: accuracy {record['accuracy']:.3f} "
                    f"(chance {record['chance']:.3f}), {record['steps_per_s']:.1f} steps/s, density "
                    f"{record['eval_density']:.3f}; elapsed {elapsed / 60:.1f} min, about {eta / 60:.1f} min left",
                    flush=True,
                )

        def may_start() -> bool:
            return args.stop_after_min is None or time.perf_counter() - start < 60 * args.stop_after_min

        pending = list(todo)
        count = 0
        if args.jobs == 1:
            while pending and may_start():
                count += 1
                finished(run_job(pending.pop(0), args.verbose), count)
        elif pending:
            context = mp.get_context("spawn")
            with ProcessPoolExecutor(
                max_workers=args.jobs,
                mp_context=context,
                max_tasks_per_child=1,
                initializer=_worker_init,
                initargs=(threads,),
            ) as pool:
                running = set()
                while pending or running:
                    while pending and len(running) < args.jobs and may_start():
                        running.add(pool.submit(run_job, pending.pop(0), args.verbose))
                    if not running:
                        break
                    done_now, running = wait(running, return_when=FIRST_COMPLETED)
                    for future in done_now:
                        count += 1
                        finished(future.result(), count)
        if pending:
            print(
                f"[heldout] --stop-after-min {args.stop_after_min}: {len(pending)} jobs not started; "
                "the same command resumes them",
                flush=True,
            )
    summarize(out)
    return out


# ---------------------------------------------------------------------------------------------- summary
def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def _ratio(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else float("nan")


def _schedule(group: dict) -> str:
    """``steps x batch``, with the middle curriculum stage when there is one."""
    text = f"{group['steps']} x {group['batch']}"
    if group.get("mid_steps"):
        text += f" ({group['mid_steps']} at {group['mid_len']})"
    return text


def _budget(group: dict) -> str:
    """``top_k``, with the query block when it is not :data:`BLOCK`."""
    return str(group["top_k"]) + (f" (block_q {group['block_q']})" if group["block_q"] != BLOCK else "")


def _group_label(group: dict) -> str:
    """The family, with the budget when it is not the family's, the query block when it is not :data:`BLOCK` and
    the middle stage when there is one."""
    label = group["family"]
    if group["top_k"] != family(group["family"]).top_k:
        label += f"\ntop_k {group['top_k']}"
    if group["block_q"] != BLOCK:
        label += f"\nblock_q {group['block_q']}"
    if group.get("mid_steps"):
        label += f"\n{group['mid_steps']} at {group['mid_len']}"
    return label


def build_summary(records: list[dict]) -> list[dict]:
    """One entry per (family, seq_len, steps, batch, top_k, query block, middle stage): each mode's per-seed
    accuracies and mean, density, mass recall, steps/s, and the ratios learned/oracle, learned/dense, oracle/dense,
    row_oracle/oracle."""
    groups: dict[tuple, dict] = {}
    for record in records:
        if "error" in record:
            continue
        cfg = record["config"]
        stage = (cfg.get("mid_steps", 0), cfg.get("mid_len", 0) if cfg.get("mid_steps", 0) else 0)
        block_q = cfg.get("block_q") or BLOCK
        key = (cfg["seq_len"], cfg["family"], cfg["steps"], cfg["batch"], record["top_k"], block_q, stage)
        group = groups.setdefault(
            key,
            {
                "family": cfg["family"],
                "seq_len": cfg["seq_len"],
                "steps": cfg["steps"],
                "batch": cfg["batch"],
                "mid_steps": stage[0],
                "mid_len": stage[1],
                "chance": record["chance"],
                "top_k": record["top_k"],
                "block_q": block_q,
                "modes": {},
            },
        )
        mode = group["modes"].setdefault(
            cfg["mode"], {"seeds": {}, "density": [], "mass_recall_mean": [], "steps_per_s": [], "notes": set()}
        )
        mode["seeds"][cfg["seed"]] = record["accuracy"]
        mode["density"].append(record["eval_density"])
        mode["steps_per_s"].append(record["steps_per_s"])
        recall = record.get("train_stats", {}).get("mass_recall_mean")
        if recall is not None:
            mode["mass_recall_mean"].append(recall)
        if record.get("note"):
            mode["notes"].add(record["note"])
    order = {name: i for i, name in enumerate(FAMILIES)}
    summary = []
    for key in sorted(groups, key=lambda k: (k[0], order.get(k[1], 99), *k[2:])):
        group = groups[key]
        for mode in group["modes"].values():
            mode["seeds"] = dict(sorted(mode["seeds"].items()))
            mode["mean"] = _mean(list(mode["seeds"].values()))
            for field in ("density", "mass_recall_mean", "steps_per_s"):
                mode[field] = _mean(mode[field]) if mode[field] else None
            mode["notes"] = sorted(mode["notes"])
        means = {name: mode["mean"] for name, mode in group["modes"].items()}
        ratios = {}
        for learned in LEARNED:
            if learned in means:
                ratios[f"{learned}/oracle"] = _ratio(means[learned], means.get("oracle", float("nan")))
                ratios[f"{learned}/dense"] = _ratio(means[learned], means.get("dense", float("nan")))
        ratios["oracle/dense"] = _ratio(means.get("oracle", float("nan")), means.get("dense", float("nan")))
        ratios["row_oracle/oracle"] = _ratio(means.get("row_oracle", float("nan")), means.get("oracle", float("nan")))
        ratios["row_oracle/dense"] = _ratio(means.get("row_oracle", float("nan")), means.get("dense", float("nan")))
        group["ratios"] = {k: v for k, v in ratios.items() if not math.isnan(v)}
        summary.append(group)
    return summary


def _fmt(x: float | None, digits: int = 3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def summary_markdown(summary: list[dict], records: list[dict]) -> str:
    modes = [m for m in MODES if any(m in g["modes"] for g in summary)]
    ratio_names = sorted({r for g in summary for r in g["ratios"]}, key=lambda r: (r.split("/")[1], r))
    lines = [
        "# Held-out selector evaluation",
        "",
        (
            "Accuracy on held-out rows (fraction of answer tokens predicted exactly): mean over seeds, the "
            "per-seed values in brackets. Same initial weights, training rows and steps in every mode."
        ),
        "",
    ]
    devices = sorted({r.get("device_name", "?") for r in records if "error" not in r})
    versions = sorted(
        {f"torch {r.get('torch')}, sparse_train {r.get('sparse_train')}" for r in records if "error" not in r}
    )
    lines += [f"Device: {', '.join(devices)}; {'; '.join(versions)}.", ""]
    header = ["family", "N", "steps x batch", "top_k", "chance"] + modes + ratio_names
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for g in summary:
        row = [g["family"], str(g["seq_len"]), _schedule(g), _budget(g), _fmt(g["chance"])]
        for m in modes:
            mode = g["modes"].get(m)
            row.append(
                "-" if mode is None else f"{_fmt(mode['mean'])} ({' / '.join(_fmt(v) for v in mode['seeds'].values())})"
            )
        row += [_fmt(g["ratios"].get(r)) for r in ratio_names]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        (
            "Per mode: density attended at eval (fraction of the causal area), attention-mass recall at the "
            "last training measurement (st.collect_attention_stats), training steps/s."
        ),
        "",
    ]
    header = ["family", "N"] + [f"{m} density / recall / steps/s" for m in modes]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for g in summary:
        row = [g["family"], str(g["seq_len"])]
        for m in modes:
            mode = g["modes"].get(m)
            row.append(
                "-"
                if mode is None
                else f"{_fmt(mode['density'])} / {_fmt(mode['mass_recall_mean'])} / {_fmt(mode['steps_per_s'], 1)}"
            )
        lines.append("| " + " | ".join(row) + " |")
    notes = sorted({n for g in summary for mode in g["modes"].values() for n in mode["notes"]})
    if notes:
        lines += ["", "Notes:"] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def plot_summary(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(g["seq_len"], g["steps"], g["batch"]) for g in summary})
    modes = [m for m in MODES if any(m in g["modes"] for g in summary)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(2.2 + 1.6 * len(FAMILIES), 3.6 * len(panels)), squeeze=False)
    width = 0.8 / max(1, len(modes))
    for ax, panel in zip(axes[:, 0], panels):
        groups = [g for g in summary if (g["seq_len"], g["steps"], g["batch"]) == panel]
        for x, g in enumerate(groups):
            ax.hlines(g["chance"], x - 0.45, x + 0.45, colors="gray", linestyles=":", linewidth=1)
            for i, m in enumerate(modes):
                mode = g["modes"].get(m)
                if mode is None:
                    continue
                pos = x - 0.4 + width * (i + 0.5)
                ax.bar(pos, mode["mean"], width * 0.9, color=f"C{i}", label=m if x == 0 else None)
                seeds = list(mode["seeds"].values())
                ax.scatter([pos] * len(seeds), seeds, color="black", s=10, zorder=3)
        ax.set_xticks(range(len(groups)), [_group_label(g) for g in groups])
        ax.set_ylim(0, 1.05)
        ax.set_ylabel("held-out accuracy")
        ax.set_title(f"N = {panel[0]}, {panel[1]} steps x batch {panel[2]} (bars: mean; dots: seeds; dotted: chance)")
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(out: Path) -> list[dict]:
    """Rebuild OUT/summary.md, summary.json and plot.png from OUT/results.jsonl alone."""
    out = Path(out)
    if not (out / "results.jsonl").exists():
        raise ValueError(f"--summarize: {out / 'results.jsonl'} does not exist")
    records = read_results(out)
    summary = build_summary(records)
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(summary_markdown(summary, records))
    if summary:
        try:
            plot_summary(summary, out / "plot.png")
        except ImportError as error:  # the tables do not need matplotlib
            print(f"[heldout] no plot.png: {error}", flush=True)
    print(f"[heldout] summary of {len(records)} results: {out / 'summary.md'}", flush=True)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.eval.heldout",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated task families")
    p.add_argument("--modes", default="dense,pooled,token,oracle", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--seeds", default="0,1", help="comma-separated run seeds (initial weights and training rows)")
    p.add_argument("--seq-len", default="2048", help="sequence length(s), comma-separated")
    p.add_argument("--steps", type=int, default=800, help="training steps of every job")
    p.add_argument("--batch", type=int, default=16, help="rows per training step (and per eval batch)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (warm-up 5%%, cosine to 10%%)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument(
        "--warmup-fraction",
        type=float,
        default=0.25,
        help="dense warm-up of every sparse mode after the short-row steps, as a fraction of the full-length steps",
    )
    p.add_argument(
        "--short-steps",
        type=int,
        default=300,
        help="the first this-many steps train on rows of --short-len tokens (a length curriculum: the "
        "lookups are learnt on short rows, where attention at initialisation is not spread over "
        "thousands of keys); 0 = every step at --seq-len",
    )
    p.add_argument("--short-len", type=int, default=64, help="row length of the first --short-steps steps")
    p.add_argument(
        "--mid-steps",
        type=int,
        default=0,
        help="after the short-row steps, this many steps on rows of --mid-len tokens (a third curriculum stage "
        "before --seq-len: at 8K the lookups of the harder families are learnt at 2K first); 0 = none",
    )
    p.add_argument("--mid-len", type=int, default=2048, help="row length of the --mid-steps steps")
    p.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="dynamic key blocks per query block in every sparse mode and the row oracle; 0 = each family's "
        "(the facts its question needs)",
    )
    p.add_argument(
        "--block-q",
        type=int,
        default=0,
        help=f"query rows that share one selection (SparseAttentionConfig.block_q) in every sparse mode; 0 = {BLOCK}, "
        f"the key block size",
    )
    p.add_argument("--eval-rows", type=int, default=256, help="held-out rows evaluated per job")
    p.add_argument("--log-every", type=int, default=50, help="training-loss curve and mass-recall interval (steps)")
    p.add_argument("--jobs", type=int, default=1, help="worker processes at once (1: run in this process)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument(
        "--stop-after-min",
        type=float,
        default=None,
        help="start no job after this many minutes (running jobs finish; a rerun resumes)",
    )
    p.add_argument("--verbose", action="store_true", help="print every job's training curve as it is logged")
    p.add_argument("--out", default=None, help="output directory (results.jsonl, summary.md/json, plot.png)")
    p.add_argument("--summarize", default=None, metavar="DIR", help="only rebuild DIR's summary from results.jsonl")
    args = p.parse_args(argv)
    if args.summarize is None and args.out is None:
        p.error("--out is required (or --summarize DIR)")
    for name in ("steps", "batch", "layers", "d_model", "num_heads", "num_kv_heads", "eval_rows", "log_every", "jobs"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 <= args.warmup_fraction < 1.0:
        p.error("--warmup-fraction must be in [0, 1)")
    if args.top_k < 0:
        p.error(f"--top-k must be >= 0, got {args.top_k}")
    if args.block_q not in (0, *BLOCK_Q_CHOICES):
        p.error(f"--block-q must be 0 or one of {BLOCK_Q_CHOICES} (at most the key block, {BLOCK}), got {args.block_q}")
    if args.mid_steps < 0 or args.mid_len < 1:
        p.error(f"--mid-steps must be >= 0 and --mid-len >= 1, got {args.mid_steps} and {args.mid_len}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize is not None:
        summarize(Path(args.summarize))
    else:
        run_sweep(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
