"""The parallel module's declared contract (:mod:`fxpar.runtime.contract`, issue #38 item 2).

The one module type that runs every plan (:class:`~fxpar.codegen.common.module.RankModule`, each
form applied to it as a pass), and the adaptive module that runs it, have every member of
:class:`~fxpar.runtime.contract.ParallelModule`; fxpar's own code reads those members directly,
never probing for them with ``hasattr`` / ``getattr(..., default)``.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

import pytest
import torch

from fxpar.adapt.module import AdaptiveModule
from fxpar.codegen.common.module import RankModule
from fxpar.forms import NAMES, part
from fxpar.runtime.contract import ParallelModule, ParallelModuleBase
from fxpar.runtime.form_pass import FormPass
from fxpar.runtime.step_loop import StepModule

PACKAGE = Path(__file__).resolve().parents[2] / "fxpar"
MEMBERS = frozenset(set(ParallelModule.__annotations__)
                    | {n for n, v in vars(ParallelModule).items()
                       if not n.startswith("_") and (callable(v) or isinstance(v, property))})

#: probes of a member's name that target something other than a parallel module, and why
NOT_ON_A_PARALLEL_MODULE = {
    ("checkpoint/hf_save.py", "save_pretrained"): "the user's HF config",
    ("checkpoint/hf.py", "save_pretrained"): "the user's HF model",
    ("checkpoint/weights.py", "save_pretrained"): "the user's HF model",
    ("tracing/hf.py", "save_pretrained"): "the user's HF model",
    ("checkpoint/layout.py", "checkpoint_layout"): "a user's own (non-fxpar) module describing its shards",
}


def _built_classes() -> list[type]:
    return [RankModule]


def _passes() -> list[type]:
    """Every form's passes (each form's apply phase imported: they define them)."""
    for name in NAMES:
        part(name, "apply")
    found, todo = [], list(FormPass.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return sorted(found, key=lambda c: c.__name__)


def _assigned_on_self(cls: type) -> set[str]:
    """Names a class (or a base) assigns as ``self.<name> = ...`` anywhere in its methods."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass in (torch.nn.Module, object) or not klass.__module__.startswith("fxpar"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        names.add(t.attr)
    return names


def test_the_contract_lists_what_fxpar_reads() -> None:
    """The members checkpoints, adapting, the monitor and the integrations read."""
    assert {"plan", "rank", "group", "dp_group", "clock", "emulator", "loss_scaler", "last_timing", "pricing",
            "owned", "adaptive", "device", "parallel_module", "original_model", "batch_rows", "shard_batch",
            "step", "refusal", "set_plan", "clip_grad_norm_", "gather_state_dict", "save_pretrained",
            "checkpoint_layout", "make_optimizer", "track", "compile_regions"} <= MEMBERS


def test_the_one_module_type_has_every_member() -> None:
    missing = sorted(m for m in MEMBERS if not hasattr(RankModule, m) and m not in _assigned_on_self(RankModule))
    assert not missing, f"RankModule lacks {missing} of fxpar.runtime.contract.ParallelModule"


def test_one_module_type_runs_every_plan_and_each_form_is_a_pass() -> None:
    """Issue #38 item 2: one module type; a form is a :class:`FormPass` (not a module) that its
    apply phase names; nothing else derives from the step loop's module."""
    passes = _passes()
    assert {"DataParallel", "ShardedDataParallel", "TensorParallel", "ExpertParallel", "Pipeline",
            "InterleavedPipeline"} <= {c.__name__ for c in passes}
    assert not [c for c in passes if issubclass(c, torch.nn.Module)]
    assert not [c.__name__ for c in passes if inspect.isabstract(c)], "a form's pass lacks checkpoint_layout"
    modules, todo = [], [StepModule]
    while todo:
        cls = todo.pop()
        modules.extend(cls.__subclasses__())
        todo.extend(cls.__subclasses__())
    ours = [c for c in modules if c.__module__.startswith("fxpar")]
    assert ours == [RankModule], f"module types beside RankModule: {ours}"
    for name in NAMES:
        assert "form_pass" in vars(part(name, "apply")), name


