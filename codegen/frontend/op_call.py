"""The one op call of a single-call codegen function (``Codegen="evt_attention"`` / ``"evt_conv"``)."""
from __future__ import annotations

import tvm
from tvm import relax

from ..errors import Unsupported


def only_call(func: relax.Function, ops, what: str) -> tuple[str, relax.Call, dict]:
    """(the function's ``global_symbol`` or `what`, its one call of an op named in `ops`, and
    {var: value} of its bindings); ``Unsupported`` unless there is exactly one such call."""
    symbol = str(func.attrs["global_symbol"]) if func.attrs and "global_symbol" in func.attrs else what
    body = func.body
    bindings = [b for block in body.blocks for b in block.bindings] if isinstance(body, relax.SeqExpr) else []
    values = [b.value for b in bindings] + [body.body if isinstance(body, relax.SeqExpr) else body]
    calls = [v for v in values if isinstance(v, relax.Call) and isinstance(v.op, tvm.ir.Op) and v.op.name in ops]
    if len(calls) != 1:
        raise Unsupported(f"{symbol}: expected one {what} call in the function, found {len(calls)}")
    return symbol, calls[0], {b.var: b.value for b in bindings}
