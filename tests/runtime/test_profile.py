"""The measured hardware profile the runtime writes is one the scheduler's cost model reads."""

from __future__ import annotations

from pathlib import Path

from runtime.profile import main
from scheduler.cost_model import CostModel, HardwareProfile, ModelShape


def test_written_profile_loads_into_the_cost_model(tmp_path: Path) -> None:
    out = tmp_path / "hw.json"
    assert main(["-o", str(out), "--device", "cpu", "--dtype", "float32", "--seconds", "0.01",
                 "--kv-memory", str(1 << 30)]) == 0

    hw = HardwareProfile.from_json(out)
    assert hw.flops > 1e8 and hw.bandwidth > 1e8  # a real measurement, not zeros
    assert hw.kv_capacity_bytes == 1 << 30

    cost = CostModel(ModelShape.named("smollm2-135m"), hw)
    assert cost.comp(100, 10) > 0 and cost.mem(100, 10) > 0
