"""hardy: train and run Llama-family models that survive hardware failure."""

__version__ = "0.1.0"
