"""The plain single-device model: no parallel code lives here."""

from parallelisms.model.transformer import Transformer, build_model, init_weights

__all__ = ["Transformer", "build_model", "init_weights"]
