"""AppendOptimizer: fuse the optimizer update into one ``train_step`` function.

Input: a module whose ``main_adjoint`` (from ``relax.transform.Gradient``) maps
``(*inputs, *params, *rest)`` to ``((loss, *new_buffers), (*grads,))``.  ``rest`` holds
buffers, the dropout seed and, when the graph scales its loss (`ScaleLoss`), a trailing
``loss_scale`` parameter.

Output: the module plus

    train_step(*inputs, *params, *rest_without_loss_scale, *slots, step[, scale, tracker])
        -> (loss, *new_params, *new_buffers, *new_slots, new_step[, new_scale, new_tracker][, next_seed])

where ``slots`` are the optimizer's state tensors (slot-major: all ``exp_avg`` first), ``step``
counts updates (fp32 scalar), and ``scale``/``tracker`` are the dynamic loss scaler's state.
A graph with dropout (`LowerDropout`'s ``rng_seed = (seed, counter)``) also returns the next
step's seed, counter + 1: the state stays on the device, so a step never waits on a host copy.
The adjoint is inlined, so forward, backward and update form one dataflow graph; the update of
every parameter is one kernel (``optimizer_update``; a deep model's, one a repeat of its layers).
With ``inplace`` that kernel writes over the parameters and slots it is given, one ``write_back``
kernel copies the new step counter, buffers (``overwrites``: the argument after the params each
overwrites) and seed over theirs, and every state result is the tensor it replaces.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import tvm
from tvm import relax
from tvm.relax import op as R

from .lower_dropout import SEED_PARAM
from .optimizer_update import emit_update
from .optimizers import DynamicLossScale
from .write_back import emit_write_back

LOSS_SCALE_PARAM = "loss_scale"


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Where each value sits in train_step's arguments and results."""

    num_inputs: int
    num_params: int
    num_rest: int  # buffers, rng seed (arguments after the params, loss scale excluded)
    num_new_buffers: int
    slots: tuple[str, ...]
    loss_scaling: bool
    advances_seed: bool = False  # the last result is the next rng_seed

    @property
    def num_slot_tensors(self) -> int:
        return len(self.slots) * self.num_params


def _c(value: float) -> relax.Constant:
    return relax.const(value, "float32")


def _added(terms: list) -> relax.Expr:
    """``terms[0] + terms[1] + ...`` (one per parameter: the sums the loss scaler and clipping read)."""
    total = terms[0]
    for term in terms[1:]:
        total = R.add(total, term)
    return total


