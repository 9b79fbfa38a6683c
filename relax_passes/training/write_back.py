"""Copy a step's new small state over its old tensors in one kernel (``write_back``).

An in-place training step (``AppendOptimizer(inplace=True)``) keeps all of its state in the tensors
it is given: the optimizer update writes over the parameters and slots itself, and the rest (the
step counter, the buffers a batch norm updates, the dropout seed) is copied over the old tensors
by one ``call_tir_inplace`` at the end of the step.  Those values then live in the function's own
memory (not in tensors it returns), so a CUDA graph can hold every kernel that makes them
(``RewriteCUDAGraph`` leaves out kernels that write a function's outputs).

Arguments ``(*dst, *src)``, the sources stored over the destinations, element for element.  The
portable form is serial loops; on CUDA ``ScheduleTIRForGPU`` swaps in ``gpu_primfunc``: one kernel
whose blocks are dealt out to the tensors (``THREADS`` elements a block): the
optimizer update's ``element_loops``.
"""
from __future__ import annotations

import json
import math

from tvm import relax, tirx

from .._rewrite import OPAQUE, emit_call_tir_inplace, static_shape
from .optimizer_update import THREADS, element_loops  # THREADS: elements a block of the GPU form

WRITE_BACK_ATTR = "tvm_evt.write_back"  # [[shape, dtype], ...] of the destinations


def primfunc(specs: list[tuple[tuple[int, ...], str]], gpu: bool = False) -> tirx.PrimFunc:
    """The copy of ``len(specs)`` tensors of (shape, dtype); `gpu`: scheduled as one CUDA kernel."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.script.ir_builder import tirx as T

    numels = [max(1, math.prod(shape)) for shape, _ in specs]
    with IRBuilder() as ib:
        with T.prim_func():
            T.func_name("write_back")
            T.func_attr({"tirx.is_scheduled": True, "tirx.noalias": True} if gpu else {"tirx.noalias": True})
            dst = [T.arg(f"dst{i}", T.buffer(shape, dtype)) for i, (shape, dtype) in enumerate(specs)]
            src = [T.arg(f"src{i}", T.buffer(shape, dtype)) for i, (shape, dtype) in enumerate(specs)]

            def copy(i, e):
                flat = lambda buf: T.decl_buffer((numels[i],), buf.dtype, data=buf.data)
                T.buffer_store(flat(dst[i]), tirx.BufferLoad(flat(src[i]), [e]), [e])

            element_loops(numels, copy, gpu=gpu)
    func = ib.get()
    if gpu:
        return func
    func = func.with_attr("op_pattern", OPAQUE)  # opaque to FuseOps: its GPU form is rebuilt from the attribute
    return func.with_attr(WRITE_BACK_ATTR, json.dumps([[list(shape), dtype] for shape, dtype in specs]))


def gpu_variant(func: tirx.PrimFunc) -> tirx.PrimFunc:
    """The one-kernel CUDA form of a ``write_back`` PrimFunc (one tagged ``WRITE_BACK_ATTR``)."""
    specs = json.loads(str(func.attrs[WRITE_BACK_ATTR]))
    return primfunc([(tuple(shape), dtype) for shape, dtype in specs], gpu=True)


def emit_write_back(bb: relax.BlockBuilder, old: list, new: list) -> list:
    """Emit the copy of each `new` value over its `old` tensor; the written tensors (aliases of
    `old`), one var each."""
    if not old:
        return []
    for o, n in zip(old, new):
        if static_shape(o) != static_shape(n) or str(o.ty.dtype) != str(n.ty.dtype):
            raise ValueError(f"write_back: {n.name} is {n.ty}, the tensor it overwrites "
                             f"({o.name}) {o.ty}")
    gv = bb.add_func(primfunc([(static_shape(o), str(o.ty.dtype)) for o in old]), "write_back")
    return emit_call_tir_inplace(bb, gv, list(old) + list(new), list(range(len(old))), [o.ty for o in old])
