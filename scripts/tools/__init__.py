"""Tools: plots, the A/B runner, trace and Nsight Compute readers, the FSDP check, the GPU runners."""
