"""One rank's dry run: the real model, the real ``parallelize`` and one real training step of rank r of an
N-rank layout, on the fake process group with fake tensors and the recording transport
(:mod:`parallelisms.comm.recording`). Nothing is allocated and nothing is sent; what comes out is the rank's
ledger (every collective and message, in order) and its memory over the step (:mod:`.memory`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from parallelisms.comm import Timeline
from parallelisms.comm.recording import Event, RecordingComms, RecordingLedger
from parallelisms.config import ModelConfig, ParallelConfig, TrainConfig
from parallelisms.dryrun.fake import balance_routing, fake_rank
from parallelisms.dryrun.memory import MemoryAccount
from parallelisms.dryrun.replay import MicrobatchReplay
from parallelisms.options import PpBalance


@dataclass
class RankRun:
    """What one rank's dry run recorded."""

    rank: int
    events: list[Event]          # setup and the first step, in order (memory: over two steps)
    records: list                # the same calls as the ledger's CommRecords (compared with a real run's ledger)
    memory: dict = field(default_factory=dict)  # :meth:`MemoryAccount.report`
    seconds: float = 0.0
    replayed: int = 0            # compute actions replayed (:mod:`.replay`), not run


def local_batch(train: TrainConfig, parallel: ParallelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets: zeros of the shape the loader gives a data-parallel rank (token ids do not
    change shapes; real, so the integer decisions taken from them run)."""
    rows = train.global_batch // parallel.dims.dp
    tokens = torch.zeros(rows, train.seq_len, dtype=torch.long)
    return tokens, tokens.clone()


def build_fake_model(model_cfg: ModelConfig, train: TrainConfig, layers: list[int] | None = None):
    """The real model class, its parameters fake (the same shapes, dtypes and modules as ``build_model``'s);
    ``layers``: only those blocks (under their own indices), the others never built (:func:`layers_on`)."""
    import dataclasses

    from parallelisms.model.transformer import Block, Transformer

    model_cfg.validate()
    if layers is None:
        model = Transformer(model_cfg)
    else:  # the class built without blocks, then given the rank's own
        model = Transformer(dataclasses.replace(model_cfg, n_layers=0))
        model.cfg = model_cfg
        model.layers = torch.nn.ModuleDict({str(i): Block(model_cfg) for i in layers})
    if train.torch_dtype != torch.float32:
        _cast_floating(model, train.torch_dtype)
        model.set_rotary_dtype(train.torch_dtype)
    balance_routing(model)
    return model


def modelled_costs(model_cfg: ModelConfig, train: TrainConfig, parallel: ParallelConfig) -> tuple | None:
    """What ``--pp-balance measured`` cuts by in the dry run, in place of rank 0's profile on real tensors
    (``parallel/pipeline/runner.py: measured_bounds``): each part's training FLOPs for one microbatch (a block's,
    the embedding's none, the head's; ``perf/model.py: model_flops_per_token``), as ``profile_costs`` returns its
    times. ``None`` for the other cuts. Every rank takes rank 0's cut, so the collective order holds for any cut."""
    import dataclasses

    from parallelisms.parallel.pipeline.schedules import schedule_for
    from parallelisms.perf.model import model_flops_per_token

    if parallel.dims.pp == 1 or parallel.pp_balance is not PpBalance.MEASURED:
        return None
    tokens = train.global_batch // parallel.dims.dp // schedule_for(parallel).microbatches * train.seq_len
    head = model_flops_per_token(dataclasses.replace(model_cfg, n_layers=0), train.seq_len)
    block = (model_flops_per_token(model_cfg, train.seq_len) - head) / model_cfg.n_layers
    return [block * tokens] * model_cfg.n_layers, 0.0, head * tokens


def layers_on(parallel: ParallelConfig, model_cfg: ModelConfig, rank: int, costs: tuple | None = None
              ) -> list[int] | None:
    """The blocks rank ``rank`` holds under the pipeline cut ``parallelize`` makes (equal layer counts per stage,
    or under ``--pp-balance measured`` the cut of ``costs``, :func:`modelled_costs`; ``parallel/pipeline/runner.py:
    cut_stages``), or ``None`` where it holds them all (no pipeline). The layers of other stages are never used by
    the rank: building them costs time (80 blocks of a 70B model, tensor-parallel swaps included) and, kept by the
    full model, memory the rank does not hold."""
    from parallelisms.parallel.pipeline.partition import balanced_bounds, equal_bounds
    from parallelisms.parallel.pipeline.schedules import schedule_for

    if parallel.dims.pp == 1:
        return None
    schedule = schedule_for(parallel)
    bounds = (balanced_bounds(*costs, schedule.num_stages) if costs is not None
              else equal_bounds(model_cfg.n_layers, schedule.num_stages))
    stages = sorted({s for _, s in schedule.modules_on(parallel.dims.coordinates(rank)["pp"])})
    return [i for s in stages for i in range(bounds[s], bounds[s + 1])]


def _cast_floating(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """``model.to(dtype)`` for fake parameters (``Module.to`` swaps fake tensors, which their weak references
    refuse): every floating parameter and buffer replaced by its cast, a parameter held by two modules (tied
    embeddings) by one cast."""
    cast = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, t in store.items():
                if t is None or not t.is_floating_point():
                    continue
                if id(t) not in cast:
                    new = t.detach().to(dtype)
                    cast[id(t)] = torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
                store[name] = cast[id(t)]


def dry_run_rank(model_cfg: ModelConfig, train: TrainConfig, parallel: ParallelConfig, rank: int,
                 memory: bool = True, replay: bool = True, own_layers: bool = True) -> RankRun:
    """Rank ``rank``'s setup and first training step through the real code (see the module docstring);
    ``replay``: a pipeline stage's middle microbatches are replayed from the first one (:mod:`.replay`);
    ``own_layers``: a pipeline rank builds only its own stages' blocks (:func:`layers_on`)."""
    from parallelisms.train_setup import parallelize

    began = time.perf_counter()
    dims = parallel.dims
    ledger = RecordingLedger()
    with fake_rank(rank, dims.world_size):
        torch.manual_seed(train.seed)
        meshes = dims.build_meshes("cpu") if dims.world_size > 1 else {}
        account = MemoryAccount(enabled=memory)
        with account:
            costs = modelled_costs(model_cfg, train, parallel)
            model = build_fake_model(model_cfg, train, layers_on(parallel, model_cfg, rank, costs) if own_layers
                                     else None)
            comms = RecordingComms(meshes, ledger, Timeline(rank, enabled=False))
            trainer = parallelize(model, parallel, train, comms, layer_costs=costs)
            inputs, targets = local_batch(train, parallel)
            replaying = (MicrobatchReplay(trainer.forward_backward.executor, ledger, account)
                         if replay and _replayable(trainer, model_cfg, parallel) else None)
            account.start_step(trainer)
            trainer.train_step(inputs, targets)
            events, records = list(ledger.events), list(ledger.records)
            if memory:  # the second step is the steady state (the optimizer's state exists from the first on)
                trainer.train_step(inputs, targets)
        trainer.grad_sync.remove()
    return RankRun(rank, events, records, account.report(), time.perf_counter() - began,
                   replaying.replayed if replaying else 0)


def _replayable(trainer, model_cfg: ModelConfig, parallel: ParallelConfig) -> bool:
    """A pipelined step of a dense model other than PipeDream's (whose forward swaps weight versions per
    microbatch); an MoE layer keeps each forward's routing statistics on itself, which a replay would not."""
    return (hasattr(trainer.forward_backward, "executor") and not parallel.schedule.startswith("pipedream")
            and not model_cfg.n_experts)
