"""parallelisms: every parallelism of large-model training, from first principles on torch.distributed.

The Python API (``docs/api.md``), each function loaded on first use so that ``import parallelisms`` stays
light (the command line holds Ctrl-C while it imports):

- ``train(**options)``, ``verify(**options)``, ``estimate(**options)``, ``plan(**options)``,
  ``simulate(**options)``: the verbs of
  the command line, taking its options as keyword arguments (``dp=2, tp=2, sp=True``) and returning the
  dict that ``--json`` prints.
- ``configure(**options)``, ``build_model(...)``, ``parallelize(model, layout, train)``, ``batches(train,
  layout)``: the pieces for a training loop of your own, inside a ``torchrun`` script.
"""

__version__ = "0.1.0"
API = ("train", "verify", "estimate", "plan", "simulate", "configure", "build_model", "parallelize", "batches")
__all__ = [*API, "__version__"]


def __getattr__(name: str):
    if name in API:
        from parallelisms import api

        return getattr(api, name)
    raise AttributeError(f"module 'parallelisms' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *API})
