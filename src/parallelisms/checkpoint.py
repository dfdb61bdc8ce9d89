"""Checkpoints that any layout can load, on ``torch.distributed.checkpoint`` (DCP).

Each rank presents what it holds of every full tensor of the plain model as boxes with their place in it
(:meth:`parallelisms.parallel.grad_sync.GradSync.placements`): the weights, AdamW's two moments shaped like
them, and the optimizer step; DCP writes each box once (replicas are deduplicated) with chunk metadata, and
on load reads, for every box a rank of the new layout holds, the overlapping saved chunks. dp, ZeRO stage,
FSDP strategy and style, tp, sp, cp, ep, pp and schedule may therefore all change between save and resume
(torchtitan resumes FSDP2/TP/PP runs through DCP the same way, with DTensors). A checkpoint also holds the
step, the data loader's position and the schedulers' states (plain data, stored as JSON in a byte tensor) and
every rank's RNG state (a byte tensor): only tensors, so a load runs nothing from the files
(:mod:`parallelisms.checkpoint_files` reads DCP's metadata with a restricted unpickler).

A save writes ``step_N.tmp`` and rank 0 renames it ``step_N`` once DCP has written every rank's data and
its metadata, then writes ``parallelisms.json`` (model shape, layout, step) there: a save that dies half-way
leaves a ``.tmp`` that ``--resume auto`` never picks. With ``async_save`` the boxes are copied first (the
step's only cost) and written by DCP's background thread over a process group of its own. DCP's own
plan-exchange collectives run on torch.distributed directly, outside the comm ledger.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import (_create_read_items, _create_write_items,
                                                         create_read_items_for_chunk_list)

from parallelisms.checkpoint_files import (SafeReader, json_tensor, lock_directory, one_line, require_tensors,
                                           tensor_json, write_manifest)
from parallelisms.errors import ConfigError, require
from parallelisms.resume import META, latest  # noqa: F401 (latest: the newest complete checkpoint)
MOMENTS = ("exp_avg", "exp_avg_sq")  # AdamW's state shaped like its parameter


class Boxes:
    """One full tensor of shape ``full_shape`` as the boxes this rank holds: ``{offsets: tensor}``."""

    def __init__(self, full_shape: tuple[int, ...], dtype: torch.dtype):
        self.full_shape, self.dtype, self.boxes = tuple(full_shape), dtype, {}

    def write_items(self, fqn: str) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(offsets), box.shape),
                                                      properties=props, size=torch.Size(self.full_shape)))
                for offsets, box in self.boxes.items()]

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(offsets), box.shape) for offsets, box in self.boxes.items()]

    def snapshot(self) -> "Boxes":
        """A copy in host memory (what an asynchronous save writes while training goes on)."""
        copy = Boxes(self.full_shape, self.dtype)
        copy.boxes = {o: b.detach().to("cpu", copy=True) for o, b in self.boxes.items()}
        return copy


class _SavePlanner(DefaultSavePlanner):
    """DCP's default planner, with :class:`Boxes` values written box by box (our keys are flat already)."""

    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def create_local_plan(self) -> SavePlan:
        items = []
        for fqn, obj in self.state_dict.items():
            items += obj.write_items(fqn) if isinstance(obj, Boxes) else _create_write_items(fqn, obj)
        self.plan = SavePlan(items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        obj = self.state_dict[write_item.index.fqn]
        if isinstance(obj, Boxes):  # its own storage: torch.save of a view would write the whole buffer
            return obj.boxes[tuple(write_item.index.offset)].detach().to("cpu", copy=True)
        return super().resolve_data(write_item)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, with :class:`Boxes` values read box by box, in place."""

    def __init__(self, optional: set[str]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.optional = optional

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        """As the default, without its meta-tensor pass (which drops values of types it does not know)."""
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def create_local_plan(self) -> LoadPlan:
        saved = self.metadata.state_dict_metadata
        require_tensors(self.metadata, self.state_dict, "being loaded")
        missing = [fqn for fqn in self.state_dict if fqn not in saved and fqn not in self.optional]
        if missing:
            raise ConfigError(f"the checkpoint lacks {missing[0]} ({len(missing)} entries missing): it was saved "
                              f"from another model or is damaged")
        items = []
        for fqn, obj in self.state_dict.items():
            if fqn not in saved:
                continue
            md = saved[fqn]
            if isinstance(obj, Boxes):
                if tuple(md.size) != obj.full_shape:
                    raise ConfigError(f"checkpoint tensor {fqn} has shape {tuple(md.size)}, this model's is "
                                      f"{obj.full_shape}: it was saved from another model shape")
                items += create_read_items_for_chunk_list(fqn, md, obj.chunks())
            else:
                items += _create_read_items(fqn, md, obj)
        return LoadPlan(items)

    def load_bytes(self, read_item, value) -> None:
        raise ConfigError(f"checkpoint entry {read_item.dest_index.fqn} is a pickled object: refused")

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, Boxes):  # a view into the engine's own storage: DCP's reader copies into it
            return obj.boxes[tuple(index.offset)]
        return super().lookup_tensor(index)


@contextmanager
def _single_process_quiet():
    """DCP warns that it assumes one process whenever there is no process group, which is what we asked for."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _init_adam_state(optimizers) -> None:
    """Create AdamW's state for parameters that have none yet (a resume before the first step)."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for opt in optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                state = opt.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=scalar)
                    for key in MOMENTS:
                        state[key] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _tensors(trainer) -> tuple[dict[str, Boxes], list]:
    """The model's weights and the optimizer moments as :class:`Boxes` by plain names (``model.NAME``,
    ``optim.NAME.exp_avg``...), and the optimizer states holding ``step``."""
    out, states = {}, []
    for param, pieces in trainer.grad_sync.placements():
        sources = [("model", param)]
        for opt in trainer.optimizers:
            state = opt.state.get(param)
            if state:
                states.append(state)
                sources += [("optim", state[key], key) for key in MOMENTS]
        for piece in pieces:
            for source in sources:
                fqn = f"model.{piece.name}" if source[0] == "model" else f"optim.{piece.name}.{source[2]}"
                entry = out.setdefault(fqn, Boxes(piece.full_shape, source[1].dtype))
                entry.boxes.setdefault(piece.offsets, piece.view(source[1].detach()))
    return out, states


def _rng_state(rank: int) -> dict[str, torch.Tensor]:
    """This rank's RNG states as byte tensors (``rng.RANK.torch``, ``rng.RANK.cuda``)."""
    state = {f"rng.{rank}.torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state[f"rng.{rank}.cuda"] = torch.cuda.get_rng_state()
    return state


@dataclass
class Resumed:
    """What a resume restores besides the tensors: the step to continue from and the data position."""

    step: int
    data_state: object = None


def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step_{step}"


class Saver:
    """Saves every ``every`` steps into ``root`` (all ranks construct it and call :meth:`save`)."""

    def __init__(self, root: str, every: int, async_save: bool, comms, rank: int, meta: dict,
                 device: torch.device = torch.device("cpu")):
        self.root, self.every, self.async_save, self.comms, self.rank = Path(root), every, async_save, comms, rank
        self.device = device  # of the barrier's tensor (NCCL reduces device tensors)
        self.meta = meta
        self.pending = None  # (future, step, tmp dir)
        # async: DCP's background thread synchronizes over a group of its own, not the training's
        self.group = dist.new_group(backend="gloo") if async_save and dist.is_initialized() else None
        self.times: list[float] = []  # seconds the training loop spent in each save
        self.lock = None  # rank 0: one run per directory, until this one ends
        if rank == 0:
            with one_line(self.root, "saving"):
                self.root.mkdir(parents=True, exist_ok=True)
            self.lock = lock_directory(self.root)

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def save(self, trainer, step: int, data_state=None) -> None:
        """Save the state after ``step`` steps (a collective)."""
        self.wait()
        tmp = self.root / f"step_{step}.tmp"
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what a killed save left
            with one_line(tmp, "saving"):
                tmp.mkdir()  # the --save directory removed meanwhile: one line, not a new one
        self._barrier()
        try:
            self._write(trainer, step, data_state, tmp)
        except BaseException:
            self._discard(tmp)
            raise

    def _write(self, trainer, step: int, data_state, tmp: Path) -> None:
        tensors, states = _tensors(trainer)
        state = dict(tensors)
        if states:
            state["optim.step"] = states[0]["step"].detach().clone()
        state["train.json"] = json_tensor({"step": step, "data": data_state, "schedulers": _scheduler_states(trainer)})
        state.update(_rng_state(self.rank))
        writer = dcp.FileSystemWriter(str(tmp))
        if self.async_save:
            state = {k: v.snapshot() if isinstance(v, Boxes) else v for k, v in state.items()}
            future = dcp.async_save(state, storage_writer=writer, planner=_SavePlanner(), process_group=self.group)
            self.pending = (future, step, tmp)
        else:
            with _single_process_quiet(), one_line(tmp, "saving"):
                dcp.save(state, storage_writer=writer, planner=_SavePlanner(), no_dist=not dist.is_initialized())
            self._finalize(step, tmp)

    def _barrier(self) -> None:
        with self.comms.ledger.in_phase("checkpoint"):
            self.comms["world"].all_reduce(torch.zeros(1, device=self.device))

    def _finalize(self, step: int, tmp: Path) -> None:
        """Rank 0, once DCP's metadata is written (every rank's data is): metadata file, then the rename."""
        if self.rank != 0:
            return
        try:
            with one_line(tmp, "saving"):
                write_manifest(tmp)
                (tmp / META).write_text(json.dumps({**self.meta, "step": step}, indent=1))  # last: complete
                final = checkpoint_dir(self.root, step)
                shutil.rmtree(final, ignore_errors=True)
                os.replace(tmp, final)
        except BaseException:
            self._discard(tmp)
            raise

    def _discard(self, tmp: Path) -> None:
        """Rank 0: remove what a failed save wrote (the previous complete step stays as it was)."""
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)

    def wait(self) -> None:
        """Complete an asynchronous save in flight."""
        if self.pending is not None:
            future, step, tmp = self.pending
            self.pending = None
            try:
                with one_line(tmp, "saving"):
                    future.result()
            except BaseException:
                self._discard(tmp)
                raise
            self._finalize(step, tmp)

    def close(self) -> None:
        self.wait()
        self._barrier()  # rank 0's rename is done before any rank returns
        if self.lock is not None:
            self.lock.close()


