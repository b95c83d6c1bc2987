"""Process memory accounting on Linux (CPU runs): resident set and its peak since a reset."""

from __future__ import annotations

from pathlib import Path


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_bytes() -> int:
    return _status("VmRSS")


def reset_peak() -> int:
    """Reset the kernel's peak-RSS counter (VmHWM) to the current RSS; returns that RSS."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss_bytes()


def peak_rss_bytes() -> int:
    return _status("VmHWM")
