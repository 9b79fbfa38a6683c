"""Every parameter's optimizer update as one kernel (torch's "multi-tensor apply", fused).

An optimizer's update is elementwise per parameter (``optimizers.*.elementwise``).  Emitted as
Relax ops it became three kernels per parameter under AdamW: ``FuseOps`` cannot fuse the new
moments into the parameter's update because they are step outputs too, so the parameter kernel
read them back (10 tensors of traffic where 7 suffice), and a model with n parameters spent 3n
launches, most on biases and norm weights of a few thousand elements: on BERT-Large's layer the
GPU sat idle between those small kernels while the host launched the next one.

``emit_update`` emits one ``call_tir`` of one PrimFunc over all parameters:

* the portable form (``update_primfunc``) is one TE compute per output, for any target (a plain
  TVM CUDA build schedules each as a kernel of its own);
* on CUDA, ``ScheduleTIRForGPU`` swaps in ``gpu_primfunc``: ONE kernel whose blocks are dealt
  out to the parameters (``ELEMS_PER_BLOCK`` elements a block, each thread's loads coalesced),
  each thread reading p, g and the slots of an element once and writing the new ones once.

A parameter that the step reads as a bf16/fp16 copy (``copies``: ``AppendOptimizer`` with
``weight_copies``) also has that copy written by the update, from the new value it has in
registers: the next step's GEMMs read it instead of casting the float32 parameter again (a read of
four bytes an element and a write of two, a kernel a weight, for two more bytes written here).

The PrimFunc's attributes carry the optimizer and the shapes, so the GPU form is rebuilt from the
portable one (``gpu_variant``) as ``philox.gpu_variant`` does for the dropout masks.

A model of more than ``MAX_KERNEL_PARAMS`` parameters gets one kernel a repeat of its layers
instead (``kernel_groups``): TVM compiles one kernel over n parameters in time quadratic in n (TIR's
``CommonSubexprElim`` and ``LowerIntrin`` over its body, LLVM over the host function that unpacks
its 4n + 1 buffers): an in-place AdamW update of BERT-Large's 24 layers (384 parameters) took 101 s
to build on 2 cores, against 2 s for the step's other 71 TVM kernels.  Equal groups are
structurally equal PrimFuncs, which ``BlockBuilder.add_func`` adds once: BERT-Large's step holds
three update kernels (embeddings, a layer, the last norm and the head) whatever its depth, and
launches 26 (one a layer), each still a whole layer's parameters (not yet timed on a GPU against
the one kernel).

``emit_update(..., inplace=True)`` emits a ``call_tir_inplace`` instead: the kernel writes the new
parameters and slots over the old ones (each element's old values are bound to variables before
any new one is stored: SGD's momentum reads the parameter), so a step keeps its state in the same
tensors, as a captured CUDA graph needs, and holds one copy of it, not two.  Its portable form is
the same loop nest as the GPU form, serial.
"""
from __future__ import annotations

import dataclasses
import json
import math

from tvm import relax, te, tirx

from . import optimizers
from .._rewrite import OPAQUE, emit_call_tir, emit_call_tir_inplace

OPTIMIZER_ATTR = "tvm_evt.optimizer"  # {"type": class name, "fields": {...}}
PARAMS_ATTR = "tvm_evt.optimizer_params"  # [[shape, dtype, gradient dtype, copy dtype or null], ...]
INPLACE_ATTR = "tvm_evt.optimizer_inplace"  # the update writes over the parameters and slots
THREADS = 256
PER_THREAD = 4  # elements a thread updates, THREADS apart (coalesced)
ELEMS_PER_BLOCK = THREADS * PER_THREAD
FLOAT32 = "float32"
MAX_KERNEL_PARAMS = 64  # an update of more parameters is split (``kernel_groups``)
MIN_REPEAT_PARAMS = 8  # parameters of the shortest repeat ``kernel_groups`` makes a kernel of


def _to_attr(optimizer) -> str:
    return json.dumps({"type": type(optimizer).__name__, "fields": dataclasses.asdict(optimizer)}, sort_keys=True)


def _from_attr(text: str):
    spec = json.loads(text)
    cls = getattr(optimizers, spec["type"])
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["fields"].items()}
    return cls(**fields)


def _f32(x, dtype: str):
    return x if dtype == FLOAT32 else tirx.Cast(FLOAT32, x)


def _as(x, dtype: str):
    return x if dtype == FLOAT32 else tirx.Cast(dtype, x)


def _element(optimizer, slots, p, g, state, step, dtype: str, grad_dtype: str):
    """(new p, [new slots]) of one element, in ``dtype`` (the parameter's and its slots'),
    computed in float32."""
    new_p, new_state = optimizer.elementwise(_f32(p, dtype), _f32(g, grad_dtype),
                                             {s: _f32(state[s], dtype) for s in slots}, step)
    return _as(new_p, dtype), [_as(new_state[s], dtype) for s in slots]


