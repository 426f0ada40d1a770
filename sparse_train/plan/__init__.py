"""Launch planning: the block plan of an index (:class:`BlockPlan`, :func:`build_plan`) and the launch
schedule the kernels walk."""

from .plan import DEFAULT_R0, BlockPlan, build_plan

__all__ = ["DEFAULT_R0", "BlockPlan", "build_plan"]
