"""Batch sizes and budgets under a memory limit, from the passes of the step `compile_training` would
build (no kernel built): its estimated peak (`estimate_step_peak`: up to ``Rematerialize``), the largest
batch that fits (`max_batch`), its memory plan's peak (`planned_step_peak`: up to the plan), and the
``memory_budget`` whose plan fits a limit (`aim_memory_budget`)."""
from __future__ import annotations

import tvm

from .errors import MemoryBudgetError
from .frontend import from_torch
from .memory import FUNCTION, memory_plan, memory_report
from .pipeline import phases
from .relax_passes.partition.rematerialize import BUDGET_ATTR, estimate_peak
from .training import as_target, build_training_module, captures_graphs, resolve_memory_budget, runtime_module

AIM_ROUNDS = 5  # memory plans made (no kernel built) to aim a budget
AIM_CLOSE = 0.02  # a plan this share of the limit under it is taken


def estimate_step_peak(model, example_inputs, loss_fn=None, optimizer=None, target=None, precision: str = "fp32",
                       memory_budget: int | None = None, cuda_graph: bool | None = None) -> int:
    """The estimated peak bytes of the training step `compile_training` would build with these
    arguments (``rematerialize.estimate_peak`` on ``train_step`` after the partitioner and, given
    `memory_budget`, the rematerialisation; in place where it is captured as CUDA graphs, as the
    step is built): the passes up to there run, no kernel is built.  With a budget no plan meets,
    raises `MemoryBudgetError`."""
    mod, _, tgt, _ = _training(model, example_inputs, loss_fn, optimizer, target, precision, cuda_graph)
    budget = resolve_memory_budget(memory_budget, tgt, precision)
    if budget is not None:
        mod["train_step"] = mod["train_step"].with_attr(BUDGET_ATTR, budget)
    passes = phases(tgt)
    names = [p.info.name for p in passes]
    with tgt:
        mod = tvm.transform.Sequential(passes[: names.index("Rematerialize") + 1])(mod)
    return estimate_peak(mod[FUNCTION])


def max_batch(model, make_inputs, budget: int, loss_fn=None, optimizer=None, target=None, precision: str = "fp32",
              rematerialize: bool = True, start: int = 1, limit: int = 1 << 16,
              by: str = "estimate") -> tuple[int, int]:
    """(the largest batch whose step fits `budget` bytes, its peak) on ``make_inputs(batch)`` (the
    example inputs, the loss target last with `loss_fn`): doubling from `start`, then bisection.
    `rematerialize`: forward values recomputed where that makes the step fit, else the step as it
    keeps everything.  `by`: "estimate" (``estimate_step_peak``, with ``memory_budget=budget``), or
    "plan": the step's memory plan (``planned_step_peak``; with `rematerialize`, the plan of the
    budget `aim_memory_budget` finds: slower, a few plans a batch, and nearer what the device holds).
    Raises ValueError when not even `start` fits."""
    if by not in ("estimate", "plan"):
        raise ValueError(f"max_batch: by={by!r}: 'estimate' or 'plan'")
    peaks: dict = {}

    def peak_of(inputs) -> int:
        args = (model, inputs)
        if by == "estimate":
            return estimate_step_peak(*args, loss_fn, optimizer, target, precision, budget if rematerialize else None)
        if rematerialize:
            return aim_memory_budget(*args, budget, loss_fn, optimizer, target, precision)[1]
        return planned_step_peak(*args, loss_fn, optimizer, target, precision)

    def fits(batch: int) -> bool:
        try:
            peak = peak_of(make_inputs(batch))
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


def _plan_peak(mod: tvm.IRModule, layout, target: tvm.target.Target, graphs: bool, budget: int | None) -> int:
    """The planned peak bytes of ``train_step`` in the training module `mod` built for `target` with
    `budget` (``memory_report``'s ``planned_peak_bytes``; every storage kept where it runs as CUDA
    graphs); no kernel is built."""
    step = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)  # `mod` stays as it is for the next budget
    if budget is not None:
        step[FUNCTION] = step[FUNCTION].with_attr(BUDGET_ATTR, budget)
    planned = memory_plan(step, target, graphs, kernels=False)
    return memory_report(planned, layout, storages_kept=graphs)["planned_peak_bytes"]


def _training(model, example_inputs, loss_fn, optimizer, target, precision, cuda_graph):
    tgt = as_target(target)
    graphs = captures_graphs(tgt, precision, cuda_graph)
    graph = build_training_module(from_torch(model, example_inputs, loss_fn), optimizer, precision, inplace=graphs)
    return runtime_module(graph.mod), graph.layout, tgt, graphs


def planned_step_peak(model, example_inputs, loss_fn=None, optimizer=None, target=None, precision: str = "fp32",
                      memory_budget: int | None = None, cuda_graph: bool | None = None) -> int:
    """The peak bytes of the memory plan of the step `compile_training` would build with these
    arguments (``memory_report``'s ``planned_peak_bytes``): its passes run up to the plan
    (``StaticPlanBlockMemory``, ``PackMemoryArena``), no kernel is built."""
    mod, layout, tgt, graphs = _training(model, example_inputs, loss_fn, optimizer, target, precision, cuda_graph)
    return _plan_peak(mod, layout, tgt, graphs, resolve_memory_budget(memory_budget, tgt, precision))


def aim_memory_budget(model, example_inputs, limit: int, loss_fn=None, optimizer=None, target=None,
                      precision: str = "fp32", cuda_graph: bool | None = None,
                      rounds: int = AIM_ROUNDS) -> tuple[int | None, int]:
    """(the ``memory_budget`` to compile with, its step's planned peak): the largest budget found
    whose memory plan holds at most `limit` bytes, None where the step fits without one.

    ``memory_budget`` bounds the rematerialisation's estimate, made before kernels are fused and
    memory is planned; the plan lands elsewhere (BERT-Large bf16 at batch 204: 15 to 25 GB under
    the estimate, not monotonically).  So budgets are tried: each next one moves by what its plan
    missed the limit by, never past one that was over, until a plan is within ``AIM_CLOSE`` under the
    limit or `rounds` plans were made (no kernel built).  Raises `MemoryBudgetError` when no budget
    tried fits."""
    mod, layout, tgt, graphs = _training(model, example_inputs, loss_fn, optimizer, target, precision, cuda_graph)
    peak = _plan_peak(mod, layout, tgt, graphs, None)
    if peak <= limit:
        return None, peak
    aim, best, over = limit, None, None  # best: (budget, peak) of the largest that fit; over: the smallest that did not
    for _ in range(rounds):
        try:
            peak = _plan_peak(mod, layout, tgt, graphs, aim)
        except MemoryBudgetError as err:  # no plan brings the estimate under `aim`: try the lowest it can reach
            if err.smallest is None or err.smallest <= aim:
                break
            aim = err.smallest
            continue
        if peak <= limit:
            best = max(best or (aim, peak), (aim, peak))
            if limit - peak <= AIM_CLOSE * limit:
                break
            step = aim + (limit - peak)
            if over is not None and step >= over:  # between the largest that fit and the smallest that did not
                step = (aim + over) // 2
        else:
            over = aim if over is None else min(over, aim)
            step = aim - max(peak - limit, int(AIM_CLOSE * limit / 2))  # not by a sliver: a plan moves in steps
            if best is not None and step <= best[0]:
                step = (best[0] + over) // 2
        if step == aim:
            break
        aim = step
    if best is None:
        raise MemoryBudgetError(f"aim_memory_budget: no memory_budget tried gives a memory plan under {limit} bytes "
                                f"({rounds} tried, the smallest {over})")
    return best
