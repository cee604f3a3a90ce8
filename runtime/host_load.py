"""How much of the machine's CPU time went to others while something was being timed.

A step timed while another process shares the cores (or, on a VM, while the hypervisor runs
another guest: `steal`) comes out slow, and so does everything predicted from it, by far more
than the share taken: the engine's threads wait for each other at every operator. Measured on a
2-core VM: a profile taken beside one busy single-threaded process (37% of the CPUs) predicted
steps 2.3-5.5x as long as one taken idle. `LoadMeter` reads the kernel's CPU counters (Linux
/proc/stat) around a measurement and subtracts this process's own CPU time and its waited-for
children's, so a profile or a benchmark can say what share of the machine it did not have.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

PROC_STAT = Path("/proc/stat")
DISTURBED = 0.05  # a measurement with more than this share of the CPUs taken by others


@dataclass(frozen=True, slots=True)
class HostLoad:
    """Shares of all CPUs' time over a measurement's wall time."""

    other: float  # busy in processes other than this one and its waited-for children
    steal: float  # given by the hypervisor to other guests

    @property
    def taken(self) -> float:
        """The share others took: other processes and other guests."""
        return self.other + self.steal

    @property
    def disturbed(self) -> bool:
        return self.taken > DISTURBED

    @classmethod
    def from_fields(cls, fields: dict[str, float | None]) -> HostLoad | None:
        """The load `load_fields` reported (None where it was unknown or not recorded)."""
        other, steal = fields.get("other_load"), fields.get("steal")
        return None if other is None else cls(float(other), float(steal or 0.0))


def cpu_jiffies(line: str) -> tuple[int, int]:
    """(busy, steal) clock ticks of /proc/stat's aggregate `cpu` line. Busy is user, nice,
    system, irq and softirq (guest time is already inside user); idle and iowait are not."""
    name, *values = line.split()
    if name != "cpu":
        raise ValueError(f"not the aggregate cpu line: {line!r}")
    counts = ([int(v) for v in values] + [0] * 8)[:8]
    user, nice, system, _idle, _iowait, irq, softirq, steal = counts
    return user + nice + system + irq + softirq, steal


def _machine() -> tuple[int, int] | None:
    try:
        with PROC_STAT.open() as f:
            return cpu_jiffies(f.readline())
    except (OSError, ValueError):
        return None  # not Linux, or no /proc: nothing to say


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


class LoadMeter:
    """`with LoadMeter() as meter: ...` then `meter.load`: a HostLoad, or None where the
    machine's counters cannot be read. Child processes count as this process's own only once
    waited for inside the block (subprocess.run does)."""

    def __init__(self) -> None:
        self.load: HostLoad | None = None

    def __enter__(self) -> Self:
        self._wall = time.monotonic()
        self._own = _own_cpu_s()
        self._machine = _machine()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        end = _machine()
        wall = time.monotonic() - self._wall
        own = _own_cpu_s() - self._own
        if self._machine is None or end is None or wall <= 0:
            return
        hz = os.sysconf("SC_CLK_TCK")
        capacity = wall * (os.cpu_count() or 1)
        busy = (end[0] - self._machine[0]) / hz
        steal = (end[1] - self._machine[1]) / hz
        self.load = HostLoad(other=min(max(busy - own, 0.0) / capacity, 1.0),
                             steal=min(max(steal, 0.0) / capacity, 1.0))


def load_fields(load: HostLoad | None) -> dict[str, float | None]:
    """A measurement's report fields (None where the machine's counters cannot be read)."""
    return {"other_load": None if load is None else round(load.other, 3),
            "steal": None if load is None else round(load.steal, 3)}


def disturbance(fields: dict[str, float | None], what: str) -> str | None:
    """A warning about `what` when the load_fields it was measured with say others took a
    share of the machine past DISTURBED; None otherwise."""
    load = HostLoad.from_fields(fields)
    if load is None or not load.disturbed:
        return None
    return (f"{what} was measured while other processes took {load.other:.0%} of the CPUs "
            f"(other guests {load.steal:.0%}): its timings may be several times too slow; "
            "measure again when the machine is idle")
