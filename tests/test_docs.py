"""Docs that cannot drift: every command in the README's and docs' code blocks runs (or is parsed, with the
reason it is not run), every relative link and every file a doc or docstring names exists, every CLI flag a
doc names exists, and the README and architecture pages stay within their lengths.

A command's trailing comment can carry a marker for this test:

    parallelisms train --steps 300        # ...  # docs-test: --steps 2       (run with these flags instead)
    torchrun --nproc-per-node 2 x.py      # docs-test: not run: REASON        (parsed only, never run)

``verify`` commands are validated as before launch, not run; ``verify-resume`` and ``bench`` are parsed (the
reasons are in VALIDATED_ONLY and PARSED_ONLY). docs/measurements-history.md records past runs with the flags
and files of their time: its links are checked, its commands and flags are not.
"""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from parallelisms.cli import build_configs, build_parser, main
from parallelisms.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "parallelisms"
README = ROOT / "README.md"
HISTORY = ROOT / "docs" / "measurements-history.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
CURRENT = [p for p in PAGES if p != HISTORY]
LIMITS = {README: 150, ROOT / "docs" / "architecture.md": 400}
CELL_LIMIT = 100  # characters in a cell of the README's tables

# Commands that cannot carry a marker (the set-up lines are quoted exactly), with the reason they are not run
NOT_RUN = {"bash scripts/install.sh && parallelisms train": "installs packages; the suite runs in what it installs",
           "bash scripts/install.sh test && python3 -m pytest -q": "installs packages and runs this very suite"}
# Verbs whose commands are checked without running them, and why (the suite stays fast)
VALIDATED_ONLY = {"verify": "trains the layout and its single-process references; here its layout is validated as "
                            "before launch, the equivalence itself runs in the parallelism tests"}
PARSED_ONLY = {"verify-resume": "two launches a layout; tests/test_checkpoint.py resumes across layouts",
               "bench": "benchmarks time for minutes and are not tests; scripts/bench_report.py runs every one"}
# Flags of other programs a doc may name
FOREIGN_FLAGS = {"--nproc-per-node", "--nnodes", "--max-restarts", "--standalone"}
# Files a docstring names that live in another project
FOREIGN_FILES = {"PERFORMANCE.md",  # nccl-tests' performance notes (perf/network.py)
                 "prepare.py"}  # nanoGPT's data preparation (data/sources.py)
PATH_ROOTS = ("src", "docs", "tests", "scripts", "examples", "benchmarks", "parallel", "perf", "comm", "model",
              "data", "benches")
PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w.-]+\.(?:py|md)|(?:%s)/[\w./-]*)" % "|".join(PATH_ROOTS))
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
MARKER = re.compile(r"#\s*docs-test:\s*(.*?)\s*$")