def test_the_adaptive_module_is_one_and_answers_for_its_plans_module() -> None:
    """It defines what is its own and hands every other member to the current module."""
    own = {m for m in MEMBERS if hasattr(AdaptiveModule, m) or m in _assigned_on_self(AdaptiveModule)}
    assert {"adaptive", "plan", "parallel_module", "track", "step", "rank", "device"} <= own
    assert AdaptiveModule.adaptive and "__getattr__" in vars(AdaptiveModule)


def test_a_one_rank_module_is_a_parallel_module_and_a_plain_one_is_not() -> None:
    from tests.graph.test_step_loop import _plan   # a one-rank data-parallel plan

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    plan = _plan([4], 2)
    pmodel = RankModule(model, plan, 0, example_inputs=torch.zeros(4, 4), device=torch.device("cpu"),
                        loss_weighting="samples", emulate=False)
    assert type(pmodel.form).__name__ == "DataParallel"
    assert isinstance(pmodel, ParallelModule) and not isinstance(model, ParallelModule)
    assert pmodel.parallel_module is pmodel and pmodel.original_model is model and not pmodel.adaptive
    optimizer = torch.optim.SGD(pmodel.parameters(), lr=0.1)
    assert pmodel.track(optimizer) is optimizer
    assert [lp.fqn for lp in pmodel.checkpoint_layout()] == [n for n, _ in model.named_parameters()]


def test_the_module_holds_its_plans_one_layout_and_groups_which_its_pass_reads() -> None:
    """#38 item 4: the module answers where each rank sits (``layout``, once per plan: a plan
    taken in place gets its own) and holds the plan's groups (``groups``); the pass reads both
    off the module."""
    import dataclasses

    from fxpar.rank_layout import RankLayout
    from fxpar.runtime.plan_groups import PlanGroups
    from tests.graph.test_step_loop import _plan   # a one-rank data-parallel plan

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    pmodel = RankModule(model, _plan([4], 2), 0, example_inputs=torch.zeros(4, 4), device=torch.device("cpu"),
                        loss_weighting="samples", emulate=False)
    first = pmodel.layout
    assert isinstance(first, RankLayout) and pmodel.layout is first and pmodel.form.layout is first
    assert isinstance(pmodel.groups, PlanGroups) and pmodel.form.groups is pmodel.groups
    assert pmodel.groups.layout is first and first.where(0).batch_share == 4
    rank = dataclasses.replace(pmodel.plan.ranks[0], micro_batch_size=1, num_microbatches=4)
    pmodel.set_plan(dataclasses.replace(pmodel.plan, ranks=(rank,)))
    assert pmodel.layout is not first and pmodel.layout.where(0) == RankLayout(pmodel.plan).where(0)


def test_a_plan_of_an_unknown_form_is_refused_naming_the_known_ones() -> None:
    """The registry picks the pass (``form_pass``); a plan whose form it does not know is a
    PlanError before anything is set up."""
    from fxpar.errors import PlanError

    model = torch.nn.Linear(4, 2)
    with pytest.raises(PlanError, match="plan.form = 'zero_bubble'"):
        RankModule(model, _UnknownForm("zero_bubble"), 0)
    assert model.weight.device.type == "cpu" and not model.weight.is_meta


class _UnknownForm:
    """Only a ``form`` (what the registry reads first)."""

    def __init__(self, form: str) -> None:
        self.form = form


def test_the_one_gather_gives_copies_under_every_name_and_refuses_a_missing_copy() -> None:
    """``gather_state_dict`` (one implementation, on the layout): a tied weight under each of its
    names, values equal to the module's and not views of them; a replica or rank the module does
    not have is a clear error."""
    from fxpar.errors import CheckpointError, ConfigError
    from tests.graph.test_step_loop import _plan

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[1].weight = model[0].weight   # tied
    pmodel = RankModule(model, _plan([4], 2), 0, example_inputs=torch.zeros(4, 4), device=torch.device("cpu"),
                        loss_weighting="samples", emulate=False)
    full = pmodel.gather_state_dict()
    assert sorted(full) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    assert all(torch.equal(full[n], p) for n, p in model.named_parameters(remove_duplicate=False))
    full["0.weight"].zero_()
    assert model[0].weight.abs().sum() > 0
    with pytest.raises(CheckpointError, match="replica = 1, but 0.bias is held by 1 rank"):
        pmodel.gather_state_dict(replica=1)
    with pytest.raises(ConfigError, match="dst = 2"):
        pmodel.gather_state_dict(dst=2)


