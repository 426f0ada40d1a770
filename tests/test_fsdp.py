"""Sharded training: gradient clipping on FSDP shards, and Lightning's FSDP and DDP strategies against one process.

Everything runs on the CPU with two processes and the gloo backend. torch's FSDP1 and FSDP2 both run there.
Lightning refuses ``strategy="fsdp"`` without a GPU (a check on the strategy *name* and on the exact class
``FSDPStrategy``), so the Lightning FSDP test passes an instance of a subclass, :class:`_CPUFSDPStrategy`,
which adds nothing: the wrapping, precision plugin, checkpointing and our hooks are Lightning's and ours.
The GPU run of the real recipe is ``scripts/fsdp_check.py``.
"""

from __future__ import annotations

import json
import math
import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import sparse_train as st
from sparse_train.lightning.model import Block, Transformer, TransformerConfig
from sparse_train.tasks import IGNORE_INDEX

TINY = dict(vocab_size=61, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2)
SPARSE = dict(block_q=8, block_k=8, top_k=1, window=1, sinks=1, backend="reference", dense_warmup_steps=0,
              distill="dense")
SEQ = 61  # 60 positions: 8 blocks of 8, the last one partial
WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, *args) -> None:
    port = _free_port()
    mp.spawn(fn, args=(port, *args), nprocs=WORLD, join=True)


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
            wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True,
                           device_id=torch.device("cpu"))
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
        results.append({"norms": [float(n) for n in norms],
                        "grads": {n: g.flatten().tolist() for n, g in grads.items()}})
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
    cases = [("fsdp1", 0.5 * min(norms2), 2.0), ("fsdp1", between, 2.0), ("fsdp1", 0.5 * min(norms_inf), math.inf),
             ("fsdp2", 0.5 * min(norms2), 2.0), ("fsdp2", between, 2.0)]
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


def test_clip_grad_norms_rejects_bad_norm_type():
    with pytest.raises(ValueError, match="norm_type"):
        st.clip_grad_norms(torch.nn.Linear(2, 2), max_norm=1.0, norm_type=0.0)
