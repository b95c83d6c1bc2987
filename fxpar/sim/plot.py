"""Draw a :class:`~fxpar.sim.timeline.SimResult` timeline as a PNG (matplotlib)."""

from __future__ import annotations

from pathlib import Path

from fxpar.errors import ConfigError
from fxpar.sim.timeline import SimResult

COLORS = {"fwd": "#4C72B0", "bwd": "#DD8452", "all_reduce": "#55A868", "optimizer": "#8172B3",
          "idle": "#DDDDDD", "replicated": "#4C72B0", "experts": "#C44E52", "all_to_all": "#937860",
          "hop": "#DA8BC3", "all_gather": "#8C8C8C"}
MAX_ROWS = 32


def plot_timeline(result: SimResult, path: str | Path, *, title: str = "", labels: list[str] | None = None) -> Path:
    """One row per rank (the first and last 16 when there are more than 32)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError("--timeline needs matplotlib: pip install 'fxpar[plot]'") from None
    ranks = sorted({e.rank for e in result.events})
    if len(ranks) > MAX_ROWS:
        ranks = ranks[: MAX_ROWS // 2] + ranks[-MAX_ROWS // 2:]
    row = {r: i for i, r in enumerate(ranks)}
    fig, ax = plt.subplots(figsize=(10, 0.9 + 0.32 * len(ranks)))
    for e in result.events:
        if e.rank in row and e.end_s > e.start_s:
            ax.broken_barh([(e.start_s, e.end_s - e.start_s)], (row[e.rank] - 0.4, 0.8),
                           facecolors=COLORS.get(e.kind, "#999999"), edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([labels[r] if labels else f"rank {r}" for r in ranks], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("seconds (predicted)")
    ax.set_title(title or f"predicted step {result.step_s:.4g} s", fontsize=9)
    kinds = {e.kind for e in result.events}
    ax.legend(handles=[Patch(color=c, label=k) for k, c in COLORS.items() if k in kinds], fontsize=7,
              loc="lower right", ncol=5)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
