"""The package's shape: each pipeline phase in its own folder, no import cycle, the library never
importing its drivers, codegen never importing relax_passes, setup.py listing every package."""
import ast
import re
from pathlib import Path

import pytest
import tvm

from tvm_evt import pipeline

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"tvm_evt": ROOT / "python" / "tvm_evt", "tvm_evt.relax_passes": ROOT / "relax_passes",
                "tvm_evt.codegen": ROOT / "codegen"}
# the bench, tuning and inspection drivers: they use the library, and the library never uses them
DRIVERS = {"tvm_evt.bench_e2e", "tvm_evt.bench_memory", "tvm_evt.bench_dp", "tvm_evt.bench_tir", "tvm_evt.tuning", "tvm_evt.cli", "tvm_evt.fingerprint"}
PASS_NAME = re.compile(r"@tvm\.transform\.module_pass\([^)]*name=\"(\w+)\"")


def _modules() -> dict[str, Path]:
    """{dotted name: file} of every module of the installed package, as setup.py maps it."""
    found = {}
    for prefix, root in PACKAGE_DIRS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if prefix == "tvm_evt" and parts and parts[0] in ("relax_passes", "codegen"):
                continue
            found[".".join([prefix, *parts])] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The tvm_evt modules `name` imports, at module level or inside functions."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                full = f"{target}.{alias.name}"
                out.add(full if full in MODULES else target)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return {m for m in out if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def test_no_import_cycle_in_the_python_package():
    top = {n: {m for m in deps if m.count(".") == 1} for n, deps in GRAPH.items() if n.count(".") == 1}
    state: dict[str, int] = {}

    def visit(n, stack):
        state[n] = 1
        for m in sorted(top.get(n, ())):
            if state.get(m) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m, stack + [m])
        state[n] = 2

    for n in sorted(top):
        if n not in state:
            visit(n, [n])


def test_the_library_never_imports_a_driver():
    bad = {n: sorted(deps & DRIVERS) for n, deps in GRAPH.items() if n not in DRIVERS and deps & DRIVERS}
    assert not bad, f"library modules importing drivers: {bad}"


def test_codegen_never_imports_relax_passes():
    bad = {n: sorted(d for d in deps if d.startswith("tvm_evt.relax_passes"))
           for n, deps in GRAPH.items() if n.startswith("tvm_evt.codegen")}
    assert not {n: d for n, d in bad.items() if d}


def test_setup_lists_every_package():
    listed = set(re.findall(r'"(tvm_evt[\w.]*)"', (ROOT / "setup.py").read_text()))
    packages = {n for n, p in MODULES.items() if p.name == "__init__.py"}
    assert packages <= listed, f"not in setup.py's packages: {sorted(packages - listed)}"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("tvm_evt.relax_passes")))
def test_every_pass_module_opens_with_what_it_does(name):
    doc = ast.get_docstring(ast.parse(MODULES[name].read_text()))
    assert doc and len(doc.split()) >= 5, f"{name} has no docstring saying what it does"


def _defined_passes(package: str) -> dict[str, str]:
    """{pass name: module} of the module passes defined under tvm_evt.`package`."""
    prefix = f"tvm_evt.{package}"
    return {found: name for name, path in MODULES.items() if name == prefix or name.startswith(prefix + ".")
            for found in PASS_NAME.findall(path.read_text().replace("\n", " "))}


@pytest.mark.parametrize("phase", [p for p in pipeline.PHASES if p.passes], ids=lambda p: p.name)
def test_each_phase_lives_in_its_folder(phase):
    defined = _defined_passes(phase.package)
    missing = [name for name in phase.passes if name not in defined]
    assert not missing, f"phase {phase.name}: {missing} not defined under {phase.package}"


def test_phases_name_every_pass_of_ours():
    """Each pass of ours that the training build or ``phases(target)`` runs is in PHASES, and each
    pass defined under relax_passes belongs to exactly one phase."""
    ours = _defined_passes("relax_passes")
    listed = [name for p in pipeline.PHASES for name in p.passes]
    assert len(listed) == len(set(listed))
    assert sorted(ours) == sorted(listed)
    for target in (tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}), tvm.target.Target("llvm")):
        names = [p.info.name for p in pipeline.phases(target)]
        assert set(names) & set(ours)
        for name in names:
            assert name not in ours or name in listed
