"""Adversarial cases, run as a user would run them, and the table of their outcomes.

Each case runs ``parallelisms`` as a subprocess (tiny model, a few steps) against a damaged checkpoint, a lost
output, a hostile input file or a crafted file, and is classed: ``clean`` (the expected outcome: one ``error:``
line and a failing exit code, or a run that succeeds with a warning where that is the contract), ``traceback``,
``hang`` (no exit within the timeout), ``data lost`` (a complete step or another run's files gone or changed),
``leftover`` (a ``.tmp`` directory or a shared-memory file left behind), ``ran code`` (a crafted file's command
ran) or ``unclear`` (not one line). Prints one row per case and a table per class.

    slot env PYTHONPATH=$PWD/src python3 scripts/adversarial.py [--only NAME_PART]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

TINY = ["--preset", "tiny", "--global-batch", "2", "--seq-len", "16", "--no-precheck"]
HF_TINY = {"vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 128, "num_key_value_heads": 2, "max_position_embeddings": 128}
TIMEOUT_S = 180


def cli(*args) -> list[str]:
    return [sys.executable, "-m", "parallelisms", *map(str, args)]


def train(*args) -> list[str]:
    return cli("train", *TINY, *args)


def digest(folder: Path) -> str:
    """A hash of every file under ``folder`` (names and contents): a step's or a run's identity."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode() + path.read_bytes())
    return h.hexdigest()


class RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _special_file(flag: str, kind: str):
    """A case: a one-step run whose ``flag`` names a special file of ``kind`` (``Cases._node``)."""
    return lambda self: ("input files", train(flag, self._node(kind), "--steps", 1), False, None)


