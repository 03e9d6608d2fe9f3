"""The import graph between project files: no circles, nothing reaching upward, no private reach (issue 21 §6).

Layers, lowest first; a module may import only from its own layer or a lower one:

    architectures  <  datamodules  <  lightning_modules, callbacks  <  model_tools  <  analysis  <  experiments

``model_tools/`` acts on a built model (initial weights, checkpoint reading, memory plan, ``torch.compile``,
the training-step benchmark's contenders);
``analysis/`` reads finished runs (leaderboards, statistics, tables, contribution ratios, provenance);
``experiments/`` holds the command lines and the experiment programmes that use both.

``architectures/`` is plain PyTorch: it imports no Lightning (``lightning``, ``pytorch_lightning``,
``torchmetrics``) and no other project layer. Every import counts, including the ones inside functions
(a late import hides a circle from Python, not from the reader). A module may not import a name that starts
with an underscore from another module. The graph is read with ``ast`` (nothing is imported).
"""
from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set, Tuple

from tests.conftest import REPO

LAYERS = {"architectures": 0, "datamodules": 1, "lightning_modules": 2, "callbacks": 2, "model_tools": 3, "analysis": 4,
          "experiments": 5}
LIGHTNING = ("lightning", "pytorch_lightning", "torchmetrics")


def project_modules() -> Dict[str, pathlib.Path]:
    out = {}
    for package in LAYERS:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(path: pathlib.Path, module: str, modules: Dict[str, pathlib.Path]) -> List[Tuple[str, str, int]]:
    """(imported project module or external top-level name, imported name or "", line) for every import."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, "", node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = module.split(".") if is_package else module.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                # "from package import submodule" imports the submodule; "from module import name" the module
                found.append((target, "", node.lineno) if target in modules else (base, alias.name, node.lineno))
    return found


def project_target(name: str, modules: Dict[str, pathlib.Path]) -> str:
    """The project module an import resolves to ("" for an external package)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def graph() -> Tuple[Dict[str, Set[str]], List[str]]:
    modules = project_modules()
    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    problems = []
    for module, path in modules.items():
        layer = LAYERS[module.split(".")[0]]
        for name, imported, line in imports_of(path, module, modules):
            where = f"{path.relative_to(REPO)}:{line}"
            target = project_target(name, modules)
            if not target:
                if module.startswith("architectures") and name.split(".")[0] in LIGHTNING:
                    problems.append(f"{where}: architectures/ imports {name} (plain PyTorch only)")
                continue
            if LAYERS[target.split(".")[0]] > layer:
                problems.append(f"{where}: {module} reaches up to {target}")
            if imported.startswith("_") and not imported.startswith("__") and target != module:
                problems.append(f"{where}: {module} imports the private {target}.{imported}")
            if target != module:
                edges[module].add(target)
    return edges, problems


def cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    out: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return out


def test_the_project_import_graph_has_no_circles():
    edges, _ = graph()
    found = cycles(edges)
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_module_reaches_up_a_layer_or_into_another_module_s_private_names():
    _, problems = graph()
    assert not problems, "\n".join(problems)


