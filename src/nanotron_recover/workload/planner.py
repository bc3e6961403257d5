"""Which replica computes which of a step's M microbatches.

Pure and deterministic: every rank calls these with the agreed live set and gets the same answer, so planning
needs no communication. Indices are *step-local* global microbatch indices in ``[0, M)``; step ``s`` trains on
samples ``s*M + i`` whoever computes index ``i`` (README, "How it works").

Decisions (documented here because callers rely on them):

* **Equal weights**: quotas are ``M // n`` or ``M // n + 1``; the lowest replica ids get the extra ones. Ranges are
  contiguous in replica-id order, so a failure-free run over replicas ``0..R-1`` gives replica ``k`` exactly the
  ``k``-th chunk, like nanotron's dp split. If ``M < n`` the highest ids get 0 microbatches.
* **Weights** (relative speeds): quota ``i`` is the exact share ``M * w_i / sum(w)`` rounded by largest remainder
  (ties: lowest replica id first), so every quota is within 1 of its exact share (floor or ceil). Arithmetic is
  exact (:class:`fractions.Fraction`), so there is no float-rounding disagreement between ranks. A replica with
  weight > 0 can get 0 microbatches exactly when its exact share is < 1 and it loses the remainder race: a
  guaranteed minimum of 1 would break "within 1 of the exact share" (e.g. shares 0.01/0.01/9.98). A replica
  with quota 0 still takes part in the reduction with a zero gradient; the SUM invariant is unaffected.
  Weight 0 means "computes nothing" (e.g. drained straggler).
* ``step`` does not change the plan (the same live set gives the same plan every step, which keeps each
  replica's local summation order stable). It is accepted so callers pass it and error messages carry it.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from fractions import Fraction

Plan = dict[int, list[int]]


def _check_ids(ids: Sequence[int], what: str) -> list[int]:
    """Sorted copy of replica ids; rejects duplicates and negatives."""
    out = sorted(int(r) for r in ids)
    if any(r < 0 for r in out):
        raise ValueError(f"{what}: replica ids must be >= 0, got {out}")
    if len(set(out)) != len(out):
        raise ValueError(f"{what}: duplicate replica ids in {list(ids)}")
    return out


def _exact_weights(replicas: list[int], weights: Mapping[int, float] | None, what: str) -> list[Fraction]:
    """Exact rational weights for ``replicas`` (all 1 when ``weights`` is None)."""
    if weights is None:
        return [Fraction(1)] * len(replicas)
    missing = [r for r in replicas if r not in weights]
    if missing:
        raise ValueError(f"{what}: no weight for replicas {missing}")
    out = []
    for r in replicas:
        w = float(weights[r])
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"{what}: weight of replica {r} must be finite and >= 0, got {weights[r]!r}")
        out.append(Fraction(w))
    if sum(out) == 0:
        raise ValueError(f"{what}: all weights are 0, nobody can compute")
    return out


def quotas(M: int, live_replicas: Sequence[int], weights: Mapping[int, float] | None = None) -> dict[int, int]:
    """How many microbatches each live replica computes (see module doc for the rounding rule)."""
    if M < 1:
        raise ValueError(f"M must be >= 1, got {M}")
    live = _check_ids(live_replicas, "quotas")
    if not live:
        raise ValueError("empty live replica set")
    ws = _exact_weights(live, weights, "quotas")
    total = sum(ws)
    shares = [M * w / total for w in ws]
    base = [math.floor(s) for s in shares]
    left = M - sum(base)
    # Largest remainder first; ties by lowest replica id (the sort is stable on the id-sorted list).
    order = sorted(range(len(live)), key=lambda i: -(shares[i] - base[i]))
    for i in order[:left]:
        base[i] += 1
    return dict(zip(live, base))


def plan_step(
    step: int, M: int, live_replicas: Sequence[int], weights: Mapping[int, float] | None = None
) -> Plan:
    """Split microbatches ``0..M-1`` of ``step`` over ``live_replicas`` in contiguous, id-ordered ranges.

    Args:
        step: training step (does not change the plan; see module doc).
        M: microbatches per step (the failure-free global count), >= 1.
        live_replicas: original replica ids of the replicas that compute this step, any order.
        weights: optional relative speed per replica (every live replica needs one; extra keys are ignored).

    Returns:
        ``{replica: sorted list of step-local microbatch indices}`` covering ``range(M)`` exactly once, with a
        key for every live replica (possibly an empty list).

    Raises:
        ValueError: empty live set, ``M < 1``, duplicate ids, or a missing / negative / non-finite weight.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    q = quotas(M, live_replicas, weights)
    plan: Plan = {}
    start = 0
    for r in sorted(q):
        plan[r] = list(range(start, start + q[r]))
        start += q[r]
    return plan