class Cases:
    """Each ``case_*`` method sets up in ``self.work`` and returns (class, command, expect success, check), where
    ``check()`` returns an outcome other than clean (data lost, leftover, ran code) or None."""

    def __init__(self, work: Path, saved: Path):
        self.work, self.saved = work, saved  # saved: a dp2 run's --save directory with step_1 and step_2

    def _copy(self) -> Path:
        run = self.work / "run"
        shutil.copytree(self.saved, run)
        return run

    def _kept(self, run: Path, *steps: str):
        before = {s: digest(run / s) for s in steps}
        return lambda: next(("data lost" for s, d in before.items() if not (run / s).is_dir() or digest(run / s) != d),
                            None) or ("leftover" if list(run.glob("*.tmp")) else None)

    def _damaged(self, name: str, damage):
        run = self._copy()
        target = next((run / "step_2").glob(name))
        damage(target)
        resume = train("--dp", 2, "--steps", 3, "--resume", run / "step_2")
        return "checkpoints", resume, False, self._kept(run, "step_1")

    def case_truncated_shard(self):
        return self._damaged("__0_0.distcp", lambda p: p.write_bytes(p.read_bytes()[:100]))

    def case_deleted_shard(self):
        return self._damaged("__1_0.distcp", lambda p: p.unlink())

    def case_garbage_metadata(self):
        return self._damaged(".metadata", lambda p: p.write_bytes(b"\x80\x04garbage"))

    def case_garbage_parallelisms_json(self):
        return self._damaged("parallelisms.json", lambda p: p.write_text("{not json"))

    def case_flipped_bytes_in_shard(self):
        def flip(p):
            data = bytearray(p.read_bytes())
            for i in range(200, 600):
                data[i % len(data)] ^= 0xFF
            p.write_bytes(bytes(data))
        return self._damaged("__0_0.distcp", flip)

    def case_resume_auto_without_newest_metadata(self):
        run = self._copy()
        (run / "step_2" / ".metadata").unlink()
        check = self._kept(run, "step_1")
        return "checkpoints", train("--dp", 2, "--steps", 3, "--save", run, "--resume", "auto"), True, check

    def case_fresh_run_into_old_save_dir(self):
        run = self._copy()
        return "checkpoints", train("--dp", 1, "--steps", 2, "--save", run), False, self._kept(run, "step_1", "step_2")

    def case_second_run_on_locked_save_dir(self):
        run = self.work / "locked"
        first = subprocess.Popen(train("--dp", 1, "--steps", 100000, "--save", run, "--save-every", 100000),
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 60
        while not (run / ".parallelisms.lock").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        self.cleanup = lambda: (os.killpg(first.pid, 9), first.wait())
        return "checkpoints", train("--dp", 1, "--steps", 2, "--save", run), False, None

    def _small_disk(self, size: int) -> Path | None:
        """A tmpfs of ``size`` bytes (None where this process cannot mount one), unmounted after the case."""
        disk = self.work / "disk"
        disk.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                          capture_output=True).returncode:
            return None
        self.cleanup = lambda: subprocess.run(["umount", "--lazy", str(disk)], capture_output=True)
        return disk

    def case_full_disk_on_save(self):
        """Room for one step (of a one-process run) and a half: the second save fails, the first must stay."""
        step = sum(p.stat().st_size for p in (self.saved / "step_1").rglob("*") if p.is_file())
        disk = self._small_disk(-(-int(step * 1.5) // 4096) * 4096)
        if disk is None:
            return None
        run = disk / "run"
        return ("checkpoints", train("--dp", 1, "--steps", 3, "--save", run, "--save-every", 1), False,
                lambda: "leftover" if list(run.glob("*.tmp")) else None if (run / "step_1").is_dir() else "data lost")

    def _crafted_metadata(self):
        run = self._copy()
        self.marker = self.work / "ran"
        (run / "step_2" / ".metadata").write_bytes(pickle.dumps(RunsACommand(self.marker)))
        from parallelisms.checkpoint_files import MANIFEST, write_manifest

        (run / "step_2" / MANIFEST).unlink()  # whoever can write the files can reseal the manifest
        write_manifest(run / "step_2")
        return run

    def _ran(self):
        return "ran code" if self.marker.exists() else None

    def case_crafted_metadata_on_export(self):
        run = self._crafted_metadata()
        return "security", cli("export", run / "step_2", "--out", self.work / "hf"), False, self._ran

    def case_crafted_metadata_on_resume(self):
        run = self._crafted_metadata()
        return "security", train("--dp", 2, "--steps", 3, "--resume", run / "step_2"), False, self._ran

    def case_store_not_on_other_interfaces(self):
        """A dp2 run's listening sockets (the launcher's and the ranks'), once its ranks train: all on loopback."""
        proc = subprocess.Popen(train("--dp", 2, "--steps", 100000), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        self.cleanup = lambda: (os.killpg(proc.pid, 9), proc.wait())
        addresses, deadline = [], time.monotonic() + 90
        while len(addresses) < 2 and time.monotonic() < deadline:
            time.sleep(1)
            addresses = listening(proc.pid)
        exposed = [a for a in addresses if not a.startswith("127.") and a != "::1"]
        verdict = f"error: listening on {exposed}" if exposed or not addresses else f"listening on {addresses} only"
        return ("security", [sys.executable, "-c", f"import sys; print({verdict!r}, file=sys.stderr); "
                                                   f"sys.exit({int(bool(exposed) or not addresses)})"], True, None)

    def case_deep_json_config(self):
        path = self.work / "deep.json"
        path.write_text("[" * 100_000)
        return "input files", train("--config", path, "--steps", 1), False, None

    def case_deep_json_hardware(self):
        path = self.work / "deep.json"
        path.write_text("[" * 100_000)
        return "input files", cli("estimate", "--preset", "tiny", "--hardware", path), False, None

    def _config(self, **changes) -> Path:
        path = self.work / "config.json"
        path.write_text(json.dumps({**HF_TINY, **changes}))
        return path

    def case_vocab_near_2_31(self):
        return "input files", train("--config", self._config(vocab_size=2**31 - 1), "--steps", 1), False, None

    def case_positions_near_2_31(self):
        config = self._config(max_position_embeddings=2**31 - 1)
        return "input files", train("--config", config, "--steps", 1), False, None

    def case_config_key_that_changes_the_math(self):
        return "input files", train("--config", self._config(hidden_dropout=0.1), "--steps", 1), False, None

    def case_unknown_config_key_named(self):
        return "input files", train("--config", self._config(my_extension=1), "--dp", 1, "--steps", 1), True, None

    def _node(self, kind: str) -> Path:
        path = self.work / f"node.{kind}"
        if kind == "fifo":
            os.mkfifo(path)
        elif kind == "loop":
            os.symlink(path, path)
        else:
            return Path("/dev/zero")
        return path

    case_config_fifo = _special_file("--config", "fifo")
    case_config_symlink_loop = _special_file("--config", "loop")
    case_data_fifo = _special_file("--data", "fifo")
    case_data_symlink_loop = _special_file("--data", "loop")
    case_data_device = _special_file("--data", "device")
    case_tokenizer_fifo = _special_file("--tokenizer", "fifo")

    def case_data_dir_with_a_fifo_txt(self):
        folder = self.work / "texts"
        folder.mkdir()
        (folder / "a.txt").write_text("hello " * 200)
        os.mkfifo(folder / "b.txt")
        return "input files", train("--data", folder, "--steps", 1), False, None

    def case_tokenizer_ids_beyond_entries(self):
        from tokenizers import Tokenizer, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel({**{chr(97 + i): i for i in range(10)}, "[UNK]": 100_000}, unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(self.work / "tok.json"))
        (self.work / "d.txt").write_text("a b c d e " * 100)
        run = train("--data", self.work / "d.txt", "--tokenizer", self.work / "tok.json", "--steps", 1)
        return "input files", run, False, None

    def _weights(self, change, layers: int = 2, config_layers: int | None = None) -> Path:
        from safetensors.torch import load_file, save_file

        from parallelisms.config import ModelConfig
        from parallelisms.hf import export_hf
        from parallelisms.model import build_model

        cfg = ModelConfig(n_layers=layers)
        folder = export_hf(build_model(cfg).state_dict(), cfg, self.work / "hf")
        weights = load_file(str(folder / "model.safetensors"))
        change(weights)
        save_file(weights, str(folder / "model.safetensors"))
        if config_layers is not None:
            config = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config_layers}))
        return folder

    def case_integer_weights(self):
        folder = self._weights(lambda w: w.update({"model.norm.weight": w["model.norm.weight"].long()}))
        return "input files", train("--init-from", folder, "--steps", 1), False, None

    def case_extra_tensor_in_weights(self):
        import torch
        folder = self._weights(lambda w: w.update({"model.extra.weight": torch.zeros(3)}))
        return "input files", train("--init-from", folder, "--steps", 1), False, None

    def case_fewer_layers_in_config_than_weights(self):
        folder = self._weights(lambda w: None, layers=3, config_layers=2)
        return "input files", train("--init-from", folder, "--steps", 1), False, None

    def case_missing_tensor_in_weights(self):
        folder = self._weights(lambda w: w.pop("model.norm.weight"))
        return "input files", train("--init-from", folder, "--steps", 1), False, None

    def case_trace_into_missing_directory(self):
        return "results", train("--dp", 1, "--steps", 2, "--trace", self.work / "gone" / "t.json"), False, None

    def case_metrics_into_a_file_path(self):
        (self.work / "file").write_text("x")
        return "results", train("--dp", 1, "--steps", 2, "--metrics", self.work / "file" / "m.jsonl"), False, None

    def case_export_onto_full_disk(self):
        disk = self._small_disk(64 * 1024)
        if disk is None:
            return None
        return "results", train("--dp", 1, "--steps", 2, "--export-hf", disk / "hf"), False, None