def _copies(params, copies) -> list:
    """The copy dtype of each parameter (None: no copy)."""
    return list(copies) if copies is not None else [None] * len(params)


def update_primfunc(optimizer, params: list[tuple[tuple[int, ...], str]], grad_dtypes=None,
                    copies=None) -> tirx.PrimFunc:
    """Arguments ``(*p, *g, *slots (slot-major), step, *new_p, *new_slots (slot-major), *new
    copies)``; params are (shape, dtype); a gradient has its parameter's shape and dtype unless
    ``grad_dtypes`` says; ``copies``: each parameter's copy dtype, or None (module docstring)."""
    slots = optimizer.slots()
    grad_dtypes = list(grad_dtypes or [dtype for _, dtype in params])
    copies = _copies(params, copies)
    ps = [te.placeholder(shape, dtype, f"p{i}") for i, (shape, dtype) in enumerate(params)]
    gs = [te.placeholder(shape, gd, f"g{i}") for i, ((shape, _), gd) in enumerate(zip(params, grad_dtypes))]
    states = {s: [te.placeholder(shape, dtype, f"{s}{i}") for i, (shape, dtype) in enumerate(params)]
              for s in slots}
    step = te.placeholder((), FLOAT32, "step")
    new_p, new_slots = [], {s: [] for s in slots}

    def output(i, dtype, k):  # output k (0: the parameter, then the slots) of parameter i
        def fcompute(*idx):
            p, state = _element(optimizer, slots, ps[i](*idx), gs[i](*idx), {s: states[s][i](*idx) for s in slots},
                                step(), dtype, grad_dtypes[i])
            return [p, *state][k]

        return fcompute

    # one compute (one loop nest of one block) an output: DLight's default GPU schedule, which
    # a plain TVM CUDA build applies, takes that and not a nest of several blocks
    for i, (shape, dtype) in enumerate(params):
        new_p.append(te.compute(shape, output(i, dtype, 0), name=f"new_p{i}"))
        for k, s in enumerate(slots):
            new_slots[s].append(te.compute(shape, output(i, dtype, k + 1), name=f"new_{s}{i}"))

    def copy(i, dtype, c):  # the new parameter i, cast to c
        new = output(i, dtype, 0)
        return lambda *idx: tirx.Cast(c, new(*idx))

    new_copies = [te.compute(shape, copy(i, dtype, c), name=f"copy{i}")
                  for i, ((shape, dtype), c) in enumerate(zip(params, copies)) if c is not None]
    args = ps + gs + [t for s in slots for t in states[s]] + [step] + new_p + [t for s in slots for t in new_slots[s]]
    func = te.create_prim_func(args + new_copies).without_attr("global_symbol")  # the module names it
    # opaque to FuseOps: a producer fused into it would make a new PrimFunc without the attributes
    # the GPU form is rebuilt from (and AnnotateTIROpPattern keeps a pattern already set)
    return _attrs(func.with_attr("op_pattern", OPAQUE), optimizer, params, grad_dtypes, copies, inplace=False)


def _attrs(func: tirx.PrimFunc, optimizer, params, grad_dtypes, copies, inplace: bool) -> tirx.PrimFunc:
    """`func` tagged with what its GPU form is rebuilt from (``gpu_variant``)."""
    func = func.with_attr(OPTIMIZER_ATTR, _to_attr(optimizer))
    func = func.with_attr(PARAMS_ATTR, json.dumps([[list(shape), dtype, gd, c] for (shape, dtype), gd, c
                                                   in zip(params, grad_dtypes, copies)]))
    return func.with_attr(INPLACE_ATTR, True) if inplace else func