def orphans_of(plan: Mapping[int, Sequence[int]], failed: Sequence[int]) -> list[int]:
    """Sorted microbatch indices that ``failed`` replicas owned in ``plan`` (unknown ids own nothing)."""
    return sorted(i for r in set(failed) for i in plan.get(r, ()))


def replan_orphans(
    orphans: Sequence[int],
    survivors: Sequence[int],
    current_plan: Mapping[int, Sequence[int]],
    weights: Mapping[int, float] | None = None,
) -> Plan:
    """Give a mid-step failure's orphaned microbatches to the survivors as extra work.

    Counts are chosen greedily one microbatch at a time: the next one goes to the survivor whose finish time
    ``(load + 1) / weight`` is smallest (ties: lowest id), where ``load`` starts at its ``current_plan`` quota
    (0 for a survivor absent from the plan, e.g. a just-activated spare). For unit-size work this minimizes the
    maximum finish time; under equal weights every survivor that receives work ends at most 1 above the least
    loaded one. The sorted orphans are then handed out as contiguous chunks in survivor-id order.

    Args:
        orphans: step-local indices the failed replicas owned (any order, no duplicates).
        survivors: replicas that finish the step (any order, non-empty if there are orphans).
        current_plan: the step's plan as computed so far (may still contain the failed replicas).
        weights: optional relative speeds; a survivor with weight 0 gets no orphans.

    Returns:
        ``{survivor: sorted NEW indices}`` for every survivor (possibly empty lists).

    Raises:
        ValueError: duplicate orphans, an orphan still owned by a survivor, no survivors, bad weights.
    """
    orph = sorted(int(i) for i in orphans)
    if len(set(orph)) != len(orph):
        raise ValueError(f"duplicate orphan indices in {list(orphans)}")
    surv = _check_ids(survivors, "replan_orphans")
    if not orph:
        return {r: [] for r in surv}
    if not surv:
        raise ValueError("orphans but no survivors to compute them")
    owned = {i for r in surv for i in current_plan.get(r, ())}
    clash = sorted(owned.intersection(orph))
    if clash:
        raise ValueError(f"orphans {clash} are still owned by a survivor")
    ws = _exact_weights(surv, weights, "replan_orphans")
    load = [len(current_plan.get(r, ())) for r in surv]
    extra = [0] * len(surv)
    # Heap of (finish time if it takes one more, replica id, position): O(orphans * log survivors).
    heap = [(Fraction(load[k] + 1) / ws[k], surv[k], k) for k in range(len(surv)) if ws[k] > 0]
    heapq.heapify(heap)
    for _ in orph:
        _, r, k = heapq.heappop(heap)
        extra[k] += 1
        heapq.heappush(heap, (Fraction(load[k] + extra[k] + 1) / ws[k], r, k))
    out: Plan = {}
    start = 0
    for k, r in enumerate(surv):
        out[r] = orph[start : start + extra[k]]
        start += extra[k]
    return out


def merge(plan: Mapping[int, Sequence[int]], extra: Mapping[int, Sequence[int]], failed: Sequence[int] = ()) -> Plan:
    """``plan`` minus the ``failed`` replicas, plus ``extra`` work (the step's effective plan after a re-plan)."""
    gone = set(failed)
    out: Plan = {r: list(ix) for r, ix in plan.items() if r not in gone}
    for r, ix in extra.items():
        out[r] = sorted([*out.get(r, []), *ix])
    return out