def code_blocks(path: Path) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```", path.read_text(), re.S | re.M)


def commands(path: Path) -> list[tuple[str, str | None]]:
    """(command line, marker) of every shell line in the page's code blocks, continuations joined."""
    found = []
    for lang, body in code_blocks(path):
        if lang not in ("", "bash", "sh", "shell"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if line.strip() and not line.lstrip().startswith("#"):
                marker = MARKER.search(line)
                found.append((line.strip(), marker.group(1) if marker else None))
    return found


def _argv(line: str) -> list[str]:
    return shlex.split(line, comments=True)


def _override(argv: list[str], marker: str) -> list[str]:
    """``argv`` with each flag of the marker replacing the same flag's values, or appended."""
    extra, groups = shlex.split(marker), []
    for token in extra:
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    out = list(argv)
    for flag, *values in groups:
        if flag in out:
            i = out.index(flag)
            end = i + 1
            while end < len(out) and not out[end].startswith("--"):
                end += 1
            out[i:end] = [flag, *values]
        else:
            out += [flag, *values]
    return out


def _parallelisms_argv(argv: list[str]) -> list[str] | None:
    """The arguments after ``parallelisms`` (or ``torchrun ... -m parallelisms``), else None."""
    if argv and argv[0] == "parallelisms":
        return argv[1:]
    if "-m" in argv and argv[argv.index("-m") + 1:argv.index("-m") + 2] == ["parallelisms"]:
        return argv[argv.index("-m") + 2:]
    return None


def _parse(argv: list[str]) -> str | None:
    """None when the command line parses, else argparse's message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            build_parser().parse_args(argv)
        except SystemExit as exc:
            return None if exc.code == 0 else err.getvalue().strip().splitlines()[-1]
    return None


def _script_flags(script: Path) -> set[str]:
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120).stdout
    return set(FLAG.findall(out))


def _check_command(line: str, marker: str | None) -> tuple[str | None, list[str] | None]:
    """(a problem, or None; the argv to run, or None when it is not run)."""
    argv = _argv(line)
    if line in NOT_RUN:
        return None, None
    if marker is not None and marker.startswith("not run"):
        if not marker.partition(":")[2].strip():
            return f"{line!r}: 'not run' needs a reason after a colon", None
    own = _parallelisms_argv(argv)
    if own is not None:
        problem = _parse(own)
        if problem:
            return f"{line!r}: {problem}", None
        if argv[0] != "parallelisms" or (marker or "").startswith("not run"):
            return (None if marker else f"{line!r}: unmarked; add '# docs-test: not run: REASON'"), None
        return None, _override(own, marker) if marker else own
    scripts = [a for a in argv if a.startswith("scripts/") and a.endswith(".py")]
    if scripts:
        unknown = {f for f in argv if f.startswith("--")} - _script_flags(ROOT / scripts[0])
        if unknown:
            return f"{line!r}: {scripts[0]} has no {sorted(unknown)}", None
    if not (marker or "").startswith("not run"):
        return f"{line!r}: not a parallelisms command; mark it '# docs-test: not run: REASON'", None
    return None, None


@pytest.mark.parametrize("page", CURRENT, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_in_code_blocks_run(page, tmp_path, monkeypatch):
    """Each page's commands in order, in one directory (a later command reads what an earlier one wrote);
    ``verify`` validated, ``verify-resume`` and ``bench`` parsed (VALIDATED_ONLY, PARSED_ONLY)."""
    monkeypatch.chdir(tmp_path)
    for toml in re.findall(r"^```toml\n(.*?)^```", page.read_text(), flags=re.S | re.M):
        (tmp_path / "run.toml").write_text(toml)  # the page's example run file, read by its --config-file lines
    problems = []
    for line, marker in commands(page):
        problem, argv = _check_command(line, marker)
        if problem or argv is None:
            problems += [problem] if problem else []
            continue
        if argv[0] in PARSED_ONLY:
            continue
        if argv[0] in VALIDATED_ONLY:
            try:
                build_configs(build_parser().parse_args(argv))
            except ConfigError as exc:
                problems.append(f"{' '.join(argv)}: {exc}")
            continue
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(argv)
        if code != 0:
            problems.append(f"{' '.join(argv)}: exit {code}: {err.getvalue().strip()[-300:]}")
        elif "--json" in argv:
            json.loads(out.getvalue().strip().splitlines()[-1])
    assert not problems, "\n".join(problems)


def _links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", text) if not re.match(r"[a-z]+:", t)]


def _exists(name: str, base: Path) -> bool:
    name = name.rstrip("/")
    return any((d / name).exists() for d in (base, ROOT, SRC, SRC / "parallel")) or any(
        str(p).endswith("/" + name) for p in _repo_files())


_FILES: list[Path] = []


def _repo_files() -> list[Path]:
    if not _FILES:
        _FILES.extend(p for p in ROOT.rglob("*") if ".git" not in p.parts and "__pycache__" not in p.parts)
    return _FILES


def test_links_and_named_files_exist():
    missing = []
    for page in PAGES:
        rel = page.relative_to(ROOT)
        missing += [f"{rel}: link {t}" for t in _links(page) if not (page.parent / t.split("#")[0]).exists()]
        if page == HISTORY:
            continue
        for code in re.findall(r"`([^`\n]+)`", page.read_text()):
            missing += [f"{rel}: `{code}` names {name}" for name in PATH.findall(code)
                        if name not in FOREIGN_FILES and not _exists(name, page.parent)]
    for source in sorted(SRC.rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node) or ""
                missing += [f"{source.relative_to(ROOT)} docstring names {name}" for name in PATH.findall(doc)
                            if name not in FOREIGN_FILES and not _exists(name, source.parent)]
    assert not missing, "\n".join(missing)


def _known_flags() -> set[str]:
    flags = set(FOREIGN_FLAGS)
    stack = [build_parser()]
    while stack:
        parser = stack.pop()
        for action in parser._actions:
            flags |= {s for s in action.option_strings if s.startswith("--")}
            if hasattr(action, "choices") and isinstance(action.choices, dict):
                stack += [p for p in action.choices.values() if hasattr(p, "_actions")]
    for page in CURRENT:
        for name in set(re.findall(r"scripts/[\w-]+\.py", page.read_text())):
            flags |= _script_flags(ROOT / name)
    return flags


def test_every_flag_named_exists():
    known, unknown = _known_flags(), []
    for page in CURRENT:
        unknown += [f"{page.relative_to(ROOT)}: {f}" for f in sorted(set(FLAG.findall(page.read_text())) - known)]
    assert not unknown, "\n".join(unknown)


def test_lengths():
    for page, limit in LIMITS.items():
        lines = len(page.read_text().splitlines())
        assert lines <= limit, f"{page.name}: {lines} lines, at most {limit}"
    cells = [c.strip() for line in README.read_text().splitlines() if line.startswith("|") for c in line.split(" | ")]
    long = [c for c in cells if len(c.strip("| ")) > CELL_LIMIT]
    assert not long, f"README table cells over {CELL_LIMIT} characters: {long}"
