"""The command line's shared flags: the model, layout, training and device arguments of ``train``, ``verify``,
``dryrun``, ``estimate`` and ``plan``, and the parser that reports bad input in one line.

Torch-free, as :mod:`parallelisms.cli` and everything it imports at load (``tests/test_cli_light.py``).
"""

from __future__ import annotations

import argparse

from parallelisms.config import TrainConfig, PRESETS
from parallelisms.config_file import CONFIG_FILE, CONFIG_FLAG, expand
from parallelisms.errors import ConfigError
from parallelisms.flags import DEGREE, integer, number, number_pair, slow_rank
from parallelisms.perf.shapes import add_shape_args
from parallelisms.parallel.cp_modes import MODES

DEFAULT_TRAIN = dict(preset="tiny", dp=2, steps=300, global_batch=16, seq_len=64)
COUNT = integer(1, 10**9)  # steps, batch sizes, lengths: bounded, so no later arithmetic overflows


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's default in ``--help``, except where there is none to show (switches, unset options)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """One-line errors; ``--help`` shows every option's default; a verb with ``--config-file`` reads its flags
    from the TOML file first (:mod:`parallelisms.config_file`)."""

    def __init__(self, *args, formatter_class=_Formatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        if args is None or not any(a.startswith(CONFIG_FLAG) for a in args) or not self._has(CONFIG_FILE):
            return super().parse_known_args(args, namespace)
        flags, own, path = expand(list(args), self)
        try:  # the file's values alone first: a bad one is named as the file's
            super().parse_known_args(flags, argparse.Namespace())
        except ConfigError as exc:
            raise ConfigError(f"{CONFIG_FLAG} {path!r}: {exc}") from None
        parsed, extra = super().parse_known_args(flags + own, namespace)
        setattr(parsed, CONFIG_FILE, path)
        return parsed, extra

    def _has(self, dest: str) -> bool:
        return any(a.dest == dest for a in self._actions)

    def error(self, message):  # one line, no usage block
        raise ConfigError(f"{message} (see {self.prog} --help)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The model's flags, and ``--config-file`` (every verb that takes a model takes a whole run from a file)."""
    p.add_argument(CONFIG_FLAG, metavar="RUN_TOML", help="the run's flags from a TOML file, by section ([model], "
                                                         "[layout], [training], [optimizer], [data], [outputs], "
                                                         "[run]); flags given here override it")
    g = p.add_argument_group("model")
    g.add_argument("--preset", default=DEFAULT_TRAIN["preset"], help=f"model preset: {', '.join(PRESETS)}")
    g.add_argument("--config", metavar="CONFIG_JSON", help="Hugging Face Llama-style config.json (overrides --preset)")
    add_shape_args(g)


def add_layout_args(p: argparse.ArgumentParser, dp_default: int = 1) -> None:
    g = p.add_argument_group("layout (world size = pp x dp x cp x tp)")
    when = f"{dp_default} when --tp, --pp and --cp are 1, else 1" if dp_default > 1 else str(dp_default)
    g.add_argument("--dp", type=DEGREE, help=f"data-parallel degree (replicas for DDP; the shard group for "
                                              f"--zero/--fsdp); default {when}")
    p.set_defaults(dp_default=dp_default)
    g.add_argument("--dp-replicate", type=DEGREE, help="replicate degree of a 2-D data-parallel mesh (hybrid FSDP)")
    g.add_argument("--dp-shard", type=DEGREE, help="shard degree of a 2-D data-parallel mesh (hybrid FSDP)")
    for name, text in (("tp", "tensor"), ("pp", "pipeline"), ("cp", "context"), ("ep", "expert")):
        g.add_argument(f"--{name}", type=DEGREE, default=1, help=f"{text}-parallel degree")
    g.add_argument("--find-unused-parameters", action="store_true",
                   help="treat parameters with no gradient as zero instead of raising")
    g = p.add_argument_group("tensor parallelism")
    g.add_argument("--sp", action="store_true", help="Megatron sequence parallelism (needs --tp > 1)")
    g.add_argument("--tp-overlap", action="store_true", help="overlap the input-gradient all-reduce with dW")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="--zero 1/2: all-gather the updated parameters under the next forward (Megatron's)")
    g.add_argument("--tp-overlap-chunks", type=integer(0, 64), default=0,
                   help="with --tp-overlap: hide the forward's collectives too, pipelined with their GEMMs over N chunks")
    g = p.add_argument_group("sharded data parallelism")
    g.add_argument("--zero", type=integer(0, 3), default=0, help="ZeRO stage 1, 2 or 3")
    g.add_argument("--fsdp", help="full_shard, shard_grad_op, no_shard, hybrid_shard or hybrid_shard_zero2")
    g.add_argument("--fsdp-prefetch", type=integer(1, 64), default=1,
                   help="ZeRO-3 / flat FSDP: units whose parameters are gathered ahead of the running one")
    g.add_argument("--fsdp-style", default="flat", help="flat (FSDP1), per_param (FSDP2) or reuse (YaFSDP)")
    g.add_argument("--mixed-precision", default="fp32", help="fp32 or bf16 (bf16 compute, fp32 master weights)")
    g = p.add_argument_group("data-parallel balance")
    g.add_argument("--dp-balance", default="even", help="split each global batch evenly (even) or in proportion "
                                                        "to each data-parallel rank's measured speed (measured)")
    g.add_argument("--rebalance-every", type=integer(0, 10**9), default=0,
                   help="with --dp-balance measured: re-measure and re-split every N steps (0: once)")
    g = p.add_argument_group("expert-parallel balance")
    g.add_argument("--ep-balance", default="even", help="experts split evenly over --ep (even) or placed by the "
                                                        "tokens measured per expert, EPLB-style (measured)")
    g.add_argument("--ep-redundant", type=integer(0, 10**6), default=0,
                   help="with --ep-balance measured: extra expert slots per ep rank, for copies of the hottest experts")
    g.add_argument("--ep-rebalance-every", type=integer(0, 10**9), default=0,
                   help="with --ep-balance measured: re-measure and re-place every N steps (0: once)")
    g = p.add_argument_group("activation memory")
    g.add_argument("--recompute", default="none", help="activation recomputation: none, selective or full")
    g = p.add_argument_group("context parallelism")
    g.add_argument("--cp-attention", help="; ".join(f"{m.name}: {m.summary}" for m in MODES.values()))
    g.add_argument("--cp-ulysses-size", type=COUNT, help="hierarchical: the all-to-all degree inside (a divisor of --cp)")
    g = p.add_argument_group("pipeline parallelism")
    g.add_argument("--schedule", help="gpipe, 1f1b (default), interleaved, zb-h1, zb-h2, zb-v, dualpipe, dualpipev "
                                      "or pipedream")
    g.add_argument("--microbatches", type=COUNT, help="microbatches per step (default 2 x pp)")
    g.add_argument("--chunks", type=COUNT, help="virtual stages per rank (interleaved: 2 or more)")
    g.add_argument("--pp-balance", help="cut stages by equal layer counts (layers, default) or by per-layer "
                                        "forward+backward time measured on rank 0 (measured)")


