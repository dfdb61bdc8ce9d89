"""parallelisms: every parallelism of large-model training, from first principles on torch.distributed."""
__version__ = "0.1.0"
