"""The parallel forms, one registry line each, and the protocol each one implements.

A *parallel form* (data, sharded/ZeRO, expert, pipeline, tensor; ``docs/glossary.md``) is what a
plan's ``form`` names.  Each form lives in one folder, ``fxpar/forms/<folder>/``, with one
module per *phase* it takes part in; the phases find a form's module by its folder and the
phase's name (:func:`part`), so a new form is its folder plus one line in :data:`FORMS`
(``docs/extending.md`` walks through adding one).  The phases, each at its layer of the data flow (``docs/layout.md``) and each with the
functions it must define (:data:`PHASES`):

    spec    (plain data, imports no torch)   check(plan)        the form's rules of a Plan, after
                                                                :func:`fxpar.plan_checks.check_plan`
                                             check_stage(plan, i, stage)   one stage's rules
                                             summary(plan)      the lines ``Plan.table()`` adds
                                             label(plan)        a short name of the plan (logs)
                                             state_holders(plan)  the fewest ranks that share the
                                                                model state (adapting's move)
                                             refusal(old, new)  why a module running ``old`` cannot
                                                                take ``new`` in place (empty: it
                                                                can, only the shares change)
    price   (the simulator, imports no torch) simulate(plan, cost)   -> :class:`fxpar.sim.SimResult`
    search  (the solvers, imports no torch;  problem(graph, cost, cluster, workload)  its own
             searched forms only)               problem, built once per plan() where it is asked
                                                for (None: it reads only what every form shares)
                                             candidates(problems, found, max_tensor_parallel)
                                                  -> its plans, explain lines and baselines
                                                                (``found``: the forms searched before)
    bound   (the solvers, imports no torch)  applies(problems)  whether it can offer a plan for
                                                                these problems (the lower bound's
                                                                minimum runs over those that can)
                                             bound_s(cost, batch, work)   the least step of any of
                                                                its plans, or None where it has none
                                                                (:func:`fxpar.solvers.bounds.lower_bound_s`)
    apply   (codegen)                        form_pass(plan)    the form's pass of the rank's module
                                                                (a :class:`fxpar.runtime.form_pass.FormPass`,
                                                                which the one module type,
                                                                :class:`fxpar.codegen.common.module.RankModule`,
                                                                applies to itself)
                                             emit(plan, model, example_inputs, out)  the files
                                                                ``fxpar plan --emit`` writes
    predict (fxpar.predict)                  predict(plan, cost, calibration)  -> its step's parts
                                                                (:class:`fxpar.predict.Prediction`)
    calibrate (fxpar.calibrate; optional:    overheads()        the ProfileDB fields of the fixed
               a form whose runtime has no                      costs it measures, each with what
               fixed cost of its own to                         one unit of it is
               measure leaves it out)        probe_arms(probe)  -> {field: the plan that shows it}
                                                                on one probe model (a
                                                                :class:`fxpar.calibrate.probe_arms.ProbeModel`;
                                                                empty where it has none there);
                                                                ``fxpar calibrate``'s runtime probe
                                                                steps them (:mod:`fxpar.calibrate.runtime_probe`),
                                                                :func:`parts` finds them

A form's folder also holds the modules that serve one of its phases, named ``<phase>_<what>``
and placed at that phase's layer (the pipelines' search is ``search.py`` over
``search_pipelines.py`` and three more; its hand-written plan builders are ``apply_plans.py``,
gathered for users by :mod:`fxpar.forms.hand_plans`); nothing outside this package imports a
form's folder.  No line outside it names a built-in form (``tests/project/test_forms.py`` counts
them, and that count may not rise).

A form outside this package (a plug-in) is a package with the same phase modules whose
``__init__`` defines ``FORM``, a :class:`Form` with ``package`` set to it; the environment
variable ``FXPAR_FORMS`` names such packages (comma-separated), read once when this registry is
imported, so every rank of a job (each process imports fxpar) has the same forms.  They follow
the built-in forms in :data:`FORMS`.  ``tests/toy_form`` is one (``docs/extending.md``).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass
from types import ModuleType

from fxpar.errors import ConfigError, PlanError

#: the environment variable naming plug-in forms' packages (module docstring)
PLUGINS_VARIABLE = "FXPAR_FORMS"


@dataclass(frozen=True)
class Form:
    """One parallel form: the name a plan's ``form`` carries, its folder under
    ``fxpar/forms/``, and what the plan table and the planner need to know of it."""
    name: str            #: the plan's ``form`` value (plan files, the CLI, ``forms=``)
    folder: str          #: ``fxpar/forms/<folder>/`` holds its phases
    title: str           #: a few words for people
    communication: str   #: what its step exchanges, as the plan table prints it
    searched: bool       #: the planner searches it on its own (tensor parallelism
                         #: is searched inside pipelines: one stage over a TP group)
    recorded: bool = False       #: a recorded graph (a model that does not export) can have it:
                                 #: its codegen runs the model's own forward, or eager stages
    rebalances: bool = False     #: its shares are re-solved from measured speeds while training
                                 #: (``measured_speeds``, :mod:`fxpar.solvers.rebalance`)
    whole_job_groups: bool = False   #: its process groups span the whole job (no ``group=``)
    cuts_model: bool = False     #: it cuts the model into stages: trains on the model's own loss
                                 #: and needs a dict example batch to cut it
    emits_from_model: bool = False   #: ``fxpar plan --emit`` writes its files from the model's
                                     #: modules (the CLI builds the model on ``meta`` for it)
    forward_collective: bool = False  #: its forward runs collectives, so every rank evaluates
                                      #: the same rows: the whole global batch (the Trainer's loader)
    offloads: bool = False       #: a rank may keep its optimizer on the host
                                 #: (``RankPlan.offload_optimizer``; refused for other forms)
    whole_gradients: bool = False  #: after a step, each rank holds the whole gradient of every
                                   #: parameter it holds, under the model's names (none sliced or
                                   #: reduce-scattered; a pipeline's stages at tensor width 1):
                                   #: what the demo's parity check compares with one process
    sample_per_rank: bool = False  #: every rank trains on at least one sample of the global batch,
                                   #: so a batch smaller than the ranks is refused before tracing
                                   #: where only such forms are asked for
    #: the per-form fields of a ``StagePlan`` its runtime reads (of :data:`STAGE_FIELDS`); a plan
    #: of this form that sets another is a PlanError (:func:`fxpar.plan_checks.check_form_rules`):
    #: its run would ignore it
    stage_fields: frozenset[str] = frozenset()
    package: str = ""            #: the package of its phase modules (a plug-in's, module
                                 #: docstring); empty: ``fxpar.forms.<folder>``

    @property
    def modules(self) -> str:
        """The package its phase modules live in."""
        return self.package or f"fxpar.forms.{self.folder}"


#: the fields of a ``StagePlan`` that belong to one form or another (:attr:`Form.stage_fields`);
#: unset is None
STAGE_FIELDS: tuple[str, ...] = ("tensor", "expert", "sharded", "replicas")

#: fxpar's own forms, in the order the planner offers them (the first found wins a tie)
BUILT_IN: tuple[Form, ...] = (
    Form("data_parallel", "data", "data parallelism (uneven shares)", "all-reduce", True,
         recorded=True, rebalances=True, whole_gradients=True, sample_per_rank=True),
    Form("pipeline", "pipeline", "pipeline parallelism (stages, with TP and replicas)", "all-reduce", True,
         recorded=True, whole_job_groups=True, cuts_model=True, emits_from_model=True, whole_gradients=True,
         stage_fields=frozenset({"tensor", "expert", "replicas"})),
    Form("expert_parallel", "expert", "expert parallelism (MoE experts per rank)", "all-to-all + all-reduce", True,
         forward_collective=True, stage_fields=frozenset({"expert"})),
    Form("sharded_data_parallel", "sharded", "sharded data parallelism (ZeRO-2/3)",
         "all-gather + reduce-scatter", True, recorded=True, forward_collective=True, offloads=True,
         stage_fields=frozenset({"sharded"})),
    Form("tensor_parallel", "tensor", "tensor parallelism (one stage over a TP group)", "all-reduce", False,
         whole_job_groups=True, emits_from_model=True, forward_collective=True,
         stage_fields=frozenset({"tensor"})),
)


def plugins(names: str) -> tuple[Form, ...]:
    """The forms of the packages ``names`` lists (comma-separated, :data:`PLUGINS_VARIABLE`),
    each its package's ``FORM``; a :class:`ConfigError` naming the package and what is wrong."""
    out: list[Form] = []
    for name in (n.strip() for n in names.split(",")):
        if not name:
            continue
        where = f"{PLUGINS_VARIABLE}={names!r}: package {name!r}"
        try:
            module = importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(f"{where} does not import ({exc}); put it on the Python path or remove it "
                              f"from {PLUGINS_VARIABLE}") from None
        found = getattr(module, "FORM", None)
        if not isinstance(found, Form) or found.modules != name:
            raise ConfigError(f"{where} must define FORM, a fxpar.forms.Form whose package is {name!r} "
                              f"(got {found!r}); docs/extending.md shows one")
        out.append(found)
    return tuple(out)


