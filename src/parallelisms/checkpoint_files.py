"""A checkpoint's files read without running anything from them.

DCP's ``FileSystemReader`` unpickles ``.metadata`` with :mod:`pickle`, which calls whatever a crafted file names
(``os.system`` included). :class:`SafeReader` reads it with an unpickler that constructs only the classes DCP's
metadata is made of (``torch.distributed.checkpoint.metadata``, the file system's ``_StorageInfo``,
``torch.Size``, dtypes, layouts, paths), as Python's documentation advises for restricting globals, and checks
that every storage entry names a plain file of the checkpoint's own directory. Tensors are read by DCP with
``torch.load(weights_only=True)``; the project stores nothing else: its training state and RNG states are
tensors (JSON as bytes, :func:`json_tensor`), and a load refuses any entry that is not a tensor (DCP would
unpickle it with ``weights_only=False``).
"""

from __future__ import annotations

import fcntl
import importlib
import json
import os
import pickle
import socket
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from parallelisms.errors import ConfigError, StorageError, require

METADATA = ".metadata"
FORMAT = 2  # a checkpoint's "format": 2 stores only tensors (1 pickled the training and RNG states)
_ALLOWED = {  # module -> the names DCP's metadata pickle may construct
    "torch.distributed.checkpoint.metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                              "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
                                              "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name in _ALLOWED.get(module, ()):
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which is not part of a checkpoint's metadata")


def read_metadata(path: str | Path) -> Metadata:
    """The DCP metadata file ``path``, constructed from metadata classes only, its storage entries checked; one
    line (:class:`ConfigError`) for a crafted or damaged file."""
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except OSError as exc:
        raise ConfigError(f"checkpoint metadata {str(path)!r} cannot be read ({exc.strerror})") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError, IndexError,
            ImportError, RecursionError, MemoryError, OverflowError) as exc:
        raise ConfigError(f"checkpoint metadata {str(path)!r} is refused: {exc.__class__.__name__}: "
                          f"{str(exc)[:200]} (crafted or damaged; nothing in it was run)") from None
    require(isinstance(metadata, Metadata) and isinstance(metadata.state_dict_metadata, dict)
            and isinstance(metadata.storage_data, dict),
            f"checkpoint metadata {str(path)!r} is refused: not DCP metadata (crafted or damaged)")
    for info in metadata.storage_data.values():
        name = getattr(info, "relative_path", None)
        require(isinstance(name, str) and name == Path(name).name and not name.startswith(".")
                and isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                and info.length >= 0,
                f"checkpoint metadata {str(path)!r} is refused: a storage entry points at {name!r}, not at a data "
                f"file of the checkpoint's directory")
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata


class SafeReader(dcp.FileSystemReader):
    """DCP's file system reader with :func:`read_metadata` in place of its pickle.load."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        metadata = read_metadata(self._get_metadata_path(kwargs.get("rank")))
        metadata.storage_meta.load_id = self.load_id
        return metadata


def require_tensors(metadata: Metadata, names, path) -> None:
    """One line unless every entry ``names`` of the checkpoint is a tensor (anything else DCP would unpickle)."""
    for name in names:
        md = metadata.state_dict_metadata.get(name)
        require(md is None or isinstance(md, TensorStorageMetadata),
                f"checkpoint {str(path)!r} holds {name} as a pickled object, not a tensor: refused (crafted, or "
                f"saved by another program)")


def json_tensor(value) -> torch.Tensor:
    """``value`` (plain data) as JSON in a byte tensor: what a checkpoint stores instead of a pickled object."""
    return torch.frombuffer(bytearray(json.dumps(value).encode()), dtype=torch.uint8).clone()


def tensor_json(tensor: torch.Tensor, what: str):
    """The plain data :func:`json_tensor` stored; one line if it is not JSON."""
    try:
        return json.loads(bytes(tensor.to(torch.uint8).tolist()).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ConfigError(f"checkpoint entry {what} is damaged ({exc.__class__.__name__}: {str(exc)[:100]})") from None


@contextmanager
def one_line(path, doing: str):
    """A failure of DCP's save or load (a ``CheckpointException``, a ``BaseException`` that carries each rank's
    error) as one line: the first rank's :class:`ConfigError` as it is, an OS error naming its file and cause."""
    try:
        yield
    except CheckpointException as exc:
        rank, (error, _) = min(exc.failures.items(), key=lambda item: item[0])
        raise _one_line_error(error, path, doing, f" (rank {rank})") from None
    except (ConfigError, StorageError):
        raise
    except Exception as exc:  # noqa: BLE001 (one line whatever DCP raised)
        raise _one_line_error(exc, path, doing, "") from None


