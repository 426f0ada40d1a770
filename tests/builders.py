"""Shared builders of test inputs and error measures: the one random-selection builder, the one q/k/v
maker and the error-ratio check every numerical test uses. Imported by the test modules (functions, so
module-level parameter lists and helpers can call them too); the fixtures are in conftest.py."""

import importlib
import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparse_train.cuda_graphs import capture_cuda_graph
from sparse_train.index.block_index import BlockIndex
from sparse_train.selection import rope_inverse_frequencies


def random_selection(
    batch,
    kv_heads,
    seq_len,
    block_q,
    block_k,
    k,
    *,
    seed=0,
    generator=None,
    distinct=True,
    drop=0.0,
    duplicates=False,
    empty_rows=False,
):
    """Random causal candidate key blocks, int64 ``[B, HKV, NQB, k]`` (``2k`` with ``duplicates``).

    ``distinct=True``: the top-k of random scores over each query block's causal blocks (-1 where a row
    has fewer than k). ``distinct=False``: k draws uniform over the causal blocks (duplicates common).
    Then a fraction ``drop`` of the slots becomes -1, ``empty_rows`` empties every third query block
    (from block 1), and ``duplicates`` lists every candidate twice. Draws come from ``generator`` or a
    fresh one seeded with ``seed``. The causal limit is computed here, not by the library under test."""
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    nqb, nkb = math.ceil(seq_len / block_q), math.ceil(seq_len / block_k)
    last = ((torch.clamp((torch.arange(nqb) + 1) * block_q, max=seq_len) - 1) // block_k).view(1, 1, nqb, 1)
    if distinct:
        causal = torch.arange(nkb).view(1, 1, 1, -1) <= last
        scores = torch.rand(batch, kv_heads, nqb, nkb, generator=g).masked_fill(~causal, -1.0)
        values, sel = scores.topk(min(k, nkb), dim=-1)
        sel = torch.where(values >= 0, sel, -1)
    else:
        sel = (torch.rand(batch, kv_heads, nqb, k, generator=g) * (last + 1)).long()
    if drop:
        sel = torch.where(torch.rand(sel.shape, generator=g) < drop, -1, sel)
    if empty_rows:
        sel[:, :, 1::3] = -1  # with no window and no sinks these rows select nothing
    if duplicates:
        sel = torch.cat([sel, sel.flip(-1)], dim=-1)
    return sel


def random_index(B, HKV, N, BQ, BK, topk, window, sinks, seed=0, device="cpu", **selection):
    """Canonical index of a :func:`random_selection` (keyword options passed on) plus window and sinks."""
    sel = random_selection(B, HKV, N, BQ, BK, topk, seed=seed, **selection)
    return BlockIndex.from_selection(sel.to(device), seq_len=N, block_q=BQ, block_k=BK, window=window, sinks=sinks)


def make_qkv(B, HQ, HKV, N, D, dtype=torch.float32, seed=0, device="cpu", requires_grad=False, generator=None):
    """q ``[B, HQ, N, D]``, k and v ``[B, HKV, N, D]``: standard normal (drawn in fp32 on the CPU from
    ``generator`` or a fresh one seeded with ``seed``), then cast and moved."""
    g = generator if generator is not None else torch.Generator().manual_seed(seed)
    return [
        torch.randn(B, h, N, D, generator=g).to(device=device, dtype=dtype).requires_grad_(requires_grad)
        for h in (HQ, HKV, HKV)
    ]


def rope_inputs(B, H, N, D, *, rope, positions, lengths, dtype=torch.float32, device="cpu", seed=0, layout="bhnd"):
    """Inputs of the RoPE kernels' tests: ``(x [B, H, N, D], inv_freq [rope / 2] or None for rope = 0, positions,
    valid_len)``. ``layout="bnhd"``: x seen through a transpose (non-contiguous heads and rows). ``positions``:
    None, ``"shifted"`` (``[N]`` from 100,000: large angles), ``"per_row"`` (``[B, N]`` int64 restarting every 37)
    or ``"float"`` (``[B, N]`` float up to 1000). ``lengths``: rows at or past ``lengths[b]`` hold NaN (a kernel
    that reads them poisons its output)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if layout == "bnhd":
        x = torch.randn(B, N, H, D, generator=g).to(device, dtype).transpose(1, 2)
    else:
        x = torch.randn(B, H, N, D, generator=g).to(device, dtype)
    inv_freq = None if rope == 0 else rope_inverse_frequencies(10000.0, rope).to(device)
    pos = None
    if positions == "shifted":
        pos = torch.arange(N, device=device) + 100_000
    elif positions == "per_row":
        pos = (torch.arange(N, device=device) % 37).expand(B, N).contiguous()
    elif positions == "float":
        pos = torch.rand(B, N, generator=g).to(device) * 1000.0
    valid = None if lengths is None else torch.tensor(lengths, device=device)
    if valid is not None:
        rows = torch.arange(N, device=device).view(1, 1, N, 1) >= valid.view(B, 1, 1, 1)
        x = x.masked_fill(rows, float("nan"))
    return x, inv_freq, pos, valid


def dense_oracle(q, k, v, index, seq_lens=None, dropout_p=0.0, dropout_seed=None, *, scale=None, document_ids=None):
    """The float64 oracle of the attention property tests: dense masked softmax where query i of batch b and query head
    h sees key j iff the block of j is selected by the block of i (``index.to_dense()``), j <= i, j < seq_lens[b]
    and (with ``document_ids`` ``[B, N]``) j lies in i's document. Rows with nothing allowed give o = 0 and
    lse = -inf. ``scale`` default ``1 / sqrt(D)``; dropout keeps the counter-based bits of the reference
    (``dropout_keep_mask``) and scales kept probabilities by ``1 / (1 - dropout_p)``. Returns ``(o, lse)``."""
    from sparse_train.kernels.reference.attention import dropout_keep_mask

    b, hq, n, d = q.shape
    group = hq // k.shape[1]
    blocks = index.to_dense()
    # a block longer than N is one block (expanding it to its size would only cost memory)
    block_q, block_k = min(index.block_q, n), min(index.block_k, n)
    allowed = blocks.repeat_interleave(block_q, 2)[:, :, :n].repeat_interleave(block_k, 3)[..., :n]
    allowed = allowed.repeat_interleave(group, 1)
    pos = torch.arange(n, device=q.device)
    allowed = allowed & (pos.view(1, 1, 1, n) <= pos.view(1, 1, n, 1))
    if seq_lens is not None:
        allowed = allowed & (pos.view(1, 1, 1, n) < seq_lens.view(-1, 1, 1, 1).to(q.device))
    if document_ids is not None:
        docs = document_ids.to(q.device)
        allowed = allowed & (docs.view(-1, 1, 1, n) == docs.view(-1, 1, n, 1))
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * scale
    scores = torch.where(allowed, scores, float("-inf"))
    # a row with no allowed key takes the logsumexp of zeros (finite, so no NaN in its backward)
    has_key = allowed.any(dim=-1, keepdim=True)
    row_lse = torch.logsumexp(torch.where(has_key, scores, 0.0), dim=-1, keepdim=True)
    probs = torch.where(allowed, torch.exp(scores - row_lse), 0.0)
    lse = torch.where(has_key, row_lse, float("-inf")).squeeze(-1)
    if dropout_p > 0:
        keep = dropout_keep_mask(
            dropout_seed,
            torch.arange(b, device=q.device).view(b, 1, 1, 1),
            torch.arange(hq, device=q.device).view(1, hq, 1, 1),
            pos.view(1, 1, n, 1),
            pos.view(1, 1, 1, n),
            hq,
            n,
            dropout_p,
        )
        probs = probs * keep / (1.0 - dropout_p)
    return probs @ v.repeat_interleave(group, 1), lse


def outputs_and_grads(fn, q, k, v, do, dl):
    """``(o, lse, dq, dk, dv)`` of ``fn(q, k, v) -> (o, lse)`` for the loss ``sum(o * do) + sum(lse * dl)`` over
    the finite lse (fresh leaves of q, k, v; the upstream gradients ``do``, ``dl`` in float64)."""
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    o, lse = fn(qs, ks, vs)
    loss = (o.double() * do).sum() + (torch.where(torch.isfinite(lse), lse, 0.0).double() * dl).sum()
    return (o, lse, *torch.autograd.grad(loss, (qs, ks, vs)))


def rel_err(a, b):
    """Relative Frobenius error of ``a`` against ``b`` over the finite entries of ``b`` (both must have
    the same non-finite pattern)."""
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    assert torch.equal(torch.isfinite(a), fin), "non-finite pattern differs"
    a, b = a[fin], b[fin]
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# c * err(PyTorch in the kernel's precision) + floor; floors: fp32 ~ 1e-6, fp16 ~ 1e-4
TOL_C = 4.0
FLOOR = {torch.float32: 2e-6, torch.float16: 2e-4, torch.bfloat16: 2e-3}


def check_close(name, got, ref, ref_lowp, dtype, *, c=TOL_C, floor=None):
    """The error-ratio rule: err(got vs ref) <= c * err(ref_lowp vs ref) + floor, where ``ref`` is the
    reference in high precision and ``ref_lowp`` the same computation by PyTorch in the kernel's precision."""
    floor = FLOOR[dtype] if floor is None else floor
    e_k, e_r = rel_err(got, ref), rel_err(ref_lowp, ref)
    print(f"{name}: kernel err {e_k:.3e} | torch-{str(dtype).split('.')[-1]} err {e_r:.3e}")
    assert e_k <= c * e_r + floor, f"{name}: kernel err {e_k:.3e} > {c} * {e_r:.3e} + {floor}"


TINY_WORDS = tuple(f"w{i}" for i in range(60))
"""The vocabulary (besides special tokens) of :func:`save_tiny_tokenizer`: 64 ids, below a tiny model's 96."""


def save_tiny_tokenizer(path, *, bos=True, eos=False):
    """Save a word-level Hugging Face tokenizer, built offline, to the directory ``path`` (created) and return
    the path: ids 0..3 are ``[UNK]``, ``<pad>``, ``<s>`` (BOS, prepended when ``bos``), ``</s>`` (EOS, appended
    by the tokenizer itself only when ``eos``), then :data:`TINY_WORDS`; words are split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(("[UNK]", "<pad>", "<s>", "</s>", *TINY_WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos or eos:
        template = ("<s> " if bos else "") + "$A" + (" </s>" if eos else "")
        tok.post_processor = processors.TemplateProcessing(single=template, special_tokens=[("<s>", 2), ("</s>", 3)])
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]", pad_token="<pad>"
    ).save_pretrained(path)
    return path


def tiny_text(n, seed):
    """``n`` random words of :data:`TINY_WORDS`, separated by spaces, drawn from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return " ".join(TINY_WORDS[i] for i in torch.randint(len(TINY_WORDS), (n,), generator=g).tolist())


def write_tiny_corpus(root, lengths_txt=(3, 40, 7, 11, 1, 25), lengths_jsonl=(5, 2, 60, 9, 14, 4, 18, 6)):
    """Write text files (one document each, ``docNN.txt``) and ``more.jsonl`` (one ``{"text": ...}`` document
    per line) of :func:`tiny_text` words under the directory ``root`` (created); document i has
    ``lengths[i]`` words and every document differs. Returns ``root``."""
    import json

    root.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(lengths_txt):
        (root / f"doc{i:02d}.txt").write_text(tiny_text(n, seed=i))
    lines = [json.dumps({"text": tiny_text(n, seed=100 + i), "id": i}) for i, n in enumerate(lengths_jsonl)]
    (root / "more.jsonl").write_text("\n".join(lines) + "\n")
    return root


def spawn_ranks(worker, world: int, *args) -> None:
    """Run ``worker(rank, port, *args)`` in ``world`` processes (torch.multiprocessing spawn) that meet at
    a free localhost port; returns when all have finished (an exception in one is raised here).

    A worker that returns ends its process with ``os._exit(0)``: the interpreter's own shutdown of a
    process that ran gloo collectives (FSDP in particular) sometimes aborts in a C++ destructor
    ("terminate called without an active exception", SIGABRT, in a few percent of the runs of
    tests/parallel/test_fsdp.py on 2 CPU cores; none with this exit), after every result has been written."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_run_and_exit, args=(worker, port, *args), nprocs=world, join=True)


def cpu_fsdp_strategy(**kwargs):
    """A fresh Lightning ``FSDPStrategy(**kwargs)`` that runs on the CPU (gloo), through the shims of
    ``scripts/tools/fsdp_check.py`` (``install_cpu_fsdp_shims``; they patch this process, so call it in spawned
    workers only)."""
    global _CPU_FSDP_STRATEGY
    if _CPU_FSDP_STRATEGY is None:  # the shims patch the process once; a second Trainer reuses the class
        _CPU_FSDP_STRATEGY = load_script("fsdp_check").install_cpu_fsdp_shims()
    return _CPU_FSDP_STRATEGY(**kwargs)


_CPU_FSDP_STRATEGY = None


def _run_and_exit(rank: int, worker, *args) -> None:
    import os
    import sys

    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def value_errors_of(calls) -> list[str]:
    """The ValueError message of each call (``"no error"`` when it returns); other exceptions propagate."""
    messages = []
    for call in calls:
        try:
            call()
            messages.append("no error")
        except ValueError as error:
            messages.append(str(error))
    return messages


def ids_from_lengths(*rows):
    """int64 ``[B, N]`` document ids from per-row document lengths (ids 0, 1, ... in order; each row's
    lengths sum to N)."""
    return torch.stack([torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in rows])


def ids_from_starts(starts_per_row, seq_len: int):
    """int64 ``[B, N]`` document ids: row b's documents start at the listed positions (the first at 0)."""
    ids = torch.zeros(len(starts_per_row), seq_len, dtype=torch.int64)
    for b, starts in enumerate(starts_per_row):
        for doc, start in enumerate(starts):
            ids[b, start:] = doc
    return ids


def load_script(name: str):
    """The tool ``scripts/tools/<name>.py``, imported as the package module ``scripts.tools.<name>`` (the tests run
    from the repository root, ``python -m pytest``, which puts it on the path)."""
    return importlib.import_module(f"scripts.tools.{name}")


def assert_mid_epoch_resume_equals_straight(make_datamodule, tmp_path, fork_step: int, max_steps: int = 10) -> None:
    """A tiny dense LM trained ``max_steps`` straight on ``make_datamodule()`` equals the same run stopped after
    ``fork_step`` steps (a ``ForkPoint`` checkpoint) and resumed from there, weight for weight."""
    from lightning.pytorch import Trainer

    from sparse_train.lightning import ForkPoint, SparseLMModule, TransformerConfig

    def fit(callbacks, ckpt_path=None):
        torch.manual_seed(0)
        dm = make_datamodule()
        vocab = dm.vocab_size
        module = SparseLMModule(
            TransformerConfig(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, attention="dense"),
            warmup_steps=1,
        )
        trainer = Trainer(
            max_steps=max_steps,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            accelerator="cpu",
            callbacks=callbacks,
            default_root_dir=tmp_path,
        )
        trainer.fit(module, dm, ckpt_path=ckpt_path, weights_only=False)
        return module, trainer

    straight, _ = fit([])
    fork = str(tmp_path / f"at{fork_step}.ckpt")
    fit([ForkPoint(fork_step, fork)])
    resumed, trainer = fit([], ckpt_path=fork)
    assert trainer.global_step == max_steps
    for key, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[key]), f"the resumed run diverged at {key}"


