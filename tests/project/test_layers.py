"""The package's import graph follows the data flow: each fxpar module imports only from its own
layer or lower ones (module-level *and* function-level imports), there are no import cycles,
and a function-level import of fxpar's own code says why it is lazy.

Layers, lowest first (``docs/layout.md`` draws them):

    errors, compat → workload, plan → cluster → tracing → profiling → sim → solvers
      → runtime → checkpoint → codegen → planning, models, scenario, api_checks, build
      → adapt, api (api imports adapt, never the other way)
      → integrations, profile_cmd, demo → cli, the package itself

Inside a layer, sub-layers (``SUBLAYERS``): codegen's sub-packages in the order its
``__init__`` gives (common → tensor → the old hand-plan aliases → stages → emit), the
tracer over its tensor-parallel analysis, the planner over the solvers it composes, each
parallel form's folder over the forms' registry, and the hand-written plans each form's folder
offers gathered above them (``fxpar.forms.hand_plans``).  Two parts of one sub-layer above the base never
import each other (the forms are independent).  A form's phase module, and each module of its
folder that serves a phase (``<phase>_<what>``), sits at its phase's layer (``FORM_PHASES``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.project.sizes import FUNCTION_GUIDE, MODULE_GUIDE, idea, report

PACKAGE = Path(__file__).resolve().parents[2] / "fxpar"

#: module prefix -> layer (the longest matching prefix wins)
LAYERS: dict[str, int] = {
    "fxpar.errors": 0, "fxpar.compat": 0, "fxpar.renamed": 0,
    "fxpar.workload": 1, "fxpar.forms": 1, "fxpar.forms.hand_plans": 9, "fxpar.dtype_policy": 1, "fxpar.plan_checks": 1, "fxpar.plan_table": 1, "fxpar.plan": 1, "fxpar.rank_layout": 1,
    "fxpar.tensor_layers": 1, "fxpar.stage_specs": 1, "fxpar.plan_upgrade": 1,
    "fxpar.cluster": 2,
    "fxpar.tracing": 3,
    "fxpar.profiling": 4,
    "fxpar.sim": 5,
    "fxpar.solvers": 6,
    "fxpar.runtime": 7,
    "fxpar.checkpoint": 8,
    "fxpar.codegen": 9,
    "fxpar.planning": 10, "fxpar.models": 10, "fxpar.scenario": 10, "fxpar.synthetic": 10,
    "fxpar.api_checks": 10, "fxpar.predict": 10, "fxpar.cpu_rate": 10, "fxpar.calibrate": 10, "fxpar.build": 10,
    "fxpar.adapt": 11, "fxpar.api": 11, "fxpar.options": 11,
    "fxpar.integrations": 12, "fxpar.profile_cmd": 12, "fxpar.demo": 12, "fxpar.demo_report": 12,
    "fxpar.demo_emulation": 12,
    "fxpar.cli": 13, "fxpar.__main__": 13, "fxpar": 13,
}
#: package -> {its child module or sub-package: sub-layer}; children not named are the base (0)
SUBLAYERS: dict[str, dict[str, int]] = {
    "fxpar.codegen": {"common": 0, "tensor": 1, "hand_plans": 2, "sharded_plans": 2,
                      "stages": 3, "emit": 4},
    "fxpar.tracing": {"tensor_parallel": 1, "trace": 2, "hf": 2, "analyze_model": 3},
    "fxpar.solvers": {"choose": 1, "planner": 2},
    # each form's folder above the registry; two forms never import each other
    "fxpar.forms": {"data": 1, "pipeline": 1, "expert": 1, "sharded": 1, "tensor": 1, "hand_plans": 2},
}
#: a parallel form's phase module (``fxpar.forms.<folder>.<phase>``, and each module of its folder
#: that serves the phase, ``<phase>_<what>``) -> its layer: a form's rules of a plan are plain
#: data, its pricing sits with the simulator, its bound and search with the solvers, its
#: application with codegen, its prediction's parts with fxpar.predict, its arms of the runtime
#: probe with fxpar.calibrate
FORM_PHASES: dict[str, int] = {"spec": 1, "price": 5, "bound": 6, "search": 6, "apply": 9, "predict": 10,
                               "calibrate": 10}
LAZY_MARK = "# lazy:"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 4 and parts[1] == "forms" and parts[3].split("_")[0] in FORM_PHASES:
        return FORM_PHASES[parts[3].split("_")[0]]
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len, default=None)
    if best is None:
        raise AssertionError(f"{module} has no layer: add it to LAYERS in tests/project/test_layers.py")
    return LAYERS[best]


def sublayer_of(module: str) -> tuple[str, str, int] | None:
    """``(package, child, sub-layer)`` of a module inside a package of ``SUBLAYERS``."""
    for package, order in SUBLAYERS.items():
        if module.startswith(package + "."):
            child = module[len(package) + 1:].split(".")[0]
            return package, child, order.get(child, 0)
    return None


def sideways_error(module: str, target: str) -> str | None:
    """Why ``module`` may not import ``target`` under ``SUBLAYERS`` (None: it may)."""
    mine, theirs = sublayer_of(module), sublayer_of(target)
    if mine is None or theirs is None or mine[0] != theirs[0] or mine[1] == theirs[1]:
        return None
    if theirs[2] > mine[2]:
        return f"{mine[0]}.{theirs[1]} (sub-layer {theirs[2]}) is above {mine[0]}.{mine[1]} (sub-layer {mine[2]})"
    if theirs[2] == mine[2] > 0:
        return f"{mine[0]}.{mine[1]} and {mine[0]}.{theirs[1]} are parts of sub-layer {mine[2]}, which never import each other"
    return None


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """``(imported fxpar module, line, inside a function)`` for every import in ``path``."""
    tree = ast.parse(path.read_text())
    in_function: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
    out = []
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from fxpar.solvers import plan` may name a submodule: count the submodule if it is one
            names = [f"{base}.{a.name}" if (PACKAGE.parent / f"{base}.{a.name}".replace(".", "/")).with_suffix(".py").exists()
                     or (PACKAGE.parent / f"{base}.{a.name}".replace(".", "/")).is_dir() else base
                     for a in node.names]
        for name in names:
            if name == "fxpar" or name.startswith("fxpar."):
                out.append((name, node.lineno, id(node) in in_function))
    return out


def _all_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_import_goes_down_the_layers() -> None:
    wrong = []
    for module, path in _all_modules().items():
        mine = layer_of(module)
        for target, line, _ in _imports(path):
            if layer_of(target) > mine:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} (layer {mine}) imports "
                             f"{target} (layer {layer_of(target)})")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_every_import_goes_down_the_sublayers() -> None:
    wrong = []
    for module, path in _all_modules().items():
        for target, line, _ in _imports(path):
            why = sideways_error(module, target)
            if why:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {module} imports {target}: {why}")
    assert not wrong, "imports against the sub-layer order:\n" + "\n".join(wrong)


@pytest.mark.parametrize("module,target", [
    ("fxpar.codegen.common.shards", "fxpar.codegen.tensor.shard"),
    ("fxpar.codegen.tensor.module", "fxpar.codegen.stages.split"),
    ("fxpar.forms.expert.apply_module", "fxpar.forms.sharded.apply_units"),
    ("fxpar.codegen.tensor.module", "fxpar.codegen.emit"),
    ("fxpar.tracing.tensor_parallel.analysis", "fxpar.tracing.trace"),
    ("fxpar.solvers.choose", "fxpar.solvers.planner"),
    ("fxpar.forms.data.search", "fxpar.forms.sharded.search_lp"),
])
def test_the_sublayer_check_catches_an_import_against_the_order(module: str, target: str) -> None:
    assert sideways_error(module, target)
    assert sideways_error(target, module) is None or sublayer_of(target)[2] == sublayer_of(module)[2]


def test_every_codegen_part_has_a_sublayer() -> None:
    children = {p.stem if p.suffix else p.name for p in (PACKAGE / "codegen").iterdir()
                if (p.suffix == ".py" and p.stem != "__init__") or (p / "__init__.py").exists()}
    assert children == set(SUBLAYERS["fxpar.codegen"]), "name each codegen part's sub-layer in SUBLAYERS"


def test_no_import_cycles() -> None:
    modules = _all_modules()
    graph = {m: {t for t, _, _ in _imports(p) if t in modules and t != m} for m, p in modules.items()}
    # a package's __init__ importing its own submodules is how packages work, not a cycle
    for m in graph:
        graph[m] = {t for t in graph[m] if not (modules[m].name == "__init__.py" and t.startswith(m + "."))}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_function_level_imports_say_why() -> None:
    unexplained = []
    for module, path in _all_modules().items():
        lines = path.read_text().splitlines()
        for target, line, inside in _imports(path):
            context = " ".join(lines[max(0, line - 2): line])
            if inside and LAZY_MARK not in context:
                unexplained.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {target}")
    assert not unexplained, ("function-level imports of fxpar modules without a `# lazy: <reason>` "
                             "comment (hoist them, or say why they must be lazy):\n" + "\n".join(unexplained))


@pytest.mark.parametrize("module,target", [("fxpar.sim.simulate", "fxpar.solvers.planner"),
                                           ("fxpar.tracing.trace", "fxpar.codegen.tensor.families")])
def test_the_layer_check_catches_an_upward_import(module: str, target: str) -> None:
    assert layer_of(target) > layer_of(module)


def test_the_layout_page_names_every_package() -> None:
    """The code layout page (``docs/layout.md``) names every package of fxpar (as ``fxpar/x`` or,
    inside its parent's entry, ``name/``), so a new or moved package cannot leave it stale."""
    layout = (PACKAGE.parent / "docs" / "layout.md").read_text()
    packages = sorted(p.parent.relative_to(PACKAGE.parent) for p in PACKAGE.rglob("__init__.py"))
    missing = [str(p) for p in packages if p.parts[1:] and f"`{p.as_posix()}`" not in layout
               and f"`{p.name}/`" not in layout]
    assert not missing, f"docs/layout.md does not name these packages: {missing}"


def test_every_module_states_its_idea() -> None:
    """Sizes are a report, not a cap (:mod:`tests.project.sizes`, printed at the end of the
    session): what is required is that every module says in its docstring the one idea it holds,
    the sentence the report shows beside a long module."""
    silent = [str(path.relative_to(PACKAGE.parent)) for path in _all_modules().values()
              if not idea(ast.parse(path.read_text()))]
    assert not silent, f"give these modules a docstring whose first sentence says what they hold: {silent}"


def test_the_size_report_lists_what_passes_its_guides(tmp_path: Path) -> None:
    """The report lists a module past :data:`~tests.project.sizes.MODULE_GUIDE` lines and a
    function past :data:`~tests.project.sizes.FUNCTION_GUIDE` with their ideas, and nothing else."""
    body = "\n".join(f"    x = {i}" for i in range(FUNCTION_GUIDE))
    (tmp_path / "long.py").write_text(f'"""One idea. More."""\n\n\ndef f():\n    """Does f."""\n{body}\n'
                                      + "\n" * MODULE_GUIDE)
    (tmp_path / "short.py").write_text('"""Short."""\n')
    modules, functions = report(tmp_path)
    assert [(e.where, e.idea) for e in modules] == [(f"{tmp_path.name}/long.py", "One idea")]
    assert [(e.where, e.lines, e.idea) for e in functions] == [(f"{tmp_path.name}/long.py:4 f", FUNCTION_GUIDE + 2,
                                                                 "Does f")]


#: the modules that may call ``new_group``: the plan's groups, the runtime's wrapper (the job's
#: timeout; a gloo twin of a device group for host tensors), and adapting's job-wide gloo group
#: (its health checks, which outlive every plan)
GROUP_MAKERS = {"fxpar.runtime.plan_groups", "fxpar.runtime.distributed", "fxpar.adapt.elastic"}


def test_a_plans_process_groups_are_made_in_one_place() -> None:
    """Every process group a plan runs on is made by
    :class:`fxpar.runtime.plan_groups.PlanGroups` (#38 item 4): no other fxpar module calls
    ``new_group`` (torch's or fxpar's wrapper)."""
    calls = []
    for module, path in _all_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name == "new_group" and module not in GROUP_MAKERS:
                    calls.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert not calls, "process groups made outside PlanGroups:\n" + "\n".join(calls)


#: where a rank's layout and its plan's groups are made for a running module: the module's
#: ``layout`` (once per plan) and ``groups`` (once per build, on first use), both in
#: ``ParallelModuleBase``; ``fxpar plan --explain``, the
#: pipeline simulator and the forms' emit phases read a plan's layout without a module
LAYOUT_MAKERS = {"RankLayout": {"fxpar.runtime.contract", "fxpar.cli", "fxpar.sim.pipeline_plan",
                                "fxpar.forms.sharded.apply", "fxpar.forms.tensor.apply", "fxpar.forms.expert.apply"},
                 "PlanGroups": {"fxpar.runtime.contract"}}


def test_a_running_module_has_one_layout_and_one_set_of_groups() -> None:
    """One object answers where each rank sits (#38 item 4): a form's pass reads the module's
    ``layout`` and makes its groups through the module's ``groups``, never building its own."""
    calls = []
    for module, path in _all_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in LAYOUT_MAKERS \
                    and module not in LAYOUT_MAKERS[node.func.id]:
                calls.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.func.id}")
    assert not calls, "a layout or groups made outside the module's own:\n" + "\n".join(calls)
