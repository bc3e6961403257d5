"""Simulating a benchmark we measured: the same cluster, schedule and costs, predicted again.

The prediction takes the *schedule* of a comparison (replicas, M, steps, checkpoint interval, which replicas are
killed at which step) and the *costs* calibrated from it (:func:`calibrate.from_benchmark_json`: medians over
every run of each path), simulates ReCoVer and checkpoint-restart, and compares the effective-throughput ratio
(tokens per live process-second) with the one the benchmark measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nanotron_recover.sim.calibrate import BenchmarkSchedule, Calibration, from_benchmark_json
from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.engine import SimResult, simulate
from nanotron_recover.sim.params import Params
from nanotron_recover.sim import policies as P

__all__ = ["BenchmarkPrediction", "predict_benchmark", "predict_benchmark_json", "benchmark_params"]


@dataclass(frozen=True)
class BenchmarkPrediction:
    recover: SimResult
    ckpt_restart: SimResult
    measured_ratio: float

    @property
    def predicted_ratio(self) -> float:
        return self.recover.effective_throughput / self.ckpt_restart.effective_throughput

    @property
    def relative_error(self) -> float:
        return self.predicted_ratio / self.measured_ratio - 1.0


def benchmark_params(cal: Calibration, sched: BenchmarkSchedule) -> Params:
    """Our benchmarks' conditions: SIGKILLs only (no hangs, no node losses), the job's own processes."""
    base = Params().with_("benchmark schedule", accumulation=sched.accumulation,
                          tokens_per_microbatch=sched.tokens_per_microbatch, hang_fraction=0.0, node_fraction=0.0,
                          replacement=sched.baseline.endswith("_B"))
    return cal.apply(base)


def predict_benchmark(stock: Calibration, rec: Calibration, sched: BenchmarkSchedule) -> BenchmarkPrediction:
    cluster = Cluster(gpus=sched.dp, gpus_per_node=max(8, sched.dp))
    kw = dict(target_steps=sched.steps, scheduled=sched.failures, random_failures=False)
    r = simulate(cluster, P.recover(None, 1), benchmark_params(rec, sched), **kw)
    c = simulate(cluster, P.ckpt_restart(sched.checkpoint_interval or None), benchmark_params(stock, sched), **kw)
    return BenchmarkPrediction(r, c, sched.measured_ratio)


def predict_benchmark_json(path: str | Path) -> BenchmarkPrediction:
    return predict_benchmark(*from_benchmark_json(path))