def listening(pid: int) -> list[str]:
    """The local addresses of TCP sockets in LISTEN held by ``pid`` and its descendants."""
    pids, todo = set(), [pid]
    while todo:
        p = todo.pop()
        pids.add(p)
        for task in Path(f"/proc/{p}/task").glob("*"):
            try:
                todo += [int(k) for k in (task / "children").read_text().split()]
            except OSError:
                pass
    inodes = set()
    for p in pids:
        for fd in Path(f"/proc/{p}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            cols = line.split()
            if cols[3] == "0A" and cols[9] in inodes:  # 0A: LISTEN
                host = cols[1].split(":")[0]
                out.append("127.0.0.1" if host == "0100007F" else "::1" if host == "0" * 24 + "01000000"
                           else host)
    return out


def classify(proc, timed_out: bool, expect_ok: bool, check) -> tuple[str, str]:
    text = (proc.stdout or "") + (proc.stderr or "") if proc else ""
    lines = [ln for ln in (proc.stderr or "").splitlines() if ln.strip()] if proc else []
    errors = [ln for ln in lines if ln.startswith("error:")]
    said = (errors or [ln for ln in lines if ln.startswith("warning:")] or lines or [""])[0][:150]
    if timed_out:
        return "hang", said
    if "Traceback" in text or "To enable traceback" in text:
        return "traceback", said
    found = check() if check else None
    if found:
        return found, said
    if expect_ok:
        return ("clean" if proc.returncode == 0 else "unclear"), said
    noise = [ln for ln in lines if not ln.startswith(("error:", "warning:", "note:"))]
    return ("clean" if proc.returncode != 0 and len(errors) == 1 and not noise else "unclear"), said


def shm_files() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("parallelisms-")} if os.path.isdir("/dev/shm") else set()