#: the forms, in the order the planner offers them (the first found wins a tie): the built-in
#: ones, then the plug-ins of :data:`PLUGINS_VARIABLE`
FORMS: tuple[Form, ...] = BUILT_IN + plugins(os.environ.get(PLUGINS_VARIABLE, ""))

#: phase -> the functions its module defines (the module docstring says what each does)
PHASES: dict[str, tuple[str, ...]] = {
    "spec": ("check", "check_stage", "summary", "label", "state_holders", "refusal"),
    "price": ("simulate",),
    "bound": ("applies", "bound_s"),
    "search": ("problem", "candidates"),
    "apply": ("form_pass", "emit"),
    "predict": ("predict",),
    "calibrate": ("overheads", "probe_arms"),
}
#: the phases a form may leave out (the module docstring says when); ``search`` is left out by a
#: form the planner does not search on its own (:attr:`Form.searched`)
OPTIONAL_PHASES: frozenset[str] = frozenset({"calibrate"})

NAMES: tuple[str, ...] = tuple(f.name for f in FORMS)
if len(set(NAMES)) != len(NAMES):
    raise ConfigError(f"{PLUGINS_VARIABLE}: two forms share a name in {NAMES}; give each plug-in form its own")
#: the forms the planner searches, in its order
SEARCHED: tuple[str, ...] = tuple(f.name for f in FORMS if f.searched)
#: the forms a recorded graph (:mod:`fxpar.tracing.recorded`: no exported program to read experts
#: from) can have: those whose codegen runs the model's own forward, and pipelines, whose stages
#: then run the model's own modules eagerly (:func:`fxpar.solvers.problems.forms_for`)
RECORDED: tuple[str, ...] = tuple(f.name for f in FORMS if f.recorded)


def form(name: str) -> Form:
    """The form a plan's ``form`` names; a :class:`~fxpar.errors.PlanError` naming the
    accepted values for anything else."""
    for f in FORMS:
        if f.name == name:
            return f
    raise PlanError(f"plan.form = {name!r}: accepted values are {NAMES}")


def part(name: str, phase: str) -> ModuleType:
    """Form ``name``'s module for ``phase`` (``fxpar.forms.<folder>.<phase>``, a plug-in's
    ``<package>.<phase>``), imported on first use. A caller asks only for a phase at or below its
    own layer (``tests/project/test_forms.py``)."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}: expected one of {tuple(PHASES)}")
    return importlib.import_module(f"{form(name).modules}.{phase}")


def parts(phase: str) -> tuple[tuple[str, ModuleType], ...]:
    """``(name, module)`` of every form that has a module for ``phase``, in the forms' order (an
    optional phase, :data:`OPTIONAL_PHASES`, is asked for this way)."""
    if phase not in PHASES:
        raise ValueError(f"phase {phase!r}: expected one of {tuple(PHASES)}")
    return tuple((f.name, importlib.import_module(f"{f.modules}.{phase}")) for f in FORMS
                 if importlib.util.find_spec(f"{f.modules}.{phase}") is not None)
