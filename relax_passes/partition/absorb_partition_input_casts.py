"""AbsorbPartitionInputCasts: an ``astype`` that only feeds an evt partition's epilogue moves into it.

The partitioner grows each epilogue downstream from its GEMM, so a cast on the way *into* the
epilogue stays outside as its own TVM kernel: the float32 residual input cast to bf16 before the
output projection's epilogue reads it, or, on BERT-Large, a [32, 512, 1024] copy of each (0.065 ms
on H100, reading 64 MB and writing 32 MB that the epilogue then reads again).  Inside the partition
the cast is free: the epilogue loads the tensor as it is and converts in registers.  So for each
call of a ``Codegen="evt"`` function and each argument bound to ``astype(x, t)``

* read by nothing but this call (once), and
* inside the partition read only by elementwise epilogue ops (never by the GEMM, a layout op or
  a reduction's operand side),

the partition takes ``x`` and casts it itself.  A comparison of ``x`` with a scalar constant
(``MASKS``: the ReLU gradient's ``greater(y, 0)``) is absorbed the same way: ResNet-50's stage wrote
each ReLU mask as a bool tensor in a kernel of its own (0.17 ms for a [100352, 512] mask on H100)
for one backward epilogue to read; the epilogue now loads ``y`` and compares it.  So is a
``logical_and`` / ``logical_or`` of such comparisons of one tensor (``CONNECTIVES``), each read by
nothing else: the gradient of a clamp (ReLU6, hardtanh, hard-sigmoid) selects by
``logical_and(greater(y, lo), less(y, hi))``, and MobileNetV2 wrote 18 such masks a step
(0.25 ms on H200) for the epilogues of its projections' input gradients.  The new
partition must pass the code generator's legality check (dtype rules of the epilogue loads,
its compare ops), else the call stays as it was.  The ops and their order are unchanged, so the
numbers are too.  Calls of one partition share a rewritten copy only where what they absorb is
the same (ops, constants, dtypes).
"""

from __future__ import annotations

import tvm
from tvm import relax

from .._rewrite import (MASK_COMPARISONS, MASK_CONNECTIVES, binding_uses, drop_uncalled, flat_bindings, local_composite,
                        op_name, sub_expressions, substitute)

ASTYPE = tvm.ir.Op.get("relax.astype")
MASKS = frozenset(tvm.ir.Op.get(f"relax.{n}") for n in MASK_COMPARISONS)
CONNECTIVES = frozenset(tvm.ir.Op.get(f"relax.{n}") for n in MASK_CONNECTIVES)
CODEGEN = "evt"
# inner ops that read the GEMM's operands or move data: a cast feeding them stays outside
NOT_EPILOGUE = frozenset({"relax.matmul", "relax.permute_dims", "relax.reshape"})


def _epilogue_only(inner: relax.Function, param: relax.Var) -> bool:
    """Is `param` read inside the composite only by elementwise/epilogue ops?"""
    readers = [b.value for b in flat_bindings(inner)[0]
               if isinstance(b.value, relax.Call) and any(a.same_as(param) for a in b.value.args)]
    return bool(readers) and all(op_name(r) not in NOT_EPILOGUE | {None} for r in readers)


def _scalar_const(e) -> bool:
    return isinstance(e, tvm.ir.GenericConst) and e.value.numpy().size == 1


def _absorbed(var, bound: dict, uses: dict, index: dict, reader: int):
    """(the tensor ``x``, the bindings computing `var` from it, in order) where `var` is
    ``astype(x, t)``, ``x`` compared with a scalar constant (``MASKS``), or a connective
    (``CONNECTIVES``) of such comparisons of one ``x``, each binding read by nothing but the
    next one up (`var` by binding `reader`); else None."""
    call = bound.get(var)
    if not isinstance(call, relax.Call) or uses.get(var) != [reader]:
        return None
    if call.op == ASTYPE or (call.op in MASKS and len(call.args) == 2 and _scalar_const(call.args[1])):
        return call.args[0], [(var, call)]
    if call.op in CONNECTIVES:
        parts = [_absorbed(a, bound, uses, index, index[var]) for a in call.args]
        if None in parts or any(not x.same_as(parts[0][0]) for x, _ in parts):
            return None
        return parts[0][0], [b for _, chain in parts for b in chain] + [(var, call)]
    return None


def _describe(x, chain) -> tuple:
    """What a rewritten partition bakes in for one absorbed argument: the source's type and each
    op with its attributes and constants (bindings named by position)."""
    names = {x: "x", **{v: i for i, (v, _) in enumerate(chain)}}

    def arg(a):
        return ("const", a.value.numpy().item()) if _scalar_const(a) else names[a]

    return (str(x.ty),) + tuple((call.op.name, str(call.attrs), tuple(arg(a) for a in call.args))
                                for _, call in chain)


