"""``KernelOptions``: every performance switch of the attention kernels in one typed dataclass.

The switches never change a result beyond floating-point order: the plan and reuse threshold ``r0`` of the
hybrid backward, the split count, tiles, warps and stages of each kernel, TMA loads, the Gluon kernels, the
fused and stored-dS backward. ``sparse_attention(..., kernel_options=)`` takes a :class:`KernelOptions` or a
dict of its fields; building a :class:`KernelOptions` is the one validation of both forms
(:func:`normalize_kernel_options` builds one from the dict), and the rules that tie switches to each other or
to ``deterministic`` are written here once (:func:`check_dq_source`). :class:`sparse_train.SparseAttentionConfig`
carries one in its ``kernel_options`` field (:func:`config_kernel_options` checks it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from .plan.plan import BlockPlan
from .validation import check_bool, check_int, check_keys

__all__ = [
    "KERNEL_OPTIONS",
    "KernelOptions",
    "check_dq_source",
    "check_fused_dq_allowed",
    "check_kernel_option_shapes",
    "check_no_plan_with_query_blocks",
    "config_kernel_options",
    "kernel_options_dict",
    "normalize_kernel_options",
]

_WARPS = (1, 2, 4, 8, 16)
_MAX_STAGES = 8
_MAX_SPLITS = 64
_MIN_DOT_ROWS = 16  # smallest row count of a tensor-core tile product (tl.dot)
_BOOL_OPTIONS = ("fused_dq", "stored_ds", "fwd_tma", "dq_tma", "kv_tma", "kv_gluon", "dq_gluon", "fwd_gluon")


@dataclass(frozen=True)
class KernelOptions:
    """Normalised ``kernel_options`` (see :func:`normalize_kernel_options`); None = default. Construction
    checks every field's type and range (``ValueError`` naming ``kernel_options.<field>`` and the accepted
    range) and the rule tying ``fused_dq`` to ``stored_ds`` (:func:`check_dq_source`)."""

    plan: BlockPlan | None = None
    """A plan from ``index.plan(r0)`` of this very index, reused across layers (default: that call)."""
    r0: int | None = None
    """Reuse threshold of the hybrid backward, an int >= 0 (default :data:`~sparse_train.plan.plan.DEFAULT_R0`);
    equals ``plan.r0`` if both."""
    num_splits: int | None = None
    """Split-KV count of the forward, 1..64 (default :func:`~sparse_train.plan.tuning.choose_num_splits`)."""
    fwd_heads_per_program: int | None = None
    """Query heads of a GQA group stacked along the rows of one forward program (a power of two
    dividing G; the tile has heads_per_program * BQ rows)."""
    fwd_num_warps: int | None = None
    """Warps of a forward program, one of 1, 2, 4, 8, 16."""
    fwd_num_stages: int | None = None
    """Software-pipelining stages of the forward, 1..8."""
    dq_heads_per_program: int | None = None
    """Query heads per dQ program (a power of two dividing G)."""
    dq_num_warps: int | None = None
    """Warps of a dQ program, one of 1, 2, 4, 8, 16."""
    dq_num_stages: int | None = None
    """Software-pipelining stages of the dQ kernel, 1..8."""
    kv_heads_per_program: int | None = None
    """Query heads per KV-centric program (a power of two dividing G)."""
    kv_num_warps: int | None = None
    """Warps of a KV-centric program, one of 1, 2, 4, 8, 16."""
    kv_num_stages: int | None = None
    """Software-pipelining stages of the KV-centric kernel, 1..8."""
    kv_chunk: int | None = None
    """Query blocks per KV-centric work item, an int >= 1 (default :data:`~sparse_train.plan.tuning.KV_CHUNK`)."""
    kv_tile_rows: int | None = None
    """Query rows the KV-centric kernel takes per step (a power of two >= 16 dividing
    kv_heads_per_program * BQ; default the whole tile): thinner slices keep fewer scores live."""
    fwd_tma: bool | None = None
    """Forward: load the K/V tiles through TMA tensor descriptors (Hopper and newer; pointer loads where
    a tensor's strides or alignment do not allow a descriptor). Default on (H200, 64K: 5-12% faster at
    three of four shapes, equal at the fourth)."""
    dq_tma: bool | None = None
    """dQ kernel: load the K/V tiles through TMA tensor descriptors (as ``fwd_tma``). Default on (H200, 64K:
    4-12% faster)."""
    kv_tma: bool | None = None
    """KV-centric kernel: load the q/dO row slices through TMA tensor descriptors (one head per step and
    no query-block map only; pointer loads otherwise). Default on except over 128 x 128 key tiles, where
    it measured slower."""
    fused_dq: bool | None = None
    """One backward pass: the KV-centric kernel also adds each tile's dQ share into a float32 buffer with
    atomics, and the dQ kernel does not run (5 tile products per block pair instead of 7). Every block is
    then KV-centric. The atomics sum in no fixed order, so dQ is not bitwise reproducible: refused with
    ``deterministic``. Default off: measured slower on the H200 (the atomics cost more than the saved
    recomputation; :mod:`sparse_train.kernels.triton.backward`)."""
    stored_ds: bool | None = None
    """The KV-centric kernel stores every tile's dS (in q's dtype, the operand the dQ product takes) in a
    buffer of ``B*HQ*NQB*K*BQ*BK`` elements (K the index capacity), and the dQ kernel reads it instead of
    recomputing S and dP: 5 tile products per block pair instead of 7, no atomics (deterministic). Every
    block is then KV-centric (``r0`` does not apply). Excludes ``fused_dq``. Default off: on the H200 at 64K
    the backward is 2-8% faster (0.98-1.08x by shape), for about 8 GB more peak memory at B = 1, HQ = 32
    (docs/kernel_tuning.md)."""
    kv_gluon: bool | None = None
    """The KV-centric dK/dV kernel hand-scheduled in Gluon (:mod:`sparse_train.kernels.gluon.backward`:
    q/dO slices prefetched by TMA, asynchronous warpgroup MMAs) instead of the Triton one, where it applies
    (Hopper, no dropout, sequence lengths or query-block map, N a multiple of the blocks, neither
    ``fused_dq`` nor ``stored_ds``; the Triton kernel runs elsewhere). Same products in the same order: the
    gradients equal the Triton kernel's. Default on where :func:`~sparse_train.plan.device.gluon_kernels` holds
    (H200, 64K: the backward 9-15% faster; docs/kernel_tuning.md)."""
    fwd_gluon: bool | None = None
    """The forward hand-scheduled in Gluon (:mod:`sparse_train.kernels.gluon.forward`: the q tile in shared
    memory, K/V tiles prefetched by TMA into a ring, asynchronous warpgroup MMAs) instead of the Triton one, where
    it applies (Hopper, no dropout, sequence lengths, query-block map or split rows, N a multiple of
    the blocks); same products in the same order, so the outputs equal the Triton forward's bit for bit. Default
    on where :func:`~sparse_train.plan.device.gluon_kernels` holds and the head dim and key blocks are 64, the one
    shape where it measures faster (H200, 64K: 11%; 3-17% slower at D = 128 and over 128-key blocks;
    docs/kernel_tuning.md)."""
    dq_gluon: bool | None = None
    """The dQ kernel hand-scheduled in Gluon (:mod:`sparse_train.kernels.gluon.backward`: K/V tiles
    prefetched by TMA into a ring, asynchronous warpgroup MMAs) instead of the Triton one, where it applies
    (as ``kv_gluon``, and no cold block: the atomic dK/dV products of cold blocks stay in the Triton kernel).
    Same products in the same order: dQ equals the Triton kernel's bit for bit. Default on where
    :func:`~sparse_train.plan.device.gluon_kernels` holds (H200, 64K, whole backward with the Gluon KV-centric
    kernel: 2.6-5% faster; docs/kernel_tuning.md)."""

    def __post_init__(self) -> None:
        # Every field is checked here, so a KernelOptions built directly and one built from the dict form
        # (normalize_kernel_options) pass the same checks.
        for f in fields(self):
            object.__setattr__(self, f.name, _check_option(f.name, getattr(self, f.name)))
        check_dq_source(self.fused_dq, self.stored_ds, deterministic=False)


KERNEL_OPTIONS = tuple(f.name for f in fields(KernelOptions))
"""Keys of ``sparse_attention(..., kernel_options=)`` (the fields of :class:`KernelOptions`); every
value may be None (= the default)."""


def _check_power_of_two(label: str, value) -> int:
    value = check_int(label, value, minimum=1)
    if value & (value - 1):
        raise ValueError(f"{label} must be a power of two, got {value}")
    return value


def _check_option(name: str, value):
    """One field of :class:`KernelOptions`: None, or ``value`` of the field's type and range (as the field's
    docstring states), normalised (numpy ints become ints); ``ValueError`` naming ``kernel_options.<name>``
    and the accepted range otherwise."""
    label = f"kernel_options.{name}"
    if value is None:
        return None
    if name == "plan":
        if not isinstance(value, BlockPlan):
            raise ValueError(
                f"{label} must be a sparse_train.BlockPlan (from index.plan(r0)), got {type(value).__name__}"
            )
        return value
    if name == "r0":
        return check_int(label, value, minimum=0)
    if name == "num_splits":
        return check_int(label, value, minimum=1, maximum=_MAX_SPLITS)
    if name.endswith("heads_per_program"):
        return _check_power_of_two(label, value)
    if name.endswith("num_warps"):
        value = _check_power_of_two(label, value)
        if value not in _WARPS:
            raise ValueError(f"{label} must be one of {_WARPS}, got {value}")
        return value
    if name.endswith("num_stages"):
        return check_int(label, value, minimum=1, maximum=_MAX_STAGES)
    if name == "kv_chunk":
        return check_int(label, value, minimum=1)
    if name == "kv_tile_rows":
        value = _check_power_of_two(label, value)
        if value < _MIN_DOT_ROWS:
            raise ValueError(f"{label} must be >= {_MIN_DOT_ROWS} (tensor-core tile), got {value}")
        return value
    if name in _BOOL_OPTIONS:
        return check_bool(label, value)
    raise AssertionError(f"KernelOptions.{name} has no check")  # a new field must get one here


def normalize_kernel_options(kernel_options: Mapping | KernelOptions | None) -> KernelOptions:
    """``kernel_options`` as a :class:`KernelOptions`: None, a :class:`KernelOptions` (checked when it was
    built), or a dict whose keys are among :data:`KERNEL_OPTIONS` (an unknown key raises ``ValueError`` naming
    it and the allowed keys), built into one, so both forms pass the one check of
    :meth:`KernelOptions.__post_init__` (values None or of the key's type and range, ``ValueError`` naming
    the field otherwise).

    Shape-dependent rules (heads per program must divide the GQA group, ``kv_tile_rows`` must fit the KV-centric
    tile: :func:`check_kernel_option_shapes`; a plan must belong to the index:
    :func:`~sparse_train.plan.plan.check_plan`) are checked where the shapes are known, on both backends."""
    if kernel_options is None:
        return KernelOptions()
    if isinstance(kernel_options, KernelOptions):
        return kernel_options
    check_keys("kernel_options", kernel_options, KERNEL_OPTIONS)
    return KernelOptions(**kernel_options)


def check_kernel_option_shapes(kernel_options: Mapping | KernelOptions | None, group: int, block_q: int) -> None:
    """The rules that tie kernel options to the input's shape, the same on both backends (the reference ignores
    the options, so a value the kernels refuse is refused there too): each ``*_heads_per_program`` divides the
    GQA group ``group`` (query heads per KV head), and ``kv_tile_rows`` fits the KV-centric tile of
    ``(kv_heads_per_program or 1) * block_q`` rows. ValueError naming the option otherwise."""
    options = normalize_kernel_options(kernel_options)
    for name in ("fwd_heads_per_program", "dq_heads_per_program", "kv_heads_per_program"):
        heads = getattr(options, name)
        if heads is not None and group % heads:
            raise ValueError(
                f"kernel_options.{name}={heads} must divide the GQA group size {group} (query heads per KV head)"
            )
    rows = (options.kv_heads_per_program or 1) * block_q
    if options.kv_tile_rows is not None and options.kv_tile_rows > rows:
        raise ValueError(
            f"kernel_options.kv_tile_rows={options.kv_tile_rows} exceeds the KV-centric tile of "
            f"kv_heads_per_program * block_q = {rows} rows"
        )


def check_dq_source(
    fused_dq: bool | None,
    stored_ds: bool | None,
    deterministic: bool,
    *,
    context: str = "",
) -> None:
    """The rules of the two ways of producing dQ from the KV-centric kernel: ``fused_dq`` (atomics) and
    ``stored_ds`` (a dS buffer) exclude each other, and ``fused_dq`` sums in no fixed order, which
    ``deterministic`` forbids. ``context`` prefixes the ValueError (the caller's name)."""
    if fused_dq and stored_ds:
        raise ValueError(
            f"{context}kernel_options.fused_dq and kernel_options.stored_ds are two ways of producing dQ from the "
            "KV-centric kernel; set at most one of them"
        )
    if fused_dq and deterministic:
        raise ValueError(
            f"{context}kernel_options.fused_dq sums dQ with atomics in no fixed order, so it cannot give the "
            "bitwise-reproducible gradients deterministic=True asks for; drop one of the two"
        )


def check_fused_dq_allowed(kernel_options, deterministic: bool) -> None:
    """``kernel_options.fused_dq`` sums dQ with atomics, which ``deterministic`` (or
    ``torch.use_deterministic_algorithms``) forbids: ValueError for the pair, on both backends."""
    options = normalize_kernel_options(kernel_options)
    check_dq_source(options.fused_dq, options.stored_ds, deterministic)


def check_no_plan_with_query_blocks(kernel_options) -> None:
    """``kernel_options.plan`` is a plan of the whole index; a call with ``query_blocks`` builds the plan of
    its own rows (:func:`~sparse_train.plan.plan.build_plan`), so the two together are refused (ValueError), on both
    backends."""
    if normalize_kernel_options(kernel_options).plan is not None:
        raise ValueError(
            "kernel_options.plan cannot be combined with query_blocks: a plan covers every query "
            "block of its index, and a call with query_blocks builds the plan of its own rows"
        )


def config_kernel_options(kernel_options: Mapping | KernelOptions | None, deterministic: bool) -> KernelOptions:
    """``SparseAttentionConfig.kernel_options`` checked and normalised: the rules of
    :func:`normalize_kernel_options` (errors name ``SparseAttentionConfig.kernel_options``), no ``plan`` (the
    module plans each step's own index), and ``fused_dq`` refused with the config's ``deterministic``."""
    context = "SparseAttentionConfig: "
    if kernel_options is not None and not isinstance(kernel_options, (Mapping, KernelOptions)):
        raise ValueError(
            f"{context}kernel_options must be a sparse_train.KernelOptions, a dict of its fields or None, "
            f"got {type(kernel_options).__name__}"
        )
    try:
        options = normalize_kernel_options(kernel_options)
    except ValueError as err:
        raise ValueError(context + str(err)) from None
    if options.plan is not None:
        raise ValueError(
            f"{context}kernel_options.plan is not a config choice: the module builds each step's plan from "
            "that step's index; set kernel_options.r0 for the reuse threshold"
        )
    check_dq_source(options.fused_dq, options.stored_ds, deterministic, context=context)
    return options


def kernel_options_dict(options: KernelOptions) -> dict:
    """The set (non-None) fields of a :class:`KernelOptions`, in the dict form of ``kernel_options`` (by the names
    of :data:`KERNEL_OPTIONS`, which torch.compile traces; ``dataclasses.fields`` of the class it does not)."""
    return {name: getattr(options, name) for name in KERNEL_OPTIONS if getattr(options, name) is not None}
