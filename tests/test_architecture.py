"""The layout holds: every module imports cold on its own, imports form no cycle, dependencies point one
way in data-flow order, Ray and MLflow stay in one module each, one override engine, and the interface
modules document their public API."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "nmtcore"
# Data-flow order: a module may import its own layer and the layers before it, never one after it.
LAYERS = [
    ("nmtcore.files", "nmtcore.host", "nmtcore.devices", "nmtcore.allocator", "nmtcore.bleu", "nmtcore.checkpoint",
     "nmtcore.interrupts"),
    ("nmtcore.config",),
    ("nmtcore.data",),
    ("nmtcore.nn",),
    ("nmtcore.bert",),
    ("nmtcore.models",),
    ("nmtcore.engine.losses", "nmtcore.engine.optim", "nmtcore.engine.phases", "nmtcore.engine.warm_start",
     "nmtcore.engine.summary", "nmtcore.engine.graphs"),
    ("nmtcore.decoding",),
    ("nmtcore.engine",),
    ("nmtcore.diagnostics",),
    ("nmtcore.tracking",),
    ("nmtcore.sweep",),
    ("nmtcore.testing",),
    ("nmtcore.cli",),
]


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "__main__.py"}  # scripts run, not import


def imports_of(name: str) -> set[str]:
    """The nmtcore modules ``name`` imports (anywhere in the file, type-only imports included), each resolved
    to a module: ``from nmtcore.bert import made_here`` is nmtcore.bert.made_here, ``from nmtcore.data import
    Batch`` is the package nmtcore.data."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "nmtcore"}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "nmtcore":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                out.add(sub if sub in MODULES else node.module)
    return {m for m in out if m != name}


def layer_of(name: str) -> int:
    best = max((prefix for layer in LAYERS for prefix in layer if name == prefix or name.startswith(prefix + ".")),
               key=len)
    return next(i for i, layer in enumerate(LAYERS) if best in layer)


def test_every_module_is_in_a_layer():
    for name in MODULES:
        if name != "nmtcore":
            layer_of(name)  # raises StopIteration / ValueError for a module no layer names


def test_no_import_cycles():
    graph = {name: imports_of(name) for name in MODULES}
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
            if nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_dependencies_point_one_way_in_data_flow_order():
    backwards = []
    for name in MODULES:
        if name == "nmtcore":
            continue
        for dep in imports_of(name):
            if dep != "nmtcore" and layer_of(dep) > layer_of(name):
                backwards.append(f"{name} -> {dep}")
    assert not backwards, "imports against the data flow: " + ", ".join(backwards)


def test_the_package_never_needs_the_studies_or_the_tests():
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                roots = {a.name.split(".")[0] for a in node.names} if isinstance(node, ast.Import) else \
                    {(node.module or "").split(".")[0]}
                assert not roots & {"search_spaces", "tests", "sweeps"}, f"{name} imports {roots}"
                assert not (isinstance(node, ast.ImportFrom) and node.level), f"{name}: relative import"


def third_party_importers(package: str) -> set[str]:
    found = set()
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import) and any(a.name.split(".")[0] == package for a in node.names):
                found.add(name)
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == package:
                found.add(name)
    return found


def test_ray_and_mlflow_each_live_in_one_place():
    # Ray: one package (the cluster, the pre-sweep tasks, the search, the trial's Ray side, the callbacks, the
    # Tune run), as STYLE.md asks; Ray's private API in one module of it, so an upgrade knows what to check
    ray_users = third_party_importers("ray")
    assert ray_users and all(m.startswith("nmtcore.sweep.ray_backend.") for m in ray_users), sorted(ray_users)
    private = re.compile(r"\bray\._private\b|from ray\._private|\._internal\b|_local_tuner|_global_state_accessor")
    reaching = sorted(name for name, path in MODULES.items()
                      if private.search(path.read_text(encoding="utf-8")) and name != "nmtcore.sweep.ray_backend._private")
    assert not reaching, f"Ray's private API outside nmtcore.sweep.ray_backend._private: {reaching}"
    assert third_party_importers("mlflow") == {"nmtcore.tracking.store", "nmtcore.tracking.runs"}  # writer, readers
    # no module reaches another through importlib + getattr (dependencies stay visible as imports); finding
    # where a package is installed (importlib.util / importlib.metadata) is fine
    dynamic = {name for name, path in MODULES.items() if "import_module(" in path.read_text(encoding="utf-8")}
    assert dynamic == set(), sorted(dynamic)


