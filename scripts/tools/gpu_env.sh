# Sourced from the repository root by the GPU runner (scripts/tools/gpu_all.sh) and before a GPU run by hand
# (`source scripts/tools/gpu_env.sh`): the environment every GPU run of this repository uses, defined once.
#
# - PYTHONPATH: the source checkout, so the runs (`python3 -m scripts.bench.<name>`, `python3 -m sparse_train.cli`)
#   need no install on the GPU machine.
# - NVLink multicast off (NCCL, torch symmetric memory, NVSHMEM): multi-GPU runs use plain NCCL.
# - .whl/ (git-ignored): pure-Python wheels the GPU machine's Python lacks, e.g. jsonargparse, which
#   LightningCLI needs. When present they are installed, without index or dependencies, into
#   /tmp/site, which goes on PYTHONPATH (the system site-packages stay untouched). README, "Testing".
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