@tvm.transform.module_pass(opt_level=0, name="AppendOptimizer")
class AppendOptimizer:
    """Add ``train_step`` = forward + backward + `optimizer` update (+ loss scaling)."""

    def __init__(self, optimizer, num_params: int, loss_scale: DynamicLossScale | None = None,
                 inplace: bool = False, overwrites: list[int] | None = None):
        if inplace and loss_scale is not None:
            raise ValueError("AppendOptimizer: an in-place update cannot be skipped on an overflow (dynamic loss "
                             "scaling keeps the old parameters); use inplace=False with fp16")
        self.optimizer = optimizer
        self.num_params = num_params
        self.loss_scale = loss_scale
        self.inplace = inplace
        self.overwrites = list(overwrites or [])  # inplace: the rest argument each new buffer overwrites
        self.layout: StepLayout | None = None

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        adj_gv = mod.get_global_var("main_adjoint")
        adj = mod[adj_gv]
        num_inputs = int(adj.attrs["num_input"])
        args = list(adj.params)
        scaled = bool(args) and args[-1].name == LOSS_SCALE_PARAM
        if scaled != (self.loss_scale is not None):
            raise ValueError("loss scaling requested but the graph has no loss_scale parameter"
                             if self.loss_scale else "graph scales its loss but no scaler given")
        main_args = args[:-1] if scaled else args
        n_in, n_p = num_inputs, self.num_params
        params = main_args[n_in : n_in + n_p]
        out_fields = adj.ret_ty.fields[0].fields
        slots = self.optimizer.slots()
        self.layout = StepLayout(
            num_inputs=n_in,
            num_params=n_p,
            num_rest=len(main_args) - n_in - n_p,
            num_new_buffers=len(out_fields) - 1,
            slots=tuple(slots),
            loss_scaling=scaled,
            advances_seed=any(v.name == SEED_PARAM for v in main_args[n_in + n_p:]),
        )

        fresh = lambda v, name=None: relax.Var(name or v.name, v.ty)
        step_args = [fresh(v) for v in main_args]
        slot_vars = {
            slot: [fresh(p, f"{slot}.{p.name}") for p in params] for slot in slots
        }
        scalar = relax.TensorType((), "float32")
        step = relax.Var("step", scalar)
        scaler = [relax.Var("scale", scalar), relax.Var("growth_tracker", scalar)] if scaled else []
        all_args = step_args + [v for slot in slots for v in slot_vars[slot]] + [step] + scaler

        bb = relax.BlockBuilder(mod)
        with bb.function("train_step", all_args, attrs={"num_input": n_in}):
            with bb.dataflow():
                call_args = step_args + ([scaler[0]] if scaled else [])
                res = bb.emit(relax.Call(adj_gv, call_args))
                outs = bb.emit(relax.TupleGetItem(res, 0))
                grads = bb.emit(relax.TupleGetItem(res, 1))
                loss = bb.emit(relax.TupleGetItem(outs, 0))
                new_bufs = [bb.emit(relax.TupleGetItem(outs, i + 1)) for i in range(self.layout.num_new_buffers)]
                grads = [bb.emit(relax.TupleGetItem(grads, i)) for i in range(n_p)]
                new_step = bb.emit(R.add(step, _c(1.0)))
                if scaled:
                    inv = bb.emit(R.divide(_c(1.0), scaler[0]))
                    loss = bb.emit(R.multiply(loss, inv))
                    grads = [bb.emit(R.multiply(g, inv)) for g in grads]
                if getattr(self.optimizer, "max_grad_norm", None) is not None:
                    grads = self._clip(bb, grads, float(self.optimizer.max_grad_norm))
                p_vars = step_args[n_in : n_in + n_p]
                seed = next((v for v in step_args[n_in + n_p:] if v.name == SEED_PARAM), None)
                extra = []
                if self.layout.advances_seed:
                    extra.append(bb.emit(R.add(seed, relax.const(np.array([0, 1], dtype="uint32")))))
                if self.inplace:  # what the in-place calls after this block read
                    output = lambda values: [bb.emit_output(v) for v in values]
                    (loss, new_step), new_bufs, extra, grads = map(output, ([loss, new_step], new_bufs, extra, grads))
                else:
                    new_params, new_slots = emit_update(bb, self.optimizer, p_vars, grads, slot_vars, new_step)
                    new_slot_list = [v for s in slots for v in new_slots[s]]
                    if scaled:
                        found_inf = self._found_inf(bb, grads)
                        keep = lambda old, new: bb.emit(R.where(found_inf, old, new))
                        new_params = [keep(o, n) for o, n in zip(p_vars, new_params)]
                        old_slots = [v for s in slots for v in slot_vars[s]]
                        new_slot_list = [keep(o, n) for o, n in zip(old_slots, new_slot_list)]
                        new_step = keep(step, new_step)
                        extra = self._update_scaler(bb, found_inf, *scaler) + extra
                    out = bb.emit_output(relax.Tuple([loss, *new_params, *new_bufs, *new_slot_list, new_step, *extra]))
            if self.inplace:
                # after the dataflow block, which passes may reorder: no reader of the old state
                # can move past the calls that write over it
                new_params, new_slots = emit_update(bb, self.optimizer, p_vars, grads, slot_vars, new_step,
                                                    inplace=True)
                rest = step_args[n_in + n_p:]
                if len(self.overwrites) != len(new_bufs):
                    raise ValueError(f"AppendOptimizer(inplace=True): {len(new_bufs)} new buffers but "
                                     f"{len(self.overwrites)} positions to write them to (overwrites)")
                old = [step] + [rest[k] for k in self.overwrites] + ([seed] if self.layout.advances_seed else [])
                written = emit_write_back(bb, old, [new_step, *new_bufs, *extra])
                new_step, new_bufs, extra = written[0], written[1:1 + len(new_bufs)], written[1 + len(new_bufs):]
                new_slot_list = [v for s in slots for v in new_slots[s]]
                out = bb.emit(relax.Tuple([loss, *new_params, *new_bufs, *new_slot_list, new_step, *extra]))
            bb.emit_func_output(out)
        mod = bb.get()
        gv = mod.get_global_var("train_step")
        mod[gv] = mod[gv].inline_functions({adj_gv: adj})
        return mod

    @staticmethod
    def _clip(bb, grads, max_norm: float) -> list:
        """``torch.nn.utils.clip_grad_norm_(params, max_norm)``: every gradient times
        ``min(1, max_norm / (norm + 1e-6))``, the norm the 2-norm over all of them (in float32).
        A non-finite gradient makes them all NaN, as in torch; a loss scaler skips that step."""
        as32 = lambda g: g if g.ty.dtype == "float32" else R.astype(g, "float32")  # noqa: E731
        norm = bb.emit(R.sqrt(_added([R.sum(R.multiply(as32(g), as32(g))) for g in grads])))
        coef = bb.emit(R.minimum(R.divide(_c(max_norm), R.add(norm, _c(1e-6))), _c(1.0)))
        return [bb.emit(R.multiply(g, coef if g.ty.dtype == "float32" else R.astype(coef, g.ty.dtype)))
                for g in grads]

    @staticmethod
    def _found_inf(bb, grads):
        bad = [R.sum(R.astype(R.logical_not(R.isfinite(g)), "float32")) for g in grads]
        return bb.emit(R.greater(_added(bad), _c(0.0)))

    def _update_scaler(self, bb, found_inf, scale, tracker):
        cfg = self.loss_scale
        grown = bb.emit(R.add(tracker, _c(1.0)))
        grow = bb.emit(R.greater_equal(grown, _c(float(cfg.growth_interval))))
        new_scale = bb.emit(
            R.where(
                found_inf,
                R.multiply(scale, _c(cfg.backoff_factor)),
                R.where(grow, R.multiply(scale, _c(cfg.growth_factor)), scale),
            )
        )
        new_tracker = bb.emit(R.where(found_inf, _c(0.0), R.where(grow, _c(0.0), grown)))
        return [new_scale, new_tracker]
