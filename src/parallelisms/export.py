"""``parallelisms export CHECKPOINT_DIR --out HF_DIR``: the full weights of a checkpoint saved by any layout
(:func:`parallelisms.checkpoint.load_full_state`, one process) written as a Hugging Face Llama directory
(:func:`parallelisms.hf.export_hf`: ``config.json`` and ``model.safetensors``)."""

from __future__ import annotations

from pathlib import Path

from parallelisms.errors import ConfigError, require
from parallelisms.resume import META


def add_export_parser(sub) -> None:
    p = sub.add_parser("export", help="write a checkpoint as a Hugging Face Llama directory")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="a complete checkpoint (DIR/step_N)")
    p.add_argument("--out", required=True, metavar="HF_DIR", help="directory for config.json and model.safetensors")
    p.add_argument("--export-dtype", choices=("float32", "bfloat16", "same"), default="float32",
                   help="dtype of the weights written; same: the checkpoint's (float64 from a --dtype float64 run)")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> int:
    path = Path(args.checkpoint)
    require((path / META).is_file() and (path / ".metadata").is_file(),
            f"{args.checkpoint!r} is not a complete checkpoint (no {META} or .metadata); give a DIR/step_N directory")
    require(not Path(args.out).is_file(), f"--out {args.out!r} is a file; name a directory")
    from parallelisms.checkpoint import load_full_state
    from parallelisms.checkpoint_files import verified
    from parallelisms.config import ModelConfig
    from parallelisms.hf import export_dtype, export_hf

    meta = verified(path, META, "export")
    try:
        model = ModelConfig(**meta["model"])
    except TypeError as exc:
        raise ConfigError(f"{str(path / META)!r} is damaged: its model does not fit this version ({exc})") from None
    state = load_full_state(path)
    out = export_hf(state, model, args.out, export_dtype(args.export_dtype, next(iter(state.values())).dtype))
    print(f"exported {path} (step {meta['step']}) to {out} (Hugging Face {model.hf_model_type})")
    return 0