def string_literals(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string constant in ``path``, an f-string by its literal head ("nmtcore.checksum.")."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            out.append((node.lineno, str(node.values[0].value)))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
    return out


def test_every_mlflow_tag_name_lives_in_the_schema_module():
    """A ``"nmtcore.<name>"`` literal is a tag name unless ``<name>`` is one of the package's modules (a logger's
    or a function's dotted path): tag names are written in nmtcore.tracking.schema only, so the writers and
    the readers (report, resume, UI views) share one spelling."""
    subpackages = {name.split(".")[1] for name in MODULES if name.count(".") >= 1}
    files = [p for p in MODULES.values() if p != PACKAGE / "tracking" / "schema.py"]
    files += sorted((REPO / "sweeps").glob("*.py")) + sorted((REPO / "bench").glob("*.py"))
    files += sorted((REPO / "search_spaces").glob("*.py"))
    stray = [f"{p.relative_to(REPO)}:{line}: {text[:60]!r}" for p in files for line, text in string_literals(p)
             if text.startswith("nmtcore.") and (text.split(".")[1].split() or [""])[0] not in subpackages]
    assert not stray, "tag names outside nmtcore/tracking/schema.py:\n" + "\n".join(stray)
    from nmtcore.tracking import schema

    names = [v for k, v in vars(schema).items() if k.isupper() and isinstance(v, str) and v.startswith("nmtcore.")]
    assert len(names) == len(set(names)) > 60  # one constant per tag, none spelled twice


def test_one_override_engine():
    """Overrides reach a config only through ExperimentConfig.with_overrides: outside the config package a
    config is built from a plain dict only where one is read back whole (a checkpoint's, a sweep's saved
    base) or written as a literal (the test helpers), never from a dict edited key by key."""
    allowed = {"nmtcore.decoding.translator": "the checkpoint's own config",
               "nmtcore.sweep.state": "the resumed sweep's saved base config",
               "nmtcore.testing.synthetic": "a literal tiny experiment", "nmtcore.testing.zoo": "a literal tiny model"}
    builders = set()
    for name, path in MODULES.items():
        if name.startswith("nmtcore.config"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("from_dict", "_build", "_coerce"):
                builders.add(name)
    assert builders <= set(allowed), sorted(builders - set(allowed))
    # and the old second engine is gone for good
    assert "def apply_overrides" not in "".join(p.read_text(encoding="utf-8") for p in MODULES.values())


def test_every_module_imports_cold_in_a_fresh_interpreter():
    """Each module first in an interpreter where no nmtcore module is loaded yet (third-party libraries
    loaded by earlier modules stay: they cannot hide an import-order bug of ours)."""
    script = (
        "import importlib, sys\n"
        f"names = {sorted(MODULES)!r}\n"
        "failed = []\n"
        "for name in names:\n"
        "    for loaded in [m for m in sys.modules if m == 'nmtcore' or m.startswith('nmtcore.')]:\n"
        "        del sys.modules[loaded]\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as e:\n"
        "        failed.append(f'{name}: {type(e).__name__}: {e}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n")
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]


@pytest.mark.slow
def test_every_module_imports_alone_in_its_own_interpreter():
    """Each module imported first and alone in a fresh interpreter (no third-party library preloaded either),
    as many interpreters at once as there are cores; every failure is named."""
    pending, running, failed = sorted(MODULES), {}, []
    while pending or running:
        while pending and len(running) < max(1, os.cpu_count() or 1):
            name = pending.pop(0)
            running[name] = subprocess.Popen([sys.executable, "-c", f"import {name}"], cwd=REPO, text=True,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        name = next(iter(running))
        proc = running.pop(name)
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            failed.append(f"{name}: {err[-1500:]}")
    assert not failed, "\n".join(failed)


INTERFACE_MODULES = ["nmtcore.models.base", "nmtcore.engine.trainer", "nmtcore.engine.experiment",
                     "nmtcore.engine.summary", "nmtcore.config.sections", "nmtcore.config.experiment",
                     "nmtcore.config.families", "nmtcore.sweep.plan", "nmtcore.sweep.space",
                     "nmtcore.sweep.settings", "nmtcore.sweep.lifecycle", "nmtcore.nn.cache"]


@pytest.mark.parametrize("name", INTERFACE_MODULES)
def test_interface_modules_document_their_public_api(name):
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), f"{name} has no module docstring"
    missing = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            if not ast.get_docstring(node):
                missing.append(node.name)
            if isinstance(node, ast.ClassDef):
                missing += [f"{node.name}.{f.name}" for f in node.body if isinstance(f, ast.FunctionDef)
                            and not f.name.startswith("_") and not ast.get_docstring(f)
                            and not any(isinstance(d, ast.Name) and d.id == "property" for d in f.decorator_list)]
    assert not missing, f"{name}: undocumented public {missing}"
