"""Triton kernels: sparse attention forward/backward and its autograd op (``forward``, ``backward``, ``op``),
the selector's kernels (``pool``, ``scores``, ``topk``, ``canonical``, ``draw``), the distillation target
(``block_mass``) and the backward's KV schedule (``schedule``); shared ``@triton.jit`` helpers in ``_jit`` and
launch helpers in ``_launch``. On CPU these need ``TRITON_INTERPRET=1`` set before they are first imported."""