def load(trainer, path: str | os.PathLike, rank: int) -> Resumed:
    """Load the checkpoint at ``path`` into this layout's trainer (a collective): weights, optimizer moments and
    step, this rank's RNG state (rank 0's when the saving run had fewer ranks); the sharded engines refresh
    their gathered copies."""
    _init_adam_state(trainer.optimizers)
    reader = SafeReader(str(path))
    saved = reader.read_metadata().state_dict_metadata
    tensors, states = _tensors(trainer)
    state = dict(tensors)
    step_tensor = torch.zeros((), dtype=states[0]["step"].dtype) if states else None
    if states:
        state["optim.step"] = step_tensor
    rng = f"rng.{rank}" if f"rng.{rank}.torch" in saved else "rng.0"  # rank 0's when the saving run had fewer
    byte_entries = ["train.json", f"{rng}.torch"] + ([f"{rng}.cuda"] if torch.cuda.is_available() else [])
    for name in byte_entries:
        if name in saved and hasattr(saved[name], "size"):
            state[name] = torch.empty(tuple(saved[name].size), dtype=torch.uint8)
    with _single_process_quiet(), one_line(path, "loading"):
        dcp.load(state, storage_reader=reader, no_dist=not dist.is_initialized(),
                 planner=_LoadPlanner(optional={"optim.step", f"{rng}.torch", f"{rng}.cuda"}))
    require("train.json" in state, f"checkpoint {str(path)!r} lacks its training state (train.json): saved by "
                                   f"another version or damaged")
    train = tensor_json(state["train.json"], f"train.json of {str(path)!r}")
    for s in states:
        s["step"].fill_(step_tensor.item())
    if f"{rng}.torch" in state:
        torch.set_rng_state(state[f"{rng}.torch"])
    if f"{rng}.cuda" in state:
        torch.cuda.set_rng_state(state[f"{rng}.cuda"])
    _restore_schedulers(trainer, train.get("schedulers") or [])
    trainer.grad_sync.after_step()
    return Resumed(train["step"], train.get("data"))


