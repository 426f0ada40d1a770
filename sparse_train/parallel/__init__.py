"""Context parallelism: the zig-zag sequence layout over a process group, the sparse attention of a rank's
shard, and the layout that :func:`~sparse_train.parallel.context_parallel.enable_context_parallel` gives a
``SparseAttention`` from outside (:mod:`sparse_train.parallel.context_parallel`)."""
