"""`smoe bench`: measurements against a baseline run in the same process (codecs, kernels, runtime, decode)."""