def loop_primfunc(optimizer, params: list[tuple[tuple[int, ...], str]], grad_dtypes=None, copies=None, *,
                  gpu: bool, inplace: bool = False) -> tirx.PrimFunc:
    """The update as explicit loops over each parameter's flat elements.  Arguments: those of
    ``update_primfunc``, or, `inplace`, ``(*p, *g, *slots (slot-major), step, *copies)`` with the
    new values stored over p, the slots and the copies.  `gpu`: scheduled for CUDA as one kernel
    (parameter i owns blocks [start_i, start_i + ceil(numel_i / ELEMS_PER_BLOCK)); thread t of a
    block updates its elements t, t + THREADS, ..., PER_THREAD of them); else serial loops, a
    portable form."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    slots = optimizer.slots()
    grad_dtypes = list(grad_dtypes or [dtype for _, dtype in params])
    copies = _copies(params, copies)
    numels = [math.prod(shape) for shape, _ in params]
    idx = "int64" if max(numels) >= 2**31 - ELEMS_PER_BLOCK else "int32"
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("optimizer_update")
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True} if gpu else {"tirx.noalias": True})

            def args(prefix, dtypes=None):
                dtypes = dtypes or [dtype for _, dtype in params]
                return [T.arg(f"{prefix}{i}", T.buffer(shape, dt)) for i, ((shape, _), dt) in enumerate(zip(params, dtypes))]

            ps, gs = args("p"), args("g", grad_dtypes)
            states = {s: args(s) for s in slots}
            step = T.arg("step", T.buffer((), FLOAT32))
            new_p = ps if inplace else args("new_p")
            new_states = states if inplace else {s: args(f"new_{s}") for s in slots}
            copy = {i: T.arg(f"copy{i}", T.buffer(shape, c)) for i, ((shape, _), c) in enumerate(zip(params, copies))
                    if c is not None}

            def update(i, dtype, numel, e):
                """Element e of parameter i: every value read, then the new ones stored (in place,
                each read is bound to a variable first: an expression would read the store before it)."""
                flat = lambda buf: T.decl_buffer((numel,), buf.dtype, data=buf.data)

                def load(buf):
                    value = tirx.BufferLoad(flat(buf), [e])
                    return T.bind(value) if inplace else value

                value, values = _element(optimizer, slots, load(ps[i]), load(gs[i]),
                                         {s: load(states[s][i]) for s in slots},
                                         tirx.BufferLoad(step, []), dtype, grad_dtypes[i])
                if i in copy:  # the value bound once: the parameter's store and its copy's read it
                    value = T.bind(value)
                T.buffer_store(flat(new_p[i]), value, [e])
                for s, v in zip(slots, values):
                    T.buffer_store(flat(new_states[s][i]), v, [e])
                if i in copy:
                    T.buffer_store(flat(copy[i]), tirx.Cast(copies[i], value), [e])

            element_loops(numels, lambda i, e: update(i, params[i][1], numels[i], e), gpu=gpu, idx=idx,
                          per_thread=PER_THREAD)
    func = ib.get().without_attr("global_symbol")  # the module names it: a deep model's has several
    return func if gpu else _attrs(func.with_attr("op_pattern", OPAQUE), optimizer, params, grad_dtypes, copies,
                                   inplace)


def element_loops(numels: list[int], body, *, gpu: bool, idx: str = "int32", per_thread: int = 1) -> None:
    """Inside an IRBuilder PrimFunc: ``body(i, e)`` for every flat element e of tensor i.  `gpu`:
    one CUDA kernel, whose blocks are dealt out to the tensors (tensor i owns blocks [start_i,
    start_i + ceil(numel_i / (THREADS * per_thread)))) and whose thread t of a block takes its
    elements t, t + THREADS, ... (per_thread of them); else serial loops, a portable form."""
    from tvm.script.ir_builder import tirx as T

    if not gpu:
        for i, numel in enumerate(numels):
            with T.serial(tirx.const(0, idx), tirx.const(numel, idx)) as e:
                body(i, e)
        return
    per_block = THREADS * per_thread
    blocks = [(m + per_block - 1) // per_block for m in numels]
    starts = [sum(blocks[:i]) for i in range(len(blocks))]
    with T.thread_binding(tirx.const(sum(blocks), idx), thread="blockIdx.x") as bx:
        with T.thread_binding(tirx.const(THREADS, idx), thread="threadIdx.x") as tx:
            for i, numel in enumerate(numels):
                lo, hi = tirx.const(starts[i], idx), tirx.const(starts[i] + blocks[i], idx)
                with T.If(tirx.all(lo <= bx, bx < hi)):
                    with T.Then():
                        for j in range(per_thread):
                            e = (bx - lo) * per_block + j * THREADS + tx
                            with T.If(e < numel):
                                with T.Then():
                                    body(i, e)


def gpu_primfunc(optimizer, params: list[tuple[tuple[int, ...], str]], grad_dtypes=None,
                 copies=None) -> tirx.PrimFunc:
    """``update_primfunc``'s arguments, scheduled for CUDA as one kernel (``loop_primfunc``)."""
    return loop_primfunc(optimizer, params, grad_dtypes, copies, gpu=True)