def test_fxpar_modules_are_parallel_modules_by_registration() -> None:
    """``isinstance`` must not depend on reading the members: from Python 3.12 a protocol's check
    reads them statically, which misses ``module`` (kept in ``_modules``) and what the adaptive
    module hands on.  Modules with no member set yet are still parallel modules."""
    bare = []
    for cls in _built_classes():
        module = cls.__new__(cls)
        torch.nn.Module.__init__(module)
        bare.append(module)
    adaptive = AdaptiveModule.__new__(AdaptiveModule)
    torch.nn.Module.__init__(adaptive)
    adaptive.module = bare[0]
    assert all(isinstance(m, ParallelModule) for m in [*bare, adaptive])


def _probes() -> list[tuple[str, str, int]]:
    """``(file, member, line)`` of every ``hasattr(x, m)`` / ``getattr(x, m, default)`` on a
    member's name under fxpar/."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
                continue
            probe = (node.func.id == "hasattr" and len(node.args) == 2) or (
                node.func.id == "getattr" and len(node.args) == 3)
            name = node.args[1] if probe else None
            if isinstance(name, ast.Constant) and name.value in MEMBERS:
                found.append((str(path.relative_to(PACKAGE)), name.value, node.lineno))
    return found


def test_fxpar_reads_the_contract_and_never_probes_it() -> None:
    probes = [(f, m, line) for f, m, line in _probes() if (f, m) not in NOT_ON_A_PARALLEL_MODULE]
    assert not probes, ("read these members directly (fxpar.runtime.contract.ParallelModule declares them), "
                        f"or say in NOT_ON_A_PARALLEL_MODULE what else is probed: {probes}")
    stale = set(NOT_ON_A_PARALLEL_MODULE) - {(f, m) for f, m, _ in _probes()}
    assert not stale, f"NOT_ON_A_PARALLEL_MODULE lists probes that are gone: {sorted(stale)}"


#: classes defining each of these themselves, among the parallel modules and the passes (issue #38
#: item 2 asks for one each; the adaptive module's step wraps its plan's; a pipeline's schedule runs
#: inside the step loop's).  They may only go down.
IMPLEMENTATIONS_AT_MOST = {"clip_grad_norm_": 1, "save_pretrained": 1, "step": 2, "gather_state_dict": 1,
                           "gather_gradients": 1}


def test_one_implementation_of_what_every_form_shares() -> None:
    classes = {ParallelModuleBase, AdaptiveModule, *_built_classes(), *_passes()}
    classes |= {base for cls in list(classes) for base in cls.__mro__
                if issubclass(base, (ParallelModuleBase, FormPass))}
    for name, most in IMPLEMENTATIONS_AT_MOST.items():
        defining = sorted(c.__name__ for c in classes if name in vars(c))
        assert len(defining) <= most, f"{name} is written in {defining}: at most {most} (and going down)"
    assert sorted(c.__name__ for c in classes if "step" in vars(c)) == ["AdaptiveModule", "StepModule"]
    assert [c.__name__ for c in classes if "clip_grad_norm_" in vars(c)] == ["ParallelModuleBase"]
    assert [c.__name__ for c in classes if "save_pretrained" in vars(c)] == ["RankModule"]
    assert [c.__name__ for c in classes if "gather_state_dict" in vars(c)] == ["RankModule"]
    assert [c.__name__ for c in classes if "gather_gradients" in vars(c)] == ["RankModule"]


def test_no_class_bypasses_its_bases_init() -> None:
    """Issue #38 item 2: every module is made through its ``__init__`` chain (``super().__init__``);
    no class of fxpar calls a base's ``__init__`` by name (the interleaved pipeline module did,
    skipping the 1F1B module's and re-setting its fields: it now gives only the build step)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "__init__"
                    and not (isinstance(node.func.value, ast.Call) and getattr(node.func.value.func, "id", "") == "super")):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert not found, f"a base's __init__ called by name (use super().__init__): {found}"