def _with_cast_params(outer: relax.Function, casts: dict) -> relax.Function:
    """`outer` taking, at each parameter index in `casts` (index -> (the tensor ``x``, the
    absorbed bindings computing the argument from it)), the tensor ``x`` and computing the
    argument from it in the composite right before its first reader (after the GEMM, where the
    code generator knows the tile the operand is laid over)."""
    local, call = local_composite(outer)
    inner = local.value
    bb = relax.BlockBuilder()
    new_inner_params = list(inner.params)
    vmap, pending = {}, {}
    for i, (x, chain) in casts.items():
        old = inner.params[i]
        new = relax.Var(old.name, x.ty)
        new_inner_params[i] = new
        made, computed = {x: new}, []
        for k, (var, value) in enumerate(chain):
            name = f"{old.name}_cast" if k == len(chain) - 1 else f"{old.name}_cast{k}"
            value = relax.Call(value.op, [made.get(a, a) for a in value.args], value.attrs, value.ty_args)
            made[var] = relax.DataflowVar(name, var.ty)
            computed.append(relax.VarBinding(made[var], bb.normalize(value)))
        pending[old] = computed
        vmap[old] = made[chain[-1][0]]
    bindings = []
    for b in flat_bindings(inner)[0]:
        reads = [e for e in sub_expressions(b.value) if isinstance(e, relax.Var)]
        for old in [p for p in pending if any(p.same_as(r) for r in reads)]:
            bindings.extend(pending.pop(old))
        bindings.append(relax.VarBinding(b.var, substitute(b.value, vmap)))
    new_inner = relax.Function(new_inner_params, relax.SeqExpr([relax.DataflowBlock(bindings)], inner.body.body),
                               inner.ret_ty, inner.is_pure, inner.attrs)
    new_outer_params = list(outer.params)
    omap = {}
    for i, (x, _) in casts.items():
        new_outer_params[i] = relax.Var(outer.params[i].name, x.ty)
        omap[outer.params[i]] = new_outer_params[i]
    fvar = relax.Var(local.var.name, new_inner.ty)
    out = []
    for b in flat_bindings(outer)[0]:
        if b.var.same_as(local.var):
            out.append(relax.VarBinding(fvar, new_inner))
        elif b.var.same_as(call.var):
            out.append(relax.VarBinding(b.var, relax.Call(fvar, [substitute(a, omap) for a in b.value.args],
                                                          b.value.attrs, b.value.ty_args)))
        else:
            out.append(relax.VarBinding(b.var, substitute(b.value, omap)))
    block_cls = type(outer.body.blocks[0]) if len(outer.body.blocks) == 1 else relax.BindingBlock
    return relax.Function(new_outer_params, relax.SeqExpr([block_cls(out)], outer.body.body), outer.ret_ty,
                          outer.is_pure, outer.attrs)


def _legal(func: relax.Function) -> bool:
    from .partition_evt import _codegen  # the codegen's legality API, imported lazily

    legality_mod, _ = _codegen()
    return bool(legality_mod.legality(func))


@tvm.transform.module_pass(opt_level=0, name="AbsorbPartitionInputCasts")
class AbsorbPartitionInputCasts:
    """Move casts that only feed an evt partition's epilogue into the partition (module docstring)."""

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        parts = {gv: f for gv, f in mod.functions_items()
                 if isinstance(f, relax.Function) and f.attrs and f.attrs.get("Codegen") == CODEGEN}
        if not parts:
            return mod
        bb = relax.BlockBuilder(mod)
        new_parts, changed = {}, False
        for gv, func in mod.functions_items():
            if not isinstance(func, relax.Function) or gv in parts:
                continue
            rewritten = self._rewrite(bb, func, parts, new_parts)
            if rewritten is not None:
                bb.update_func(gv, rewritten)
                changed = True
        if not changed:
            return mod
        # the partitions whose every call now goes to a cast-absorbing copy are dropped
        return drop_uncalled(relax.transform.DeadCodeElimination()(relax.transform.Normalize()(bb.get())), CODEGEN)

    @staticmethod
    def _rewrite(bb, func, parts, new_parts):
        bindings = flat_bindings(func)[0]
        bound = {b.var: b.value for b in bindings}
        index = {b.var: i for i, b in enumerate(bindings)}
        uses = binding_uses(func)
        changed = {}
        for idx, b in enumerate(bindings):
            call = b.value
            if not (isinstance(call, relax.Call) and call.op in parts):
                continue
            outer = parts[call.op]
            shape = local_composite(outer)
            if shape is None:
                continue
            inner = shape[0].value
            casts, args = {}, list(call.args)
            for i, arg in enumerate(call.args):
                found = _absorbed(arg, bound, uses, index, idx)
                if found is None or sum(a.same_as(arg) for a in call.args) != 1 \
                        or not _epilogue_only(inner, inner.params[i]):
                    continue
                casts[i] = found
                args[i] = found[0]
            if not casts:
                continue
            key = (call.op.name_hint, tuple((i, _describe(*casts[i])) for i in sorted(casts)))
            if key not in new_parts:
                candidate = _with_cast_params(outer, casts)
                name = f"{call.op.name_hint}_c" + "_".join(map(str, sorted(casts)))
                same = sum(k[0] == key[0] and [i for i, _ in k[1]] == sorted(casts) for k in new_parts)
                name += f"_v{same}" if same else ""  # another call absorbs other constants or dtypes
                candidate = candidate.with_attr("global_symbol", name)
                new_parts[key] = bb.add_func(candidate, name) if _legal(candidate) else None
            if new_parts[key] is None:
                continue
            changed[b.var] = relax.Call(new_parts[key], args, call.attrs, call.ty_args)
        if not changed:
            return None
        blocks = [type(block)([relax.VarBinding(b.var, changed[b.var])
                               if isinstance(b, relax.VarBinding) and b.var in changed else b for b in block.bindings])
                  for block in func.body.blocks]
        return relax.Function(func.params, relax.SeqExpr(blocks, func.body.body), func.ret_ty, func.is_pure,
                              func.attrs)
