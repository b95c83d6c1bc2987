"""Finding the checkpoint to resume from after a failure."""

from __future__ import annotations

from pathlib import Path

from fxpar.checkpoint.files import META_FILE, read_metadata
from fxpar.errors import CheckpointError


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest *complete* checkpoint directly under ``root`` (by saved step, then name), or
    None.  Interrupted saves (``.<name>.partial``) and folders without fxpar's metadata file are
    skipped, so a rank killed while saving never makes the job resume from a torn checkpoint."""
    base = Path(root)
    if not base.is_dir():
        return None
    found: list[tuple[int, str, Path]] = []
    for path in base.iterdir():
        if not path.is_dir() or path.name.startswith(".") or not (path / META_FILE).is_file():
            continue
        try:
            meta, _ = read_metadata(path)
        except CheckpointError:
            continue
        step = meta.get("step")
        found.append((step if isinstance(step, int) else -1, path.name, path))
    return max(found)[2] if found else None