def index_inputs(B, H, N, E, S, *, blocks=None, block_q=None, seed=0, dtype=torch.float32, device="cpu", seq_lens=None):
    """Index-score inputs: u ``[B, H, M, E, S]`` (M = N, or ``len(blocks) * block_q`` rows of the listed query
    blocks) and w ``[B, H, N, S]`` standard normal, NaN at every position past ``seq_lens`` (or N): padding the
    scores ignore."""
    g = torch.Generator().manual_seed(seed)
    pos = (
        torch.arange(N)
        if blocks is None
        else (torch.tensor(blocks).view(-1, 1) * block_q + torch.arange(block_q)).reshape(-1)
    )
    u = torch.randn(B, H, pos.numel(), E, S, generator=g)
    w = torch.randn(B, H, N, S, generator=g)
    for b in range(B):
        length = N if seq_lens is None else seq_lens[b]
        w[b, :, length:] = float("nan")
        u[b, :, pos >= length] = float("nan")
    return u.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


class OpRecorder(TorchDispatchMode):
    """A dispatch mode that records the name of every op dispatched while it is active (``recorder.ops``: e.g.
    ``"sparse_train::index_block_scores"``, ``"aten::mm"``): which path a public function took."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func._schema.name)
        return func(*args, **(kwargs or {}))


def compiled_fullgraph(fn):
    """``torch.compile(fn, backend="aot_eager", fullgraph=True)`` (dynamo and AOT autograd: graph breaks and host
    reads raise; the graph runs eager aten and the custom ops, the Triton kernels through the interpreter)."""
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def assert_sync_free_and_capturable(run):
    """``run()`` (CUDA, returning a tensor or a tuple of tensors) makes no device -> host synchronisation (the sync
    debug mode raises on one), and captured once in a CUDA graph its replay gives the eager results bit for bit."""
    eager = run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph, outputs = capture_cuda_graph(run)
    graph.replay()
    torch.cuda.synchronize()
    pairs = zip(outputs, eager) if isinstance(eager, tuple) else [(outputs, eager)]
    for a, b in pairs:
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------- compile for Hopper
def ptxas_path():
    """The ptxas that ships with triton, or None."""
    import os

    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    return path if os.path.exists(path) else None


def warmup_for_hopper(kernel, *args, **meta):
    """``kernel.warmup(*args, **meta)`` with the active Triton driver answering sm_90 (compiles without a GPU; call
    it in a process without ``TRITON_INTERPRET``). Returns the compiled kernel."""
    import triton
    from triton.backends.compiler import GPUTarget

    class Hopper:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_device_interface(self):
            return torch.cuda

    driver = triton.runtime.driver
    saved = driver._active
    driver.set_active(Hopper())
    try:
        return kernel.warmup(*args, **meta)
    finally:
        driver._active = saved


def ptxas_usage(compiled) -> tuple[int, int]:
    """(registers, spill store bytes) of a kernel compiled by :func:`warmup_for_hopper`, assembled by ptxas for
    sm_90a."""
    import os
    import re
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(compiled.asm["ptx"])
        text = subprocess.run(
            [ptxas_path(), "-arch=sm_90a", "-v", path, "-o", os.devnull], capture_output=True, text=True, check=True
        ).stderr
    return int(re.search(r"Used (\d+) registers", text).group(1)), int(
        re.search(r"(\d+) bytes spill stores", text).group(1)
    )


def compile_report_in_subprocess(test_file: str, function: str, cases):
    """``function(cases)`` of the test module ``test_file`` run in a child process without the interpreter (the
    package this process tests on its path, and the tests' builders), its printed JSON result decoded."""
    import json
    import os
    import subprocess
    import sys

    import sparse_train

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [
            os.path.dirname(os.path.dirname(sparse_train.__file__)),
            os.path.dirname(os.path.dirname(os.path.abspath(test_file))),
            env.get("PYTHONPATH", ""),
        ]
    )
    module = os.path.splitext(os.path.basename(test_file))[0]
    code = f"import json, {module} as t; print(json.dumps(t.{function}({cases!r})))"
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=os.path.dirname(test_file),
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