def _scheduler_states(trainer) -> list[dict]:
    """The learning-rate schedulers' states (one per optimizer, where the trainer has them)."""
    return [s.state_dict() for s in getattr(trainer, "schedulers", ())]


def _restore_schedulers(trainer, saved: list[dict]) -> None:
    """Every scheduler continues from the first saved one's position (they step together), and its optimizer's
    learning rate is the one that position gives."""
    for scheduler in getattr(trainer, "schedulers", ()) if saved else ():
        groups = len(scheduler.optimizer.param_groups)  # a save with another number of groups: every group's lr
        scheduler.load_state_dict({k: v[:1] * groups if k in ("base_lrs", "_last_lr") else v  # is the same
                                   for k, v in saved[0].items()})
        for group, lr in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
            group["lr"] = lr


def load_full_state(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The full parameters of the checkpoint at ``path`` by the plain model's names, in one process (no process
    group): what an export or an evaluation reads, whatever layout saved it."""
    reader = SafeReader(str(path))
    metadata = reader.read_metadata()
    require_tensors(metadata, [fqn for fqn in metadata.state_dict_metadata if fqn.startswith("model.")], path)
    state = {fqn: torch.empty(tuple(md.size), dtype=md.properties.dtype)
             for fqn, md in metadata.state_dict_metadata.items() if fqn.startswith("model.")}
    with _single_process_quiet(), one_line(path, "loading"):
        dcp.load(state, storage_reader=reader, no_dist=True)
    return {fqn[len("model."):]: t for fqn, t in state.items()}
