"""strata-async: run huge sparse Mixture-of-Experts language models on one PC."""

__version__ = "0.1.0"
