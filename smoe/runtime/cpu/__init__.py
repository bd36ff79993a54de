"""The CPU side of the runtime: the expert store, CPU kernels and the compiled decode step."""
