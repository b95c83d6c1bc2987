"""The plan families the planner searches, each a function of a
:class:`~fxpar.solvers.problems.Problems` that returns priced candidates: data parallel
(``data_parallel``), pipelines (``pipeline``), expert parallel (``expert``) and sharded data
parallel (``sharded``, with its LP ``sharded_lp`` and plan builder ``sharded_plans``).  Imports
the solver modules below ``fxpar.solvers.planner``; the planner (``planner``, ``choose``) imports
them."""
