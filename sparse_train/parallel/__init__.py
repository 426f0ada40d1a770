"""Context parallelism: the zig-zag sequence layout over a process group and the sparse attention of a rank's
shard (:mod:`sparse_train.parallel.context_parallel`)."""
