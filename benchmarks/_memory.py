"""Per-process host-memory counters for the benchmarks (Linux ``/proc``)."""

from __future__ import annotations


def status_kib(field: str) -> int:
    """One ``/proc/self/status`` field in KiB (``VmRSS``, ``VmHWM``)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def rss_bytes() -> int:
    """Resident memory now."""
    return status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident memory since the process started or since the last :func:`reset_peak_rss`."""
    return status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Reset the peak (``VmHWM``) to the current resident size: writing 5 to ``clear_refs`` (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
