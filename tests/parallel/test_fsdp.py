"""Sharded training: gradient clipping on FSDP shards, and Lightning's FSDP and DDP strategies against one process.

Everything runs on the CPU with two processes and the gloo backend. torch's FSDP1 and FSDP2 both run there.
Lightning's FSDPStrategy is meant for GPUs; the Lightning FSDP test runs it on the CPU through the shims of
``scripts/tools/fsdp_check.py`` (``install_cpu_fsdp_shims``, installed in the worker processes only: an empty
subclass past Lightning's no-GPU check, ``device_id=cpu`` for FSDP1, the full state dict gathered without
CPU offload). Everything else (wrapping, precision plugin, checkpointing, our hooks) is Lightning's and ours.
The GPU run of the real recipe is ``scripts/tools/fsdp_check.py``.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from builders import cpu_fsdp_strategy, spawn_ranks

import sparse_train as st
from sparse_train.lightning.model import Block, Transformer, TransformerConfig
from sparse_train.tasks import IGNORE_INDEX

TINY = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
SPARSE = dict(
    selector="pooled",
    block_q=8,
    block_k=8,
    top_k=1,
    window=1,
    sinks=1,
    backend="reference",
    dense_warmup_steps=0,
    distill="dense",
)
SEQ = 61  # 60 positions: 8 blocks of 8, the last one partial
WORLD = 2


def _spawn(fn, *args) -> None:
    spawn_ranks(fn, WORLD, *args)


def _tiny_model(dtype=torch.float64) -> Transformer:
    torch.manual_seed(0)
    return Transformer(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE)).to(dtype)


def _rows(n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, TINY["vocab_size"], (n, SEQ), generator=g)


def _lm_loss(model: Transformer, tokens: torch.Tensor, wrapped: torch.nn.Module | None = None) -> torch.Tensor:
    """Mean next-token loss plus the selectors' loss; the forward goes through ``wrapped`` (FSDP1's root)."""
    logits = (wrapped or model)(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).double(), tokens[:, 1:].flatten())
    return loss + st.collect_selector_losses(model)


# --------------------------------------------------------------------------- clipping on shards (torch level)
def _reference_clip(tokens: torch.Tensor, max_norm: float, norm_type: float):
    model = _tiny_model()
    _lm_loss(model, tokens).backward()
    norms = st.clip_grad_norms(model, max_norm, norm_type)
    return [float(n) for n in norms], {n: p.grad.clone() for n, p in model.named_parameters()}


def _clip_worker(rank: int, port: int, out_dir: str, cases: list) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    from sparse_train.lightning.training import unwrapped_name

    tokens = _rows(2 * WORLD)[rank::WORLD]  # this rank's rows; equal counts, so the mean of means is the mean
    results = []
    for kind, max_norm, norm_type in cases:
        model = _tiny_model()
        if kind == "fsdp1":
            wrapped = FSDP(
                model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu")
            )
            _lm_loss(model, tokens, wrapped).backward()
            norms = st.clip_grad_norms(model, max_norm, norm_type, process_group=dist.group.WORLD)
            with FSDP.summon_full_params(wrapped, with_grads=True):
                grads = {unwrapped_name(n): p.grad.clone() for n, p in model.named_parameters()}
        else:
            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
            _lm_loss(model, tokens).backward()
            assert all(type(p.grad).__name__ == "DTensor" for p in model.parameters())
            norms = st.clip_grad_norms(model, max_norm, norm_type)
            grads = {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}
        results.append(
            {"norms": [float(n) for n in norms], "grads": {n: g.flatten().tolist() for n, g in grads.items()}}
        )
        dist.barrier()
    if rank == 0:
        with open(os.path.join(out_dir, "clip.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def test_clip_grad_norms_on_fsdp_shards_equals_the_unsharded_clipping(tmp_path):
    """FSDP1 (flat shards, ``use_orig_params=True``, ``process_group``) and FSDP2 (DTensor gradients):
    both groups' norms and the clipped gradients equal the one-process computation on the same rows,
    in float64, for the 2-norm and the inf-norm, with both groups clipped and with only one clipped."""
    tokens = _rows(2 * WORLD)
    norms2, _ = _reference_clip(tokens, 1e9, 2.0)
    norms_inf, _ = _reference_clip(tokens, 1e9, math.inf)
    assert norms2[0] != pytest.approx(norms2[1], rel=0.2)  # one threshold can sit between them
    between = math.sqrt(norms2[0] * norms2[1])
    cases = [
        ("fsdp1", 0.5 * min(norms2), 2.0),
        ("fsdp1", between, 2.0),
        ("fsdp1", 0.5 * min(norms_inf), math.inf),
        ("fsdp2", 0.5 * min(norms2), 2.0),
        ("fsdp2", between, 2.0),
    ]
    _spawn(_clip_worker, str(tmp_path), cases)
    with open(tmp_path / "clip.json") as f:
        results = json.load(f)
    # The model runs in float64; the selectors score and distil in float32 whatever the model's dtype, so
    # their gradients carry float32 rounding that depends on how the rows are split (8 ulps of float32).
    tolerance = {"model": 1e-10, "selector": 8 * torch.finfo(torch.float32).eps}
    for (kind, max_norm, norm_type), got in zip(cases, results):
        want_norms, want_grads = _reference_clip(tokens, max_norm, norm_type)
        assert got["norms"][0] == pytest.approx(want_norms[0], rel=tolerance["model"]), (kind, max_norm, norm_type)
        assert got["norms"][1] == pytest.approx(want_norms[1], rel=tolerance["selector"]), (kind, max_norm, norm_type)
        assert got["grads"].keys() == want_grads.keys()
        for name, want in want_grads.items():
            have = torch.tensor(got["grads"][name], dtype=torch.float64).view_as(want)
            scale = float(want.abs().max()) + 1e-30
            rel = tolerance["selector" if ".core." in name else "model"]
            assert float((have - want).abs().max()) <= rel * scale, (kind, norm_type, name)


@pytest.mark.parametrize(
    "norm_type", [0.0, -2.0, math.nan, "2", True], ids=["zero", "negative", "nan", "string", "bool"]
)
def test_clip_grad_norms_rejects_bad_norm_type(norm_type):
    with pytest.raises(ValueError, match="norm_type"):
        st.clip_grad_norms(torch.nn.Linear(2, 2), max_norm=1.0, norm_type=norm_type)


# --------------------------------------------------------------------------- Lightning strategies
ROWS_PER_STEP = 4
STEPS = 3
CLIP = 1e-3  # below both groups' norms (about 0.5 and 3e-3 here): both are clipped on every step
LR = dict(lr=1e-2, selector_lr=3e-2, weight_decay=0.1, warmup_steps=1)


def _train_rows(reorder: bool = False) -> list[dict[str, torch.Tensor]]:
    """``STEPS`` global batches of rows whose labelled counts differ from row to row (so from rank to rank);
    ``reorder`` reverses the rows inside each global batch (the same batches, another summation order)."""
    g = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, TINY["vocab_size"], (STEPS * ROWS_PER_STEP, SEQ), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    labels[:, -1] = IGNORE_INDEX
    for i in range(labels.shape[0]):
        labels[i, : 7 * i] = IGNORE_INDEX
    rows = [{"tokens": t, "labels": lab} for t, lab in zip(tokens, labels)]
    if reorder:
        rows = [row for k in range(STEPS) for row in reversed(rows[k * ROWS_PER_STEP : (k + 1) * ROWS_PER_STEP])]
    return rows


def _fit(strategy, world: int, rank: int, out_dir: str, tag: str, reorder: bool = False) -> None:
    from lightning.pytorch import Callback, Trainer, seed_everything
    from torch.utils.data import DataLoader

    from sparse_train.lightning import SparseLMModule
    from sparse_train.lightning.text_data import RowShards

    losses: list[float] = []
    groups: dict[str, list[int]] = {}

    class Record(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(float(trainer.callback_metrics["train/lm_loss"]))

        def on_train_start(self, trainer, pl_module):
            selector = {id(p) for p in st.selector_parameters(pl_module.model)}
            for group in trainer.optimizers[0].param_groups:
                kinds = sorted({"selector" if id(p) in selector else "model" for p in group["params"]})
                groups[f"lr={group['lr']:g},wd={group['weight_decay']:g}"] = kinds

    seed_everything(0)
    module = SparseLMModule(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE), **LR)
    rows = _train_rows(reorder)
    loader = DataLoader(
        rows, batch_size=ROWS_PER_STEP // world, sampler=RowShards(len(rows), rank, world, shuffle=False)
    )
    trainer = Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        precision="32-true",
        gradient_clip_val=CLIP,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[Record()],
        default_root_dir=os.path.join(out_dir, tag),
    )
    trainer.fit(module, train_dataloaders=loader)
    trainer.save_checkpoint(os.path.join(out_dir, f"{tag}.ckpt"))
    with open(os.path.join(out_dir, f"{tag}.rank{rank}.json"), "w") as f:
        json.dump({"losses": losses, "groups": groups}, f)


def _fit_worker(rank: int, port: int, out_dir: str, kind: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    _fit(cpu_fsdp_strategy() if kind == "fsdp" else kind, WORLD, rank, out_dir, kind)


def _final_weights(path) -> dict[str, torch.Tensor]:
    from sparse_train.lightning import load_weights

    model = Transformer(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE))
    info = load_weights(model, str(path))
    assert info == {"missing": [], "unexpected": []}  # selectors included, under their own names
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _worst(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], selector: bool) -> float:
    return max(float((a[n] - b[n]).abs().max()) for n in a if (".core." in n) == selector)


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """The one-process fit, and the same fit with the rows of each batch in reverse order (its noise)."""
    root = tmp_path_factory.mktemp("one_process")
    _fit("auto", 1, 0, str(root), "single")
    _fit("auto", 1, 0, str(root), "reordered", reorder=True)
    return root


@pytest.mark.parametrize("kind", ["ddp", "fsdp"], ids=["ddp", "fsdp"])
def test_two_process_fit_matches_one_process_on_the_same_batches(tmp_path, one_process_runs, kind):
    """Three clipped steps of a tiny sparse model on two CPU processes (gloo) equal one process on the
    same global batches: the per-step ``train/lm_loss`` every rank logs (each rank's loss sum is normalised by
    all ranks' labelled tokens, which differ from rank to rank here, and the logged value is averaged over
    the ranks), and the weights in the checkpoint Lightning writes (FSDP: the full state dict, read back by
    ``load_weights`` with the selector tensors under their own names). The optimizer groups keep the
    selectors at their own learning rate. Tolerance: the difference between two one-process runs whose
    rows are summed in another order (the float32 noise of the same computation), times 4, plus float32
    ulps of the compared values."""
    _spawn(_fit_worker, str(tmp_path), kind)

    def read(tag, rank=0):
        with open((tmp_path if tag == kind else one_process_runs) / f"{tag}.rank{rank}.json") as f:
            return json.load(f)

    single, reordered = read("single"), read("reordered")
    ranks = [read(kind, r) for r in range(WORLD)]
    assert ranks[0]["groups"] == single["groups"]
    assert sorted(single["groups"].values()) == [["model"], ["model"], ["selector"]]
    assert any(key.startswith(f"lr={LR['selector_lr']:g},") for key in single["groups"])
    # Every rank logs the global batch's loss (train/lm_loss is averaged over the ranks).
    distributed_loss = torch.tensor([r["losses"] for r in ranks], dtype=torch.float64)
    single_loss = torch.tensor(single["losses"], dtype=torch.float64)
    loss_noise = float((torch.tensor(reordered["losses"], dtype=torch.float64) - single_loss).abs().max())
    ulp = torch.finfo(torch.float32).eps
    print(f"{kind}: loss {distributed_loss[0].tolist()} vs {single_loss.tolist()} (reorder noise {loss_noise:.2e})")
    # A two-rank loss is two float32 partial sums over other rows combined: a few float32 roundings away.
    assert float((distributed_loss - single_loss).abs().max()) <= 4 * loss_noise + 4 * ulp * float(
        single_loss.abs().max()
    )

    want, floor = (_final_weights(one_process_runs / f"{tag}.ckpt") for tag in ("single", "reordered"))
    got = _final_weights(tmp_path / f"{kind}.ckpt")
    for selector in (False, True):
        noise, gap = _worst(floor, want, selector), _worst(got, want, selector)
        print(f"{kind}: {'selector' if selector else 'model'} weights differ by {gap:.2e} (reorder noise {noise:.2e})")
        assert gap <= 4 * noise + ulp * max(float(w.abs().max()) for w in want.values())


def _fit_then_validate_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank), NODE_RANK="0")
    from lightning.pytorch import Trainer, seed_everything
    from torch.utils.data import DataLoader

    from sparse_train.lightning import SparseLMModule

    def trainer():
        return Trainer(
            max_steps=1,
            accelerator="cpu",
            devices=WORLD,
            strategy=cpu_fsdp_strategy(),
            precision="32-true",
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=out_dir,
        )

    seed_everything(0)
    rows = _train_rows()[:WORLD]
    module = SparseLMModule(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE), **LR)
    fitted = trainer()
    fitted.fit(module, train_dataloaders=DataLoader(rows, batch_size=1))
    path = os.path.join(out_dir, "fit.ckpt")
    fitted.save_checkpoint(path)
    result = {}
    try:
        fitted.validate(module, dataloaders=DataLoader(rows, batch_size=1), verbose=False)
        result["same_module"] = "no error"
    except RuntimeError as error:
        result["same_module"] = str(error)
    fresh = SparseLMModule.load_from_checkpoint(path)
    metrics = trainer().validate(fresh, dataloaders=DataLoader(rows, batch_size=1), verbose=False)
    result["fresh_module"] = {k: float(v) for k, v in metrics[0].items()}
    with open(os.path.join(out_dir, f"validate.rank{rank}.json"), "w") as f:
        json.dump(result, f)


def test_validate_after_fit_under_fsdp_names_the_way_that_works(tmp_path):
    """Lightning's FSDPStrategy does not re-wrap a module an earlier fit wrapped (Lightning-AI/pytorch-lightning
    #19015): validating it again used to fail inside the embedding ("'weight' must be 2-D", the parameters
    outside the layers left as flat shards). It is refused at setup on every rank with the ways that work, and
    the one it names for the same process, a fresh module from the checkpoint with a new Trainer, validates."""
    _spawn(_fit_then_validate_worker, str(tmp_path))
    for rank in range(WORLD):
        with open(tmp_path / f"validate.rank{rank}.json") as f:
            result = json.load(f)
        assert "already wrapped by FSDP" in result["same_module"] and "load_from_checkpoint" in result["same_module"]
        assert math.isfinite(result["fresh_module"]["val/loss"]), result["fresh_module"]


@pytest.mark.parametrize("config", [dict(distill_every=2), dict(distill="off")], ids=["distill_every2", "distill_off"])
def test_ddp_without_find_unused_parameters_is_refused_when_selectors_skip_steps(config):
    """A selector that does not distill on every step leaves its parameters without gradients on some
    steps; DDP would fail at the next step, so fit start names the fix instead."""
    from types import SimpleNamespace

    from lightning.pytorch.strategies import DDPStrategy

    from sparse_train.lightning import SparseLMModule

    module = SparseLMModule(TransformerConfig(**TINY, attention="sparse", sparse={**SPARSE, **config}))
    strategy = DDPStrategy()
    strategy.model = SimpleNamespace(find_unused_parameters=False)
    fake = SimpleNamespace(model=module.model, trainer=SimpleNamespace(strategy=strategy))
    with pytest.raises(ValueError, match="ddp_find_unused_parameters_true"):
        module.training_logic.check_strategy(fake)
    strategy.model = SimpleNamespace(find_unused_parameters=True)
    module.training_logic.check_strategy(fake)
    every_step = SparseLMModule(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE))
    strategy.model = SimpleNamespace(find_unused_parameters=False)
    every_step.training_logic.check_strategy(SimpleNamespace(model=every_step.model, trainer=fake.trainer))


@pytest.mark.parametrize(
    "precision,user_config,want_buffers",
    [
        pytest.param("bf16-mixed", None, None, id="bf16-mixed-buffers-as-built"),
        pytest.param("32-true", None, None, id="32-true-buffers-as-built"),
        pytest.param("bf16-mixed", "user", torch.bfloat16, id="users-mixed-precision-kept"),
    ],
)
def test_fsdp_keeps_buffers_in_their_dtypes(precision, user_config, want_buffers):
    """Lightning's FSDP casts buffers to bf16 under bf16-mixed (and to fp32 under 32-true, which rounds a float64
    buffer), and a long-context model's buffers are its RoPE frequencies (bf16 frequencies turn position 64K by
    radians). configure_model leaves every buffer in its dtype (buffer_dtype None: FSDP only moves them),
    parameters and reductions as Lightning chose; a mixed_precision the user passed is left alone."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import FSDPPrecision
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp import MixedPrecision

    from sparse_train.lightning import SparseLMModule

    users = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16) if user_config else None
    strategy = FSDPStrategy(mixed_precision=users)
    strategy.precision_plugin = FSDPPrecision(precision)
    lightning_config = strategy.mixed_precision_config
    module = SparseLMModule(TransformerConfig(**TINY, attention="sparse", sparse=SPARSE), **LR)
    module._trainer = SimpleNamespace(strategy=strategy)
    module.configure_model()
    config = strategy.mixed_precision_config
    assert config.buffer_dtype == want_buffers
    assert config.param_dtype == lightning_config.param_dtype
    assert config.reduce_dtype == lightning_config.reduce_dtype
    assert "auto_wrap_policy" in strategy.kwargs  # the per-layer units, set by the same hook