def _one_line_error(error: BaseException, path, doing: str, where: str) -> Exception:
    if isinstance(error, (ConfigError, StorageError)):
        return error
    if isinstance(error, OSError):
        name = error.filename or path
        return StorageError(f"{doing} checkpoint {str(name)!r} failed{where}: {error.strerror or error}")
    text = str(error).strip().splitlines()
    return StorageError(f"{doing} checkpoint {str(path)!r} failed{where}: {error.__class__.__name__}: "
                           f"{text[-1][:300] if text else ''} (damaged or incomplete)")


def read_meta(path: str | Path) -> dict:
    """The ``parallelisms.json`` file ``path`` as a dict; one line if it is damaged or of another format."""
    try:
        meta = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"{str(path)!r} cannot be read ({exc.strerror})") from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError(f"{str(path)!r} is damaged ({exc.__class__.__name__}: {str(exc)[:100]})") from None
    require(isinstance(meta, dict) and isinstance(meta.get("model"), dict) and isinstance(meta.get("step"), int),
            f"{str(path)!r} is damaged (no model or step)")
    require(meta.get("format") == FORMAT, f"{str(path)!r} is of checkpoint format {meta.get('format')!r}, this "
                                          f"version reads {FORMAT} (format 1 stored pickled objects, which are "
                                          f"no longer loaded)")
    return meta


def check_checkpoint(path: str | Path, meta_name: str) -> dict:
    """Everything a load reads before it reads it: ``meta_name`` (the project's JSON) and DCP's metadata, safely,
    with every entry a tensor; returns the project's metadata. One line for anything wrong."""
    meta = read_meta(Path(path) / meta_name)
    metadata = read_metadata(Path(path) / METADATA)
    require_tensors(metadata, metadata.state_dict_metadata, path)
    return meta


# -- the manifest: every file's size and hash, written with the save, checked before a load ---------------------
MANIFEST = "manifest.json"


def _crc(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            crc = zlib.crc32(block, crc)
    return f"{crc:08x}"


def write_manifest(directory: Path) -> None:
    """``manifest.json``: the size and CRC-32 of every file DCP wrote into ``directory``."""
    files = {p.name: {"size": p.stat().st_size, "crc32": _crc(p)} for p in sorted(directory.iterdir()) if p.is_file()}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=1))


def damage(directory: Path, meta_name: str) -> str | None:
    """What makes ``directory`` not a complete, intact checkpoint (a missing file, a size or a hash that differs
    from its manifest), or None."""
    for name in (meta_name, METADATA, MANIFEST):
        if not (directory / name).is_file():
            return f"no {name}"
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
        entries = [(name, int(entry["size"]), str(entry["crc32"])) for name, entry in files.items()]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        return f"its {MANIFEST} is damaged ({exc.__class__.__name__})"
    for name, size, crc in entries:
        path = directory / name
        if name != Path(name).name or not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size:,} bytes, its manifest says {size:,}"
        if _crc(path) != crc:
            return f"{name} differs from its manifest (CRC-32 {_crc(path)}, saved {crc}): damaged"
    return None


def verified(directory: Path, meta_name: str, what: str) -> dict:
    """:func:`check_checkpoint` of a directory whose files match its manifest; one line for anything wrong."""
    problem = damage(directory, meta_name)
    require(problem is None, f"{what} {str(directory)!r} is not a complete, intact checkpoint: {problem}")
    return check_checkpoint(directory, meta_name)


def newest_verified(root: Path, meta_name: str) -> tuple[Path | None, list[str]]:
    """The newest ``step_N`` under ``root`` that is complete and verifies, and a line for each newer one skipped
    (which, and why)."""
    steps = sorted((p for p in root.glob("step_*") if p.is_dir() and p.name[5:].isdigit()),
                   key=lambda p: int(p.name[5:]), reverse=True)
    skipped = []
    for step in steps:
        try:
            verified(step, meta_name, "")
            return step, skipped
        except ConfigError as exc:
            skipped.append(f"--resume auto skips {step.name}: {str(exc).split(': ', 1)[-1]}")
    return None, skipped


# -- one run per --save directory -------------------------------------------------------------------------------
LOCK = ".parallelisms.lock"


def lock_directory(root: Path):
    """Hold ``root``'s lock (``flock``, released when the process ends) and return its open file; one line if
    another run holds it."""
    path = root / LOCK
    try:
        handle = open(path, "a+")
    except OSError as exc:
        raise StorageError(f"--save {str(root)!r}: its lock {str(path)!r} cannot be opened ({exc.strerror})") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(f"--save {str(root)!r} is in use by another run ({holder}); wait for it, or save "
                          f"into another directory") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}")
    handle.flush()
    return handle


def check_save_directory(root: Path, resuming: bool, meta_name: str) -> None:
    """Before launch: ``root`` is not locked by another run, and a fresh run (not resuming) does not write over
    another run's checkpoints."""
    lock_directory(root).close()
    if not resuming:
        steps = sorted(int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit()
                       and (p / meta_name).is_file())
        require(not steps, f"--save {str(root)!r} holds checkpoints of another run (step_{steps[-1] if steps else 0}"
                           f"); add --resume auto to continue it, or save into another directory")
