"""The NVIDIA side of the runtime: the GPU expert cache, Triton kernels and the CUDA-graph decode step."""