def test_the_checker_sees_circles_upward_imports_and_private_names(tmp_path):
    """The test of the test: a planted circle, an upward import and a private import are each reported."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == [["a", "b", "c"]]
    modules = {"architectures.x": tmp_path / "x.py", "experiments.y": tmp_path / "y.py"}
    (tmp_path / "x.py").write_text("import lightning\nfrom experiments.y import _helper\n")
    found = imports_of(tmp_path / "x.py", "architectures.x", modules)
    assert ("lightning", "", 1) in found and ("experiments.y", "_helper", 2) in found
    assert project_target("experiments.y", modules) == "experiments.y"



# ---------------------------------------------------------------------------- sizes (issue 31)
#: no top-level package may hold more than this share of the project's lines: a package that grows past it
#: mixes things a newcomer should find apart
MAX_PACKAGE_SHARE = 0.30
#: no function or method (nested ones included) longer than this many lines, ``def`` to its last line
MAX_FUNCTION_LINES = 50


def package_lines() -> Dict[str, int]:
    """Lines (``.py`` files, every line counted) per top-level package of the project (``LAYERS``)."""
    return {package: sum(len(path.read_text().splitlines()) for path in (REPO / package).rglob("*.py"))
            for package in LAYERS}


def oversized_packages(lines: Dict[str, int], limit: float = MAX_PACKAGE_SHARE) -> List[str]:
    total = sum(lines.values())
    return [f"{package}: {count} of {total} lines ({count / total:.1%} > {limit:.0%})"
            for package, count in sorted(lines.items(), key=lambda item: -item[1]) if count > limit * total]


def long_functions(paths, limit: int = MAX_FUNCTION_LINES) -> List[Tuple[int, str]]:
    """(lines, "file:line name") of every function or method over ``limit`` lines, longest first."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    where = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                    found.append((length, f"{where}:{node.lineno} {node.name}"))
    return sorted(found, key=lambda item: (-item[0], item[1]))


def test_no_top_level_package_holds_more_than_30_percent_of_the_lines():
    lines = package_lines()
    found = oversized_packages(lines)
    shares = ", ".join(f"{package} {count}" for package, count in sorted(lines.items(), key=lambda item: -item[1]))
    assert not found, "; ".join(found) + f" (lines per package: {shares}; move reusable code to its own package)"


def test_no_function_is_longer_than_50_lines():
    found = long_functions(path for path in project_modules().values())
    assert not found, f"{len(found)} functions over {MAX_FUNCTION_LINES} lines, longest first:\n" + "\n".join(
        f"  {length} lines: {where}" for length, where in found[:20])


def test_the_size_checks_see_a_large_package_and_a_long_nested_function(tmp_path):
    """The test of the test: a package with 31% of the lines and a nested function of 51 lines are reported;
    a package at exactly 30% and a function at exactly the limit are not."""
    assert oversized_packages({"a": 31, "b": 23, "c": 23, "d": 23}) == ["a: 31 of 100 lines (31.0% > 30%)"]
    assert oversized_packages({"a": 30, "b": 30, "c": 20, "d": 20}) == []
    body = "\n".join(["def outer():", "    def inner():"] + ["        x = 1"] * 50 + ["    return inner"])
    (tmp_path / "m.py").write_text(body + "\n")
    found = long_functions([tmp_path / "m.py"])
    assert [length for length, _ in found] == [53, 51] and found[1][1].endswith(":2 inner")
    assert [length for length, _ in long_functions([tmp_path / "m.py"], limit=51)] == [53]  # 51 at a limit of 51: not over

# ---------------------------------------------------------------------------- families import no families (issue 31)
def family_modules() -> Set[str]:
    """The modules of the registry's model classes, vanilla's ``gpt2`` (the dense block library) aside: a
    variant file added to the registry is a family module as soon as it is registered."""
    from architectures.registry import VARIANTS

    modules = {variant.model_class().__module__ for variant in VARIANTS.values()}
    return modules - {"architectures.gpt2"}


def family_imports(edges: Dict[str, Set[str]], families: Set[str]) -> List[str]:
    """"a imports b" for every family module a that imports another family module b."""
    return [f"{module} imports {target}" for module in sorted(families & set(edges))
            for target in sorted(edges[module] & families) if target != module]


def test_no_family_module_imports_another_family_module():
    """Shared pieces live in the libraries (routing, dispatch, experts, moe_layer, gpt2, ...): a family that
    reuses another's layer or model class reaches it through a library module, so families change alone."""
    families = family_modules()
    assert {"architectures.moe", "architectures.mod", "architectures.mot"} <= families  # the list is read
    found = family_imports(graph()[0], families)
    assert not found, "family modules importing family modules (move the shared piece to a library): " + \
        "; ".join(found)


