"""Batch sizes under a memory budget: the estimated peak of the step `compile_training` would build,
and the largest batch that fits (`max_batch`), from the passes up to ``Rematerialize`` (no kernel built)."""
from __future__ import annotations

import tvm

from .errors import MemoryBudgetError
from .frontend import from_torch
from .memory import FUNCTION
from .pipeline import phases
from .relax_passes.partition.rematerialize import BUDGET_ATTR, estimate_peak
from .training import as_target, build_training_module, resolve_memory_budget, runtime_module

def estimate_step_peak(model, example_inputs, loss_fn=None, optimizer=None, target=None, precision: str = "fp32",
                       memory_budget: int | None = None) -> int:
    """The estimated peak bytes of the training step `compile_training` would build with these
    arguments (``rematerialize.estimate_peak`` on ``train_step`` after the partitioner and, given
    `memory_budget`, the rematerialisation): the passes up to there run, no kernel is built.  With
    a budget no plan meets, raises `MemoryBudgetError`."""
    tgt = as_target(target)
    budget = resolve_memory_budget(memory_budget, tgt, precision)
    graph = build_training_module(from_torch(model, example_inputs, loss_fn), optimizer, precision)
    mod = runtime_module(graph.mod)
    if budget is not None:
        mod["train_step"] = mod["train_step"].with_attr(BUDGET_ATTR, budget)
    passes = phases(tgt)
    names = [p.info.name for p in passes]
    with tgt:
        mod = tvm.transform.Sequential(passes[: names.index("Rematerialize") + 1])(mod)
    return estimate_peak(mod[FUNCTION])


def max_batch(model, make_inputs, budget: int, loss_fn=None, optimizer=None, target=None, precision: str = "fp32",
              rematerialize: bool = True, start: int = 1, limit: int = 1 << 16) -> tuple[int, int]:
    """(the largest batch whose step fits `budget` bytes, its estimated peak) by `estimate_step_peak`
    on ``make_inputs(batch)`` (the example inputs, the loss target last with `loss_fn`): doubling
    from `start`, then bisection.  `rematerialize`: with ``memory_budget=budget`` (forward values
    recomputed where that makes the step fit), else the step as it keeps everything.  Raises
    ValueError when not even `start` fits."""
    peaks: dict = {}

    def fits(batch: int) -> bool:
        try:
            peak = estimate_step_peak(model, make_inputs(batch), loss_fn, optimizer, target, precision,
                                      budget if rematerialize else None)
        except MemoryBudgetError:
            return False
        peaks[batch] = peak
        return peak <= budget

    if not fits(start):
        raise ValueError(f"max_batch: batch {start} does not fit {budget} bytes"
                         + (f" (estimated peak {peaks[start]})" if start in peaks else " with any rematerialisation plan"))
    good, bad = start, None
    while bad is None and good < limit:
        if fits(min(2 * good, limit)):
            good = min(2 * good, limit)
        else:
            bad = min(2 * good, limit)
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good, peaks[good]
