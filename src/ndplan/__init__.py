"""ndplan: plan N-dimensional parallel training of large language models."""

__version__ = "0.1.0"