def gpu_variant(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The one-kernel CUDA form of an update PrimFunc (one tagged ``OPTIMIZER_ATTR``), in place
    where it is."""
    specs = json.loads(str(func.attrs[PARAMS_ATTR]))
    return loop_primfunc(_from_attr(str(func.attrs[OPTIMIZER_ATTR])), [(tuple(spec[0]), spec[1]) for spec in specs],
                         [spec[2] for spec in specs], [spec[3] for spec in specs], gpu=True,
                         inplace=INPLACE_ATTR in func.attrs)


def kernel_groups(keys: list) -> list[tuple[int, int]]:
    """The [start, stop) runs of parameters (`keys`: one hashable description a parameter, its
    shape and dtypes) that each get a kernel of their own: all of them while there are at most
    ``MAX_KERNEL_PARAMS``; else the longest run that repeats (a layer, or several: at least
    ``MIN_REPEAT_PARAMS`` parameters) one group a repeat, and what comes before and after it grouped
    the same way (a part where nothing repeats in runs of at most ``MAX_KERNEL_PARAMS``)."""
    n = len(keys)
    if n <= MAX_KERNEL_PARAMS:
        return [(0, n)] if n else []
    start, period, count = _longest_repeat(keys)
    if count < 2:  # nothing repeats: runs of at most MAX_KERNEL_PARAMS
        parts = -(-n // MAX_KERNEL_PARAMS)
        cuts = [n * k // parts for k in range(parts + 1)]
        return list(zip(cuts, cuts[1:]))
    stop = start + period * count
    shift = lambda groups, by: [(a + by, b + by) for a, b in groups]
    return (kernel_groups(keys[:start]) + [(start + k * period, start + (k + 1) * period) for k in range(count)]
            + shift(kernel_groups(keys[stop:]), stop))


def _longest_repeat(keys: list) -> tuple[int, int, int]:
    """(start, period, count) of the run ``keys[start : start + period * count]`` made of `count`
    copies of its first `period` keys that covers the most keys (`period` at least
    ``MIN_REPEAT_PARAMS``; the shortest period on a tie, then the first start); count 1 where none
    repeats."""
    best, covered = (0, len(keys), 1), 0
    for period in range(MIN_REPEAT_PARAMS, len(keys) // 2 + 1):
        run = 0  # keys[i - run : i] each equal the key `period` after them
        for i in range(len(keys) - period + 1):
            if i < len(keys) - period and keys[i] == keys[i + period]:
                run += 1
                continue
            count = (run + period) // period  # the periodic stretch ending before i + period
            if count >= 2 and count * period > covered:
                best, covered = (i - run, period, count), count * period
            run = 0
    return best


def emit_update(bb: relax.BlockBuilder, optimizer, params, grads, state: dict, step,
                inplace: bool = False, copies: list | None = None) -> tuple[list, dict, list]:
    """Emit the update of every parameter as one ``call_tir`` a group of ``kernel_groups``
    (`inplace`: ``call_tir_inplace`` over the parameters, slots and copies): (new params, {slot:
    new tensors}, new copies).  `copies`: for each parameter its low-precision copy (a Relax var,
    the tensor an in-place update writes over; its dtype the copy's) or None; a new copy a
    parameter that has one (module docstring)."""
    slots = optimizer.slots()
    copies = _copies(params, copies)
    if not params:
        return [], {s: [] for s in slots}, []
    specs = []
    for p, g in zip(params, grads):
        shape = tuple(int(d) for d in p.ty.shape.values)
        if tuple(int(d) for d in g.ty.shape.values) != shape:
            raise ValueError(f"optimizer update: the gradient of {p.name} has shape {g.ty}, its parameter {p.ty}")
        specs.append((shape, str(p.ty.dtype)))
    grad_dtypes = [str(g.ty.dtype) for g in grads]
    copy_dtypes = [str(c.ty.dtype) if c is not None else None for c in copies]
    new_params, new_state, new_copies = [], {s: [] for s in slots}, []
    for start, stop in kernel_groups([(*spec, gd, c) for spec, gd, c in zip(specs, grad_dtypes, copy_dtypes)]):
        group = slice(start, stop)
        func = (loop_primfunc(optimizer, specs[group], grad_dtypes[group], copy_dtypes[group], gpu=False, inplace=True)
                if inplace else update_primfunc(optimizer, specs[group], grad_dtypes[group], copy_dtypes[group]))
        gv = bb.add_func(func, "optimizer_update")  # a group equal to one added before: that one's var
        copied = [c for c in copies[group] if c is not None]
        out_ty = [p.ty for p in params[group]] * (1 + len(slots)) + [c.ty for c in copied]
        args = list(params[group]) + list(grads[group]) + [t for s in slots for t in state[s][group]] + [step]
        n = stop - start
        if inplace:  # the outputs are p, the slots and the copies: arguments 0..n-1, 2n.. and after step
            indices = list(range(n)) + list(range(2 * n, 2 * n + n * len(slots)))
            indices += list(range(len(args), len(args) + len(copied)))
            outs = emit_call_tir_inplace(bb, gv, args + copied, indices, out_ty)
        else:
            outs = emit_call_tir(bb, gv, args, out_ty)
        new_params += outs[:n]
        for k, s in enumerate(slots):
            new_state[s] += outs[n * (1 + k): n * (2 + k)]
        new_copies += outs[n * (1 + len(slots)):]
    return new_params, new_state, new_copies
