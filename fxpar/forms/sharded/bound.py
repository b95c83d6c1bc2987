"""Sharded data parallelism's lower bound (:mod:`fxpar.forms`, phase ``bound``): the math in
:func:`fxpar.solvers.bounds.lower_bound_s`."""

from __future__ import annotations

import numpy as np

from fxpar.profiling import collectives
from fxpar.sim.sharded_cost import sharded_prices, unit_collectives
from fxpar.solvers.bounds import Work


def applies(p) -> bool:
    """Asked for, on more than one rank (:class:`~fxpar.solvers.problems.Problems`)."""
    return "sharded_data_parallel" in p.forms and p.cluster.world_size > 1


def bound_s(cost, batch: int, w: Work) -> float | None:
    """The least step of a ZeRO-2/3 plan; None on one rank (nothing to shard)."""
    return sharded_bound_s(cost, w) if w.world > 1 else None


def sharded_bound_s(cost, w: Work) -> float:
    """``max(T_DP + AG_0 + RS_0, Σ_u (AG_u + RS_u)) + o*/N``, on CPU ranks the sum of the two
    (:func:`fxpar.solvers.bounds.lower_bound_s`)."""
    ag, rs = shard_collectives_s(cost)
    channel = float(ag.sum() + rs.sum())
    exposed = w.whole_s + channel if not cost.overlaps_communication() else max(
        w.whole_s + float(ag[0] + rs[0]), channel)
    return exposed + w.fastest_opt_s / w.world


def shard_collectives_s(cost) -> tuple[np.ndarray, np.ndarray]:
    """``AG_u``, ``RS_u`` per collective unit (unit 0 the rest of the model, then the blocks): the
    smaller of the simulator's price at the mean shard (every padded shard is at least the mean)
    and the physical bound (:func:`fxpar.profiling.collectives.gather_lower_bound`,
    :func:`~fxpar.profiling.collectives.scatter_lower_bound`)."""
    prices = sharded_prices(cost)
    n = prices.world
    mean = np.array([sum(r * c for r, c in unit) for unit in prices.params], dtype=float) / n
    gather, scatter = unit_collectives(prices, np.repeat(mean[:, None], n, axis=1))
    shape = collectives.ring_shape(cost.cluster)
    wire = prices.gather_itemsize or (float(prices.bytes_wgo[0]),) * len(mean)
    ag = [min(t, collectives.gather_lower_bound(shape, x * s)) for t, x, s in zip(gather, wire, mean)]
    rs = [min(t, collectives.scatter_lower_bound(shape, prices.reduce_itemsize * s)) for t, s in zip(scatter, mean)]
    return np.array(ag), np.array(rs)
