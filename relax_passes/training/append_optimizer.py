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
With ``weight_copies``, a float32 parameter the step casts to bf16 or fp16 (a GEMM's weight under
mixed precision) is kept as that copy too: train_step takes the copies after the step counter (and
the loss scaler's state), reads them where it cast the parameter, and returns the new ones, which
the optimizer update writes as it writes the parameter (``emit_update``), before the next seed::

    train_step(..., step[, scale, tracker], *copies) -> (..., new_step[, new_scale, new_tracker], *new_copies[, next_seed])

The copies are the parameters' casts as the step made them (the gradients still flow to the
float32 parameters through the casts' adjoints): the step computes what it computed without them,
minus a read of four bytes and a write of two an element a step, the cast kernels'.  The caller
makes the first copies (``TrainingStep``) and makes them again when it replaces a parameter.
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
    copies: tuple[tuple[int, str], ...] = ()  # (parameter index, dtype) of each weight copy, in order

    @property
    def num_slot_tensors(self) -> int:
        return len(self.slots) * self.num_params


def _c(value: float) -> relax.Constant:
    return relax.const(value, "float32")


ASTYPE = tvm.ir.Op.get("relax.astype")
COPY_DTYPES = ("bfloat16", "float16")
# ops that only move or select values, whose first argument is the data: a cast after them is the
# same value as the cast before them (a linear layer's weight is cast after its transpose)
MOVES = tuple(tvm.ir.Op.get(f"relax.{name}") for name in ("permute_dims", "reshape", "strided_slice",
                                                           "expand_dims", "squeeze"))


def _moved_from(var, value_of) -> tuple:
    """(the value a chain of ``MOVES`` ending at `var` starts from, the chain's calls first to last)."""
    chain = []
    value = value_of(var)
    while isinstance(value, relax.Call) and value.op in MOVES and isinstance(value.args[0], relax.Var):
        chain.append(value)
        var = value.args[0]
        value = value_of(var)
    return var, chain[::-1]


def copied_parameters(func: relax.Function, params: list) -> list[tuple[int, str]]:
    """(index, dtype) of the float32 parameters among `params` that `func` casts, directly or after
    ``MOVES``, to one of ``COPY_DTYPES``, and to that one alone (a weight copy each)."""
    values = {b.var: b.value for block in func.body.blocks for b in block.bindings}
    casts: dict = {}

    def visit(e) -> None:
        if isinstance(e, relax.Call) and e.op == ASTYPE and isinstance(e.args[0], relax.Var):
            source, _ = _moved_from(e.args[0], values.get)
            casts.setdefault(source, set()).add(str(e.attrs.dtype))

    relax.analysis.post_order_visit(func.body, visit)
    found = []
    for i, p in enumerate(params):
        dtypes = casts.get(p, set())
        if str(p.ty.dtype) == "float32" and len(dtypes) == 1 and next(iter(dtypes)) in COPY_DTYPES:
            found.append((i, next(iter(dtypes))))
    return found


@relax.expr_functor.mutator
class _ReadCopies(relax.expr_functor.PyExprMutator):
    """``astype(M(p), dtype)`` of a parameter with a copy, ``M`` a chain of ``MOVES`` (or none),
    becomes ``M(copy)``."""

    def __init__(self, copies: dict):
        super().__init__()
        self.copies = copies  # parameter var -> copy var

    def visit_call_(self, call):
        call = super().visit_call_(call)
        if call.op != ASTYPE or not isinstance(call.args[0], relax.Var):
            return call
        source, chain = _moved_from(call.args[0], self.lookup_binding)  # None for a function parameter
        copy = self.copies.get(source)
        if copy is None or str(call.attrs.dtype) != str(copy.ty.dtype):
            return call
        value = copy
        for k, move in enumerate(chain):
            moved = relax.Call(move.op, [value, *move.args[1:]], move.attrs)
            value = moved if k == len(chain) - 1 else self.builder_.emit(moved)
        return value


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
                 inplace: bool = False, overwrites: list[int] | None = None, weight_copies: bool = False):
        if inplace and loss_scale is not None:
            raise ValueError("AppendOptimizer: an in-place update cannot be skipped on an overflow (dynamic loss "
                             "scaling keeps the old parameters); use inplace=False with fp16")
        self.optimizer = optimizer
        self.num_params = num_params
        self.loss_scale = loss_scale
        self.inplace = inplace
        self.overwrites = list(overwrites or [])  # inplace: the rest argument each new buffer overwrites
        self.weight_copies = weight_copies  # keep each parameter the step casts to bf16/fp16 as that copy
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
            copies=tuple(copied_parameters(adj, params)) if self.weight_copies else (),
        )

        fresh = lambda v, name=None: relax.Var(name or v.name, v.ty)
        step_args = [fresh(v) for v in main_args]
        slot_vars = {
            slot: [fresh(p, f"{slot}.{p.name}") for p in params] for slot in slots
        }
        scalar = relax.TensorType((), "float32")
        step = relax.Var("step", scalar)
        scaler = [relax.Var("scale", scalar), relax.Var("growth_tracker", scalar)] if scaled else []
        copy_vars = [None] * n_p
        for i, dtype in self.layout.copies:
            copy_vars[i] = relax.Var(f"{dtype}.{params[i].name}", relax.TensorType(params[i].ty.shape, dtype))
        copies = [v for v in copy_vars if v is not None]
        all_args = step_args + [v for slot in slots for v in slot_vars[slot]] + [step] + scaler + copies

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
                    new_params, new_slots, new_copies = emit_update(bb, self.optimizer, p_vars, grads, slot_vars,
                                                                    new_step, copies=copy_vars)
                    new_slot_list = [v for s in slots for v in new_slots[s]]
                    if scaled:
                        found_inf = self._found_inf(bb, grads)
                        keep = lambda old, new: bb.emit(R.where(found_inf, old, new))
                        new_params = [keep(o, n) for o, n in zip(p_vars, new_params)]
                        old_slots = [v for s in slots for v in slot_vars[s]]
                        new_slot_list = [keep(o, n) for o, n in zip(old_slots, new_slot_list)]
                        new_copies = [keep(o, n) for o, n in zip(copies, new_copies)]
                        new_step = keep(step, new_step)
                        extra = self._update_scaler(bb, found_inf, *scaler) + extra
                    extra = extra[:-1] + new_copies + extra[-1:] if self.layout.advances_seed else extra + new_copies
                    out = bb.emit_output(relax.Tuple([loss, *new_params, *new_bufs, *new_slot_list, new_step, *extra]))
            if self.inplace:
                # after the dataflow block, which passes may reorder: no reader of the old state
                # can move past the calls that write over it
                new_params, new_slots, new_copies = emit_update(bb, self.optimizer, p_vars, grads, slot_vars,
                                                                new_step, inplace=True, copies=copy_vars)
                rest = step_args[n_in + n_p:]
                if len(self.overwrites) != len(new_bufs):
                    raise ValueError(f"AppendOptimizer(inplace=True): {len(new_bufs)} new buffers but "
                                     f"{len(self.overwrites)} positions to write them to (overwrites)")
                old = [step] + [rest[k] for k in self.overwrites] + ([seed] if self.layout.advances_seed else [])
                written = emit_write_back(bb, old, [new_step, *new_bufs, *extra])
                new_step, new_bufs, extra = written[0], written[1:1 + len(new_bufs)], written[1 + len(new_bufs):]
                new_slot_list = [v for s in slots for v in new_slots[s]]
                extra = extra[:-1] + new_copies + extra[-1:] if self.layout.advances_seed else extra + new_copies
                out = bb.emit(relax.Tuple([loss, *new_params, *new_bufs, *new_slot_list, new_step, *extra]))
            bb.emit_func_output(out)
        mod = bb.get()
        gv = mod.get_global_var("train_step")
        step_func = mod[gv].inline_functions({adj_gv: adj})
        if copies:  # the inlined adjoint's casts of those parameters read their copies
            step_func = _ReadCopies({p: c for p, c in zip(step_func.params[n_in:n_in + n_p], copy_vars)
                                     if c is not None}).visit_expr(step_func)
        mod[gv] = step_func
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
