"""The source's layers point down: no import cycle anywhere in src/ (every import, lazy ones included), and
the parallelisms never import the training loop, the verifier or the command line above them."""

import ast
import pathlib

import parallelisms
import pytest

pytestmark = pytest.mark.fast  # pure functions: no process starts (tests/conftest.py)

SRC = pathlib.Path(parallelisms.__file__).parent
ABOVE_THE_PARALLELISMS = ("parallelisms.training", "parallelisms.train_setup", "parallelisms.trainer",
                          "parallelisms.equivalence", "parallelisms.cli", "parallelisms.cli_args", "parallelisms.cli_configs",
                          "parallelisms.cli_results", "parallelisms.bench", "parallelisms.support")


def _imports() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source (functions included)."""
    modules = {}
    for path in SRC.rglob("*.py"):
        parts = ("parallelisms", *path.relative_to(SRC).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None
    graph = {}
    for name, path in modules.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[name] = {r for t in targets if (r := resolve(t)) and r != name and not name.startswith(r + ".")}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path of modules, or None (depth-first search with colours)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        stack.pop()
        return None
    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    graph = _imports()
    assert len(graph) > 40
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_lower_layers_do_not_import_higher_ones():
    graph = _imports()
    for name, targets in graph.items():
        if name.startswith(("parallelisms.parallel", "parallelisms.model", "parallelisms.comm", "parallelisms.data")):
            assert not targets & set(ABOVE_THE_PARALLELISMS), (name, targets & set(ABOVE_THE_PARALLELISMS))
    for bottom in ("parallelisms.errors", "parallelisms.config", "parallelisms.options", "parallelisms.mesh"):
        assert not {t for t in graph[bottom] if t.startswith(("parallelisms.parallel", "parallelisms.model"))}, bottom


# The step model prices a layout from its configs and the runtime's own plan objects, never from the running
# engines: it predicts layouts nothing runs, and each decision it reads is the one the runtime makes, not a copy.
STEP_MODEL = ("parallelisms.perf.compute", "parallelisms.perf.step", "parallelisms.perf.model",
              "parallelisms.perf.network", "parallelisms.perf.hardware", "parallelisms.perf.estimate",
              "parallelisms.perf.collectives", "parallelisms.perf.vtrain", "parallelisms.perf.stages",
              "parallelisms.perf.prefetch", "parallelisms.perf.overlap", "parallelisms.perf.cpu",
              "parallelisms.perf.volumes", "parallelisms.perf.context", "parallelisms.perf.memory",
              "parallelisms.perf.pipeline_walk", "parallelisms.perf.buckets")
CONFIGS = {"parallelisms.config", "parallelisms.errors", "parallelisms.options", "parallelisms.units"}
PLAN_OBJECTS = {
    "parallelisms.mesh": "each dimension's groups, sizes and strides (ParallelDims.span)",
    "parallelisms.parallel.registry": "each parallelism's descriptor: its volumes function",
    "parallelisms.comm.ledger": "the bytes a ring collective moves per rank",
    "parallelisms.parallel.cp_modes": "each context-parallel mode's traffic and groups",
    "parallelisms.parallel.memory": "ZeRO's model states per rank",
    "parallelisms.parallel.ep_placement": "the experts' placement before any measurement (slots, copies)",
    "parallelisms.parallel.row_split": "FSDP2's and the vocabulary's padded dim-0 rows",
    "parallelisms.parallel.shard_group": "the mesh dimension a sharding engine splits over",
    "parallelisms.parallel.wrap": "how gradients cut into buckets and wrapping units merge under --bucket-mb",
    "parallelisms.parallel.pipeline.schedules": "the schedule a layout runs, its microbatches, stage placement",
    "parallelisms.parallel.pipeline.simulate": "the schedule's timing",
    "parallelisms.parallel.pipeline.partition": "the pipeline's layer cut",
}


def _beyond_plan_objects(targets: set[str]) -> set[str]:
    return {t for t in targets
            if t not in CONFIGS and t not in PLAN_OBJECTS and not t.startswith("parallelisms.perf.")}


def test_the_step_model_imports_only_configs_and_plan_objects():
    graph = _imports()
    for name in STEP_MODEL:
        beyond = _beyond_plan_objects(graph[name])
        assert not beyond, (name, beyond)
        assert not {t for t in graph[name] if t.startswith(("parallelisms.perf.calibrate", "parallelisms.perf.predict"))}


# Every perf/ module, new ones included: the step model and the planner read configs and plan objects only (the
# planner also the support table, so it proposes only layouts the runtime runs, and the flag helpers its verb
# shares); the CPU adapter (calibrate, calibrate_comm, predict: they measure this machine by running the runtime)
# is the one part that imports the runtime, and nothing else in perf/ imports it.
CPU_ADAPTER = ("parallelisms.perf.calibrate", "parallelisms.perf.calibrate_comm", "parallelisms.perf.predict")
PERF_EXTRAS = {"parallelisms.perf.plan": {"parallelisms.support", "parallelisms.flags"},
               "parallelisms.perf.shapes": {"parallelisms.flags"}}


def test_perf_imports_the_runtime_only_in_its_cpu_adapter():
    graph = _imports()
    perf = [name for name in graph if name.startswith("parallelisms.perf.")]
    assert set(STEP_MODEL) <= set(perf)
    for name in perf:
        if name in CPU_ADAPTER:
            continue
        beyond = _beyond_plan_objects(graph[name]) - PERF_EXTRAS.get(name, set())
        assert not beyond, (name, beyond)
        assert not graph[name] & set(CPU_ADAPTER), name


def _load_time_imports(path: pathlib.Path) -> set[str]:
    """Every name a module imports when it loads: its imports outside function bodies and ``if TYPE_CHECKING:``."""
    names: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) or (
                    isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING")):
                continue
            if isinstance(child, ast.Import):
                names.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names.update({child.module} | {f"{child.module}.{a.name}" for a in child.names})
            visit(child)
    visit(ast.parse(path.read_text()))
    return names


def test_the_plan_objects_load_without_torch():
    """``estimate`` and ``plan`` import no torch (tests/test_cli_light.py): nothing the step model reads imports
    torch or numpy when it loads, nor do the packages above them or the package modules they load in turn."""
    paths = {}
    for path in SRC.rglob("*.py"):
        parts = ("parallelisms", *path.relative_to(SRC).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    todo = [*CONFIGS, *PLAN_OBJECTS, *STEP_MODEL]
    seen = set()
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        packages = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        imported = _load_time_imports(paths[name])
        heavy = {n for n in imported if n.split(".")[0] in ("torch", "numpy")}
        assert not heavy, (name, heavy)
        todo += [n for n in imported | set(packages) if n in paths]
    assert set(PLAN_OBJECTS) <= seen


# The CPU hardware adapter: perf/cpu.py holds the step model's mechanisms that exist only because ranks share CPU
# cores; compute and step select it by the hardware's kind (``hw.kind``), and no other module of the step model
# imports it or asks for a CPU's cores, so the GPU path reads without them. The calibrators measure this machine
# by running the runtime, never through the command line above it.
SELECTS_THE_CPU_ADAPTER = {"parallelisms.perf.compute", "parallelisms.perf.step"}
COMMAND_LINE = ("parallelisms.cli", "parallelisms.cli_args", "parallelisms.cli_configs", "parallelisms.cli_results",
                "parallelisms.bench")


def test_the_cpu_mechanisms_sit_behind_their_adapter():
    graph = _imports()
    assert {name for name, targets in graph.items() if "parallelisms.perf.cpu" in targets} == SELECTS_THE_CPU_ADAPTER
    assert not {t for t in graph["parallelisms.perf.cpu"] if t in SELECTS_THE_CPU_ADAPTER}
    for name in STEP_MODEL:
        if name not in ("parallelisms.perf.cpu", "parallelisms.perf.hardware"):
            source = (SRC / (name.removeprefix("parallelisms.").replace(".", "/") + ".py")).read_text()
            assert "hw.cores" not in source, name  # the kind selects; only the adapter and the hardware read cores
    for name in CPU_ADAPTER:
        assert not graph[name] & set(COMMAND_LINE), (name, graph[name] & set(COMMAND_LINE))


# Each parallelism's collectives per step are the function its descriptor names (``volumes``): comm_per_step reads
# them through the registry, so no module imports perf/volumes.py, every descriptor's names one of its functions,
# and every public function there is some descriptor's.
def test_perf_reads_each_parallelisms_volumes_through_the_registry():
    import importlib
    import inspect

    from parallelisms.parallel.registry import PARALLELISMS
    from parallelisms.perf import volumes

    graph = _imports()
    assert not {name for name, targets in graph.items() if "parallelisms.perf.volumes" in targets}
    named = {p.volumes for p in PARALLELISMS.values() if p.volumes}
    for spec in named:
        module, function = spec.split(":")
        assert module == "parallelisms.perf.volumes" and callable(getattr(importlib.import_module(module), function))
    public = {f"parallelisms.perf.volumes:{n}" for n, f in inspect.getmembers(volumes, inspect.isfunction)
              if f.__module__ == volumes.__name__ and not n.startswith("_")}
    assert public == named
