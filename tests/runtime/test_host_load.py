"""LoadMeter: the share of the machine others took while something was timed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.host_load import HostLoad, LoadMeter, cpu_jiffies, disturbance, load_fields

needs_proc = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="needs Linux /proc/stat")


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_busy_time_is_user_nice_system_and_interrupts_and_steal_is_apart() -> None:
    assert cpu_jiffies("cpu  100 5 20 900 7 3 2 11 0 0") == (130, 11)
    assert cpu_jiffies("cpu 1 2 3 4") == (6, 0)  # old kernels: no irq, softirq or steal
    with pytest.raises(ValueError):
        cpu_jiffies("cpu0 1 2 3 4 5 6 7 8")


@needs_proc
def test_another_process_spinning_beside_the_measurement_is_other_load() -> None:
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # let it start
        with LoadMeter() as meter:
            time.sleep(1.5)
    finally:
        spinner.kill()
        spinner.wait()
    assert meter.load is not None
    # One spinning process takes one CPU of os.cpu_count(): count at least half of it.
    assert meter.load.other >= 0.5 / (os.cpu_count() or 1)
    assert meter.load.disturbed


@needs_proc
def test_the_measured_work_itself_and_its_waited_for_children_are_not_other_load() -> None:
    with LoadMeter() as idle:  # what the rest of the machine takes meanwhile
        time.sleep(1.0)
    with LoadMeter() as own:
        _spin(1.0)
    with LoadMeter() as child:
        code = "import time\nend = time.monotonic() + 1.0\nwhile time.monotonic() < end: pass"
        subprocess.run([sys.executable, "-c", code], check=True)
    share = 1.0 / (os.cpu_count() or 1)  # what the spinning took: one CPU
    assert idle.load is not None and own.load is not None and child.load is not None
    assert own.load.other < idle.load.other + share / 2
    assert child.load.other < idle.load.other + share / 2


def test_a_profile_measured_under_load_is_named_and_an_unknown_or_quiet_one_is_not() -> None:
    assert disturbance(load_fields(HostLoad(other=0.3, steal=0.0)), "the profile") is not None
    assert "30%" in (disturbance(load_fields(HostLoad(0.3, 0.0)), "the profile") or "")
    assert disturbance(load_fields(HostLoad(other=0.01, steal=0.01)), "the profile") is None
    assert disturbance(load_fields(None), "the profile") is None
    assert disturbance({}, "a profile from before the load was recorded") is None