def orphaned(names: set[str]) -> set[str]:
    """The /dev/shm files of ``names`` that still exist and that no process maps or holds open (other runs on
    this machine make files of their own meanwhile)."""
    left = {n for n in names if os.path.exists(f"/dev/shm/{n}")}
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            held = (proc / "maps").read_text() + " ".join(os.readlink(fd) for fd in (proc / "fd").iterdir())
        except OSError:
            continue
        left = {n for n in left if n not in held}
    return left


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="run the cases whose name contains this")
    args = p.parse_args()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="parallelisms-adversarial-") as tmp:
        saved = Path(tmp) / "saved"
        subprocess.run(train("--dp", 2, "--steps", 2, "--save", saved, "--save-every", 1), check=True,
                       capture_output=True, env=env)
        names = [n for n in dir(Cases) if n.startswith("case_") and args.only in n]
        for n, name in enumerate(names):
            work = Path(tmp) / f"case{n}"
            work.mkdir()
            cases = Cases(work, saved)
            made = getattr(cases, name)()
            if made is None:
                rows.append((name[5:], "-", "not tried here", ""))
                continue
            kind, cmd, expect_ok, check = made
            before, began = shm_files(), time.monotonic()
            proc, timed_out = None, False
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=work)
            except subprocess.TimeoutExpired:
                timed_out = True
            try:
                outcome, said = classify(proc, timed_out, expect_ok, check)
            finally:
                if hasattr(cases, "cleanup"):
                    cases.cleanup()
            if outcome == "clean" and orphaned(shm_files() - before):
                outcome = "leftover"
            rows.append((name[5:], kind, outcome, f"{time.monotonic() - began:.1f}s {said}"))
            print(f"{kind:12} {name[5:]:42} {outcome:10} {rows[-1][3]}", flush=True)
    print()
    outcomes = ("clean", "traceback", "hang", "data lost", "leftover", "ran code", "unclear")
    print(f"| class | cases | {' | '.join(outcomes)} |")
    print(f"|---|---:|{'---:|' * len(outcomes)}")
    for kind in ("checkpoints", "results", "input files", "security"):
        counts = Counter(o for _, k, o, _ in rows if k == kind)
        print(f"| {kind} | {sum(counts.values())} | {' | '.join(str(counts[o]) for o in outcomes)} |")
    skipped = [name for name, k, _, _ in rows if k == "-"]
    if skipped:
        print(f"not tried here: {', '.join(skipped)}")


if __name__ == "__main__":
    main()
