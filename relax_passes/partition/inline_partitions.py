"""InlineEVTPartitions: every ``Codegen="evt"`` call replaced by the ops of its composite function.

The CPU reference route: TVM then lowers those ops like any others, so CI checks on the CPU that the
partitioned training graph computes the same values as the unpartitioned one.
"""
from __future__ import annotations

import tvm
from tvm import relax

from .._rewrite import local_composite, substitute
from .partition_evt import CODEGEN
def _composite(func: relax.Function) -> relax.Function:
    """The Composite function an evt partition wraps."""
    found = local_composite(func)
    return found[0].value if found else func


@tvm.transform.module_pass(opt_level=0, name="InlineEVTPartitions")
class InlineEVTPartitions:
    """Replace each call of a ``Codegen="evt"`` function by the ops of its composite function and
    drop the partition functions: TVM then lowers those ops like any others.  `only`: the names
    of the partitions to inline (default: all)."""

    def __init__(self, only: set[str] | None = None):
        self.only = only

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        parts = {gv: f for gv, f in mod.functions_items()
                 if isinstance(f, relax.Function) and f.attrs and f.attrs.get("Codegen") == CODEGEN
                 and (self.only is None or gv.name_hint in self.only)}
        if not parts:
            return mod
        bb = relax.BlockBuilder(mod)
        for gv, func in mod.functions_items():
            if isinstance(func, relax.Function) and gv not in parts:
                bb.update_func(gv, self._inline(bb, func, parts))
        out = bb.get()
        for gv in parts:
            out = _remove(out, gv)
        return relax.transform.Normalize()(out)

    @staticmethod
    def _inline(bb, func, parts) -> relax.Function:
        if not isinstance(func.body, relax.SeqExpr):
            return func
        blocks = []
        for block in func.body.blocks:
            bindings = []
            for b in block.bindings:
                value = getattr(b, "value", None)
                if not (isinstance(value, relax.Call) and value.op in parts):
                    bindings.append(b)
                    continue
                inner = _composite(parts[value.op])
                vmap = dict(zip(inner.params, value.args))
                for ib in inner.body.blocks[0].bindings:
                    new_var = relax.DataflowVar(ib.var.name, ib.var.ty)
                    bindings.append(relax.VarBinding(new_var, bb.normalize(substitute(ib.value, vmap))))
                    vmap[ib.var] = new_var
                bindings.append(relax.VarBinding(b.var, bb.normalize(substitute(inner.body.body, vmap))))
            cls = relax.DataflowBlock if isinstance(block, relax.DataflowBlock) else relax.BindingBlock
            blocks.append(cls(bindings))
        body = relax.SeqExpr(blocks, func.body.body)
        return relax.Function(func.params, body, func.ret_ty, func.is_pure, func.attrs)


def _remove(mod: tvm.IRModule, gv) -> tvm.IRModule:
    funcs = {g: f for g, f in mod.functions_items() if not g.same_as(gv)}
    return tvm.IRModule(funcs, attrs=mod.attrs)
