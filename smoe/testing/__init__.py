"""Builders for tests, benchmarks and the demo: tiny models of every family, random vaults and tensors."""
