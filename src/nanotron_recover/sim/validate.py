"""Simulating a benchmark we measured: the same cluster, schedule and costs, predicted again.

The prediction takes the *schedule* of a comparison (replicas, M, steps, checkpoint interval, which replicas are
killed at which step) and the *costs* calibrated from it (:func:`calibrate.from_benchmark_json`: medians over
every run of each path), simulates ReCoVer and checkpoint-restart, and compares the effective-throughput ratio
(tokens per live process-second) with the one the benchmark measured.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from nanotron_recover.sim import policies as P
from nanotron_recover.sim.accounting import SimResult
from nanotron_recover.sim.calibrate import BenchmarkSchedule, Calibration, from_benchmark_json
from nanotron_recover.sim.cluster import Cluster
from nanotron_recover.sim.engine import simulate
from nanotron_recover.sim.params import Params

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
                          replacement=sched.baseline.endswith("_B"), hw_repair_hours=float("inf"))
    return cal.apply(base)


def predict_benchmark(stock: Calibration, rec: Calibration, sched: BenchmarkSchedule) -> BenchmarkPrediction:
    cluster = Cluster(gpus=sched.dp, gpus_per_node=max(8, sched.dp))
    kw = dict(target_steps=sched.steps, scheduled=sched.failures, random_failures=False)
    r = simulate(cluster, P.recover(None, 1), benchmark_params(rec, sched), **kw)
    c = simulate(cluster, P.ckpt_restart(sched.checkpoint_interval or None), benchmark_params(stock, sched), **kw)
    return BenchmarkPrediction(r, c, sched.measured_ratio)


def predict_benchmark_json(path: str | Path) -> BenchmarkPrediction:
    return predict_benchmark(*from_benchmark_json(path))


def main(argv: list[str] | None = None) -> int:
    """``python -m nanotron_recover.sim.validate MEASURED.json [--costs-from OTHER.json]``: the prediction of a
    measured comparison, from its own costs or from another run's (its schedule kept)."""
    import argparse
    import dataclasses

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("measured")
    ap.add_argument("--costs-from", help="calibrate from this benchmark JSON instead (out-of-sample)")
    args = ap.parse_args(argv)
    stock, rec, sched = from_benchmark_json(args.measured)
    if args.costs_from:
        stock, rec, other = from_benchmark_json(args.costs_from)
        sched = dataclasses.replace(sched, devices=other.devices)
    pred = predict_benchmark(stock, rec, sched)
    for r in (pred.recover, pred.ckpt_restart):
        print(f"{r.policy}: wall {r.wall_s:.1f} s, process-s {r.process_s:.1f}, tokens {r.tokens:.0f}, "
              f"{r.effective_throughput:.1f} tokens/process-s")
    print(f"predicted={pred.predicted_ratio:.3f} measured={pred.measured_ratio:.3f} "
          f"error={pred.relative_error:+.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