def test_the_family_check_sees_a_family_importing_a_family():
    """The test of the test: a planted family-to-family edge is reported, a family-to-library edge is not."""
    edges = {"architectures.a": {"architectures.b", "architectures.routing"}, "architectures.b": set()}
    assert family_imports(edges, {"architectures.a", "architectures.b"}) == ["architectures.a imports architectures.b"]
    assert family_imports(edges, {"architectures.a"}) == []


# ---------------------------------------------------------------------------- what an import loads (issue 29)
#: run in a fresh interpreter: which modules an import loads, and which module first imported torch._dynamo
#: (the innermost frame outside torch and importlib when ``torch._dynamo`` is first looked up)
_IMPORT_PROBE = r"""
import importlib.abc, json, sys, traceback

first_importer = []

class Watch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch._dynamo" and not first_importer:
            frames = [f.f_globals.get("__name__", "") for f, _ in traceback.walk_stack(sys._getframe())]
            outside = [m for m in frames if m.split(".")[0] not in ("torch", "importlib", "__main__")]
            first_importer.append(outside[0] if outside else "")
        return None

sys.meta_path.insert(0, Watch())
before = set(sys.modules)
for name in sys.argv[2:]:
    __import__(name)
baseline = set(sys.modules)
__import__(sys.argv[1])
print(json.dumps({"added": sorted(set(sys.modules) - baseline), "all": sorted(set(sys.modules) - before),
                  "dynamo_importer": first_importer[0] if first_importer else None}))
"""
OWN = tuple(LAYERS)


def modules_loaded(module: str, *baseline: str) -> dict:
    """In a subprocess: the modules ``import module`` loads (``all``), those beyond ``baseline``'s (``added``),
    and the module whose import first pulled in ``torch._dynamo`` (None: never)."""
    import json
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _IMPORT_PROBE, module, *baseline], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_architectures_load_neither_dynamo_nor_lightning_nor_transformers():
    """Plain PyTorch, lazily: ``torch._dynamo`` (~1-9 s) only under ``--compile``, never at import time."""
    loaded = set(modules_loaded("architectures")["all"])
    heavy = {"torch._dynamo", "lightning", "torchmetrics", "transformers", "tokenizers"} & loaded
    assert not heavy, f"importing architectures loads {sorted(heavy)}"


def test_experiments_run_adds_nothing_heavy_beyond_lightning():
    """``import experiments.run`` loads only the suite's own modules beyond what Lightning and jsonargparse
    load themselves, and ``torch._dynamo`` comes from Lightning (``lightning.fabric.wrappers``), not from a
    module of the suite."""
    found = modules_loaded("experiments.run", "lightning", "jsonargparse")
    foreign = [m for m in found["added"] if m.split(".")[0] not in OWN]
    assert not foreign, f"experiments.run imports {foreign} beyond lightning's own"
    importer = modules_loaded("experiments.run")["dynamo_importer"]  # the suite's own order of imports
    assert importer is None or importer.split(".")[0] not in OWN, f"{importer} imports torch._dynamo"


def test_experiments_run_loads_neither_lightning_nor_dynamo():
    """Its helpers (``model_config``, ``expand_aliases``: experiments.repro, experiments.memory) cost torch and the
    suite only; Lightning (and with it torch._dynamo, torchmetrics, transformers, scipy) comes with the parser."""
    loaded = set(modules_loaded("experiments.run")["all"])
    heavy = {"torch._dynamo", "lightning", "torchmetrics", "transformers", "scipy", "matplotlib"} & loaded
    assert not heavy, f"importing experiments.run loads {sorted(heavy)}"


def test_the_probe_names_the_module_that_imports_dynamo():
    """The test of the test: a suite module that imports torch._dynamo at import time is named."""
    assert modules_loaded("model_tools.compiling")["dynamo_importer"] is None  # it imports it inside a function
    found = modules_loaded("tests.dynamo_at_import")
    assert found["dynamo_importer"] == "tests.dynamo_at_import"
