"""smoe: run Mixture-of-Experts models larger than memory by streaming quantised experts from disk."""

__version__ = "0.1.0"
