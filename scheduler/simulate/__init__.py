"""Step simulator: runs the planner's admission policies against the cost model instead of a GPU.

`python -m scheduler.simulate TRACE.jsonl --policy blend --json` (see __main__.py). Modules:
trace.py (trace JSONL), prefix_cache.py (node-granular prefix cache, the engine's eviction),
executor.py (the step loop and its accounting), plot.py (utilisation per step).
"""

from scheduler.simulate.executor import SimConfig, SimResult, SimulationError, simulate
from scheduler.simulate.trace import TraceEntry, read_trace

__all__ = ["SimConfig", "SimResult", "SimulationError", "TraceEntry", "read_trace", "simulate"]