def add_train_args(p: argparse.ArgumentParser, steps: int) -> None:
    g = p.add_argument_group("training")
    d = TrainConfig()
    g.add_argument("--steps", type=COUNT, default=steps, help="optimizer steps")
    g.add_argument("--global-batch", type=COUNT, default=DEFAULT_TRAIN["global_batch"], help="sequences per step")
    g.add_argument("--seq-len", type=integer(2, 10**9), default=DEFAULT_TRAIN["seq_len"], help="tokens per sequence")
    g.add_argument("--grad-accum", type=COUNT, default=1, help="microbatches per rank per step")
    g.add_argument("--lr", type=number(0, above=True), default=d.lr, help="AdamW learning rate")
    g.add_argument("--grad-clip", type=number(0), default=d.grad_clip, help="global-norm clip (0: off)")
    g.add_argument("--weight-decay", type=number(0), default=d.weight_decay,
                   help="AdamW's decoupled weight decay, of the weight matrices (not norms, biases, embeddings)")
    g.add_argument("--betas", type=number_pair(0, 1), default=d.betas, metavar="B1,B2", help="AdamW's betas")
    g.add_argument("--eps", type=number(0, above=True), default=d.eps, help="AdamW's epsilon")
    g.add_argument("--decay-all", action="store_true", help="decay every parameter, norms and embeddings included")
    # the data loader seeds step s with seed x 1_000_003 + s, which torch's 64-bit seeds hold for any seed below 2^32
    g.add_argument("--seed", type=integer(0, 2**32 - 1), default=d.seed, help="seed of the weights and the data")
    g.add_argument("--bucket-mb", type=number(0, 2**20, above=True), default=d.bucket_mb,
                   help="data-parallel gradient bucket cap")
    g.add_argument("--timeout", type=number(0, 10**6, above=True), default=d.timeout_s,
                   help="collective timeout, seconds")
    g.add_argument("--dtype", default=d.dtype, help="parameter dtype: float32, or float64 (rounding ~1e-16, so verify's "
                                                    "contract tightens to 1e-10)")
    g.add_argument("--slow-rank", type=slow_rank, metavar="R:F", help="make rank R's compute F times slower (real "
                                                                       "work; a straggler to see in the report)")
    p.add_argument("--json", action="store_true", help="last stdout line: one JSON object")


def add_device_args(p: argparse.ArgumentParser) -> None:
    from parallelisms.device import DEVICES

    p.add_argument("--device", default="auto", help=f"{', '.join(DEVICES)}: auto is cuda (NCCL) when every rank on "
                                                    f"this machine has a GPU of its own, else cpu (gloo)")
    p.add_argument("--force", action="store_true", help="launch even where the layout's memory per rank (as estimate "
                                                        "predicts it) exceeds this machine's")
