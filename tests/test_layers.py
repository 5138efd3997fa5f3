"""The package's shape: layers import downward only, no import cycles, no side effects on import.

Imports are read from the source (ast), at any depth (inside functions too), plus module names
given to importlib.import_module and the command tables that name modules to import later.
Layers, lowest first: base (jitkern, config, report: import nothing of jitkern's layers) <
codegen < ops < dlrm < bench < the top-level entry modules (__main__, info, tuning).
"""
import ast
import json
import os
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "jitkern"
BASE = {"jitkern", "jitkern.config", "jitkern.report"}
RANK = {"base": 0, "codegen": 1, "ops": 2, "dlrm": 3, "bench": 4, "entry": 5}


def _modules() -> dict:
    """module name -> source path, for every module under jitkern/."""
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _layer(name: str) -> str:
    if name in BASE:
        return "base"
    sub = name.split(".")[1]
    return sub if sub in ("codegen", "ops", "dlrm", "bench") else "entry"


def _package(name: str) -> str:
    return name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]


def _target(name: str):
    """The jitkern module an import of `name` loads (a name inside a module counts as that module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _from_targets(mod: str, node: ast.ImportFrom):
    base = node.module or ""
    if node.level:
        pkg = _package(mod).split(".")
        pkg = pkg[:len(pkg) - (node.level - 1)]
        base = ".".join(pkg + ([node.module] if node.module else []))
    for alias in node.names:
        yield _target(f"{base}.{alias.name}") if f"{base}.{alias.name}" in MODULES else _target(base)


def _named_later(mod: str, tree: ast.Module):
    """Modules a command table names for importlib: __main__'s COMMANDS, bench's BENCHES."""
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            var = node.targets[0].id
            if mod == "jitkern.__main__" and var == "COMMANDS":
                yield from (v[0] for v in ast.literal_eval(node.value).values())
            elif mod == "jitkern.bench" and var == "BENCHES":
                yield from (f"jitkern.bench.{b}" for b in ast.literal_eval(node.value))


def _imports(mod: str) -> set:
    tree = ast.parse(MODULES[mod].read_text())
    found = set(_named_later(mod, tree))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            found |= set(_from_targets(mod, node))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(node.args[0].value)
    return {t for t in map(_target, (f for f in found if f and f.split(".")[0] == "jitkern")) if t and t != mod}


GRAPH = {m: _imports(m) for m in MODULES}

# Cycles in code this branch does not own, to be removed there (ops/optim.py imports ops/embedding.py
# inside a function); test_known_cycles_are_still_there fails once one is gone, so the entry goes too.
KNOWN_CYCLES: list = []


def _cycles() -> list:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(GRAPH[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return cycles


def test_the_parser_sees_imports_in_functions_and_command_tables():
    assert "jitkern.dlrm.model" in GRAPH["jitkern.dlrm.calibration"]     # inside measure_dense
    assert "jitkern.dlrm.cli" in GRAPH["jitkern.__main__"]                # COMMANDS
    assert "jitkern.bench.dlrm" in GRAPH["jitkern.bench"]                 # BENCHES
    assert "jitkern.ops" in GRAPH["jitkern.dlrm.model"]                   # from .. import ops


def test_layers_import_downward_only():
    upward = sorted(f"{m} ({_layer(m)}) imports {t} ({_layer(t)})"
                    for m, targets in GRAPH.items() for t in targets if RANK[_layer(t)] > RANK[_layer(m)])
    assert not upward, "\n".join(upward)


def test_no_import_cycles():
    cycles = [c for c in _cycles() if c not in KNOWN_CYCLES]
    assert not cycles, "modules importing each other: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_known_cycles_are_still_there():
    assert all(c in _cycles() for c in KNOWN_CYCLES), "a known cycle is gone: remove it from KNOWN_CYCLES"


def test_the_cycle_finder_finds_cycles(monkeypatch):
    monkeypatch.setitem(GRAPH, "jitkern.dlrm.configs", GRAPH["jitkern.dlrm.configs"] | {"jitkern.dlrm.model"})
    assert ["jitkern.dlrm.configs", "jitkern.dlrm.model"] in _cycles()


def test_only_config_reads_jitkern_variables():
    readers = []
    for mod, path in MODULES.items():
        if mod == "jitkern.config":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith("JITKERN_") and node.value.replace("_", "").isalnum():
                readers.append(f"{mod}:{node.lineno} {node.value}")
    assert not readers, readers


def test_importing_any_module_leaves_the_environment_alone():
    mods = sorted(m for m in MODULES if not m.endswith("__main__"))
    code = ("import importlib, json, os, sys; before = dict(os.environ)\n"
            f"for m in {mods!r}: importlib.import_module(m)\n"
            "after = dict(os.environ)\n"
            "print(json.dumps(sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))))\n"
            "print('mpi4py' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "PMIX_", "GOMP_", "OMP_"))}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    changed, mpi = r.stdout.split("\n")[:2]
    assert json.loads(changed) == [], f"importing jitkern's modules changed {changed}"
    assert mpi == "False", "importing jitkern's modules imported mpi4py"
