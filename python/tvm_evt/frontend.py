"""PyTorch → Relax import for training.

`from_torch` exports a model (optionally together with a torch loss module) through
`torch.export` and translates the graph with TVM's `ExportedProgramImporter`, driven here so
that training needs are met:

* parameters *and* buffers stay function inputs, named by their torch names
  (``encoder.0.qkv.weight``); TVM's own driver binds buffers as constants and drops their
  mutations, which would freeze BatchNorm running statistics;
* buffer mutations (``running_mean`` updates, ...) are returned after the loss, so ``main``
  returns ``(loss, *new_buffers)`` and the training step writes them back;
* the importer's gaps and training-mode mistakes are fixed by `tvm_evt.converters.CONVERT_MAP`
  (dropout is real dropout, adaptive max pooling, ...);
* every Relax binding remembers the aten op and the torch module path it came from, so a
  missing converter or gradient rule is reported as ``aten.foo in encoder.0.ffn``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import re
import warnings
from collections import OrderedDict
from typing import Callable, Sequence

import tvm
from tvm import relax

from .errors import UnsupportedOpError, module_path as _module_path


@dataclasses.dataclass(frozen=True)
class Origin:
    """Where a Relax binding came from in the torch program."""

    aten_op: str
    module_path: str

    def __str__(self) -> str:
        return f"{self.aten_op} in module '{self.module_path or '<top>'}'"


@dataclasses.dataclass
class ImportedModel:
    """A Relax module with main(*inputs, *params, *buffers) -> (loss, *new_buffers)."""

    mod: tvm.IRModule
    input_names: list[str]
    param_names: list[str]
    buffer_names: list[str]
    mutated_buffers: list[str]  # buffers whose new value main returns after the loss, in order
    param_values: "OrderedDict[str, object]"  # torch tensors (initial values)
    buffer_values: "OrderedDict[str, object]"
    origins: dict  # relax.Var -> Origin
    input_specs: list[tuple[tuple[int, ...], str]]  # (shape, dtype) per user input
    # per user input: True where ``main`` takes it [N, H, W, C] (a channels-last example input;
    # its spec above stays the logical NCHW shape the caller passes)
    channels_last: list[bool] = dataclasses.field(default_factory=list)
    # SDPA calls imported as plain ops instead of ``tvm_evt.attention``: {"module", "reason"} each
    attention_fallbacks: list[dict] = dataclasses.field(default_factory=list)

    def takes_channels_last(self, index: int) -> bool:
        return index < len(self.channels_last) and self.channels_last[index]


class _WithLoss:
    """Builds `loss_fn(model(*inputs), target)` as one torch module for tracing."""

    def __new__(cls, model, loss_fn):
        import torch

        class WithLoss(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model
                self.loss_fn = loss_fn

            def forward(self, *args):
                *inputs, target = args
                return self.loss_fn(self.model(*inputs), target)

        return WithLoss()


def _identifier(name: str) -> str:
    """A C identifier for a parameter's Relax var (its torch name stays the key users see): the
    names reach generated CUDA as kernel argument names, and ``layers.1.conv.weight`` of an
    ``nn.Sequential`` became ``1_conv_weight_ptr``, which NVRTC rejects (ResNet-50 stage)."""
    ident = re.sub(r"\W", "_", name)
    return f"p_{ident}" if not ident or ident[0].isdigit() else ident


def _aten_name(node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    return f"aten.{name}" if not name.startswith("aten.") else name


def _make_importer(convert_map: dict, origin_log: list, strip_prefix: str):
    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    importer = ExportedProgramImporter()
    importer.update_convert_map(convert_map)
    importer.attention_fallbacks = []  # (fx node, reason): converters.convert_sdpa's
    custom_ops = set(convert_map)

    def traced(fn: Callable, takes_importer: bool) -> Callable:
        def convert(node):
            origin = Origin(_aten_name(node), _module_path(node, strip_prefix))
            try:
                out = fn(node, importer) if takes_importer else fn(node)
            except UnsupportedOpError:
                raise
            except Exception as err:  # the importer raises bare asserts / TVM errors
                raise UnsupportedOpError(
                    origin.aten_op, origin.module_path, f"conversion failed: {err}"
                ) from err
            origin_log.append((out, origin))
            return out

        return convert

    for name, fn in list(importer.convert_map.items()):
        importer.convert_map[name] = traced(fn, name in custom_ops)
    return importer


# ops the importer converts itself instead of taking torch's decomposition: torch's SDPA
# decomposition gives views wrong strides (pytorch issue 136543: "Cannot view a tensor with shape
# [4, 64, 128] and strides (128, 512, 1)" on transformers' GPT2Attention), and attention is better
# met whole than written out and matched back
KEPT_WHOLE = ("scaled_dot_product_attention.default",
              # decomposed, detach is an alias: the gradient would flow through it
              "detach.default")


def decomposition_table() -> dict:
    """torch.export's default decompositions, less those of ``KEPT_WHOLE``."""
    import torch

    table = torch.export.default_decompositions()
    for name in KEPT_WHOLE:
        packet, _, overload = name.partition(".")
        table.pop(getattr(getattr(torch.ops.aten, packet), overload), None)
    return table


def detach_no_grad_blocks(ep):
    """`ep` with each output of a ``torch.no_grad()`` block detached.  torch.export records such a
    block as ``wrap_with_set_grad_enabled(False, block, ...)``, and ``run_decompositions`` inlines it
    with no trace of the mode: its ops would then take gradients torch never computes.  A
    ``detach`` after each output survives the decomposition and imports as ``no_grad``."""
    import torch

    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    graph = ep.graph_module.graph
    blocks = [n for n in graph.nodes if n.op == "call_function" and n.target is hop and n.args and n.args[0] is False]
    for block in blocks:
        for user in list(block.users):
            if not (user.op == "call_function" and user.target is operator.getitem):
                raise UnsupportedOpError("torch.no_grad() block", _module_path(block, ""),
                                         f"its result is read by {user.target} rather than by position")
            with graph.inserting_after(user):
                detached = graph.call_function(torch.ops.aten.detach.default, (user,))
            detached.meta.update({k: v for k, v in user.meta.items() if k in ("val", "tensor_meta", "stack_trace",
                                                                               "nn_module_stack")})
            user.replace_all_uses_with(detached, delete_user_cb=lambda u, d=detached: u is not d)
    if blocks:
        ep.graph_module.recompile()
    return ep


def import_exported_program(ep, convert_map: dict | None = None, strip_prefix: str = ""):
    """Translate an ExportedProgram into an `ImportedModel` (see module docstring)."""
    from torch.export.graph_signature import InputKind, OutputKind

    from .converters import CONVERT_MAP

    convert_map = dict(CONVERT_MAP, **(convert_map or {}))
    ep = detach_no_grad_blocks(ep).run_decompositions(decomposition_table())
    nodes = list(ep.graph.nodes)

    origin_log: list = []
    importer = _make_importer(convert_map, origin_log, strip_prefix)

    for node in nodes:
        if node.op == "call_function" and node.target.__name__ not in importer.convert_map:
            raise UnsupportedOpError(
                _aten_name(node), _module_path(node, strip_prefix), "no converter to Relax"
            )

    params_buffers, user_inputs, _ = importer.create_input_vars(ep)
    sig = ep.graph_signature
    strip = lambda n: n[len(strip_prefix) :] if strip_prefix and n.startswith(strip_prefix) else n

    param_vars, buffer_vars, const_binding = [], [], {}
    param_values, buffer_values = OrderedDict(), OrderedDict()
    state = ep.state_dict
    named_buffers = dict(ep.named_buffers())
    aliases = {}  # placeholder name -> var of an earlier placeholder of the same tensor
    seen = {}  # storage identity -> var (tied weights are one parameter)
    var_of = {}  # placeholder name -> the parameter or buffer var main takes for it
    for spec in sig.input_specs:
        if spec.kind is InputKind.PARAMETER:
            var = params_buffers[spec.arg.name]
            tensor = state[spec.target]
            key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
            if key in seen:
                aliases[spec.arg.name] = seen[key]
                continue
            name = strip(spec.target)
            # a frozen parameter (requires_grad=False) is state the step reads and neither
            # differentiates nor updates: a buffer that is never written
            kept, values = (param_vars, param_values) if tensor.requires_grad else (buffer_vars, buffer_values)
            kept.append(relax.Var(_identifier(name), var.ty))
            seen[key] = var_of[spec.arg.name] = kept[-1]
            values[name] = tensor
        elif spec.kind is InputKind.BUFFER:
            var = params_buffers[spec.arg.name]
            name = strip(spec.target)
            buffer_vars.append(relax.Var(_identifier(name), var.ty))
            var_of[spec.arg.name] = buffer_vars[-1]
            buffer_values[name] = named_buffers[spec.target]
        elif spec.kind in (InputKind.CONSTANT_TENSOR,):
            const_binding[spec.arg.name] = ep.constants[spec.target]
        elif spec.kind is InputKind.USER_INPUT:
            continue
        else:
            raise UnsupportedOpError("input", spec.arg.name, f"unsupported input kind {spec.kind}")

    # the importer resolves placeholders by node name; hand it our renamed vars
    renamed = OrderedDict(user_inputs)
    arg_to_var = {}
    for spec in sig.input_specs:
        if spec.arg.name in aliases:
            arg_to_var[spec.arg.name] = aliases[spec.arg.name]
        elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            arg_to_var[spec.arg.name] = var_of[spec.arg.name]
        elif spec.kind is InputKind.CONSTANT_TENSOR:
            arg_to_var[spec.arg.name] = params_buffers[spec.arg.name]
    renamed.update(arg_to_var)

    mutated = [
        (i, strip(spec.target))
        for i, spec in enumerate(sig.output_specs)
        if spec.kind is OutputKind.BUFFER_MUTATION
    ]
    user_out = [
        i
        for i, spec in enumerate(sig.output_specs)
        if spec.kind in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT)
    ]
    other = [
        spec
        for spec in sig.output_specs
        if spec.kind
        not in (OutputKind.USER_OUTPUT, OutputKind.LOSS_OUTPUT, OutputKind.BUFFER_MUTATION)
    ]
    if other:
        raise UnsupportedOpError(
            "output", str(other[0].target), f"unsupported output kind {other[0].kind}"
        )
    if len(user_out) != 1:
        raise ValueError(
            f"the traced model returns {len(user_out)} values; a training model must return "
            "one scalar loss (or pass loss_fn=... to compile_training)"
        )

    bb = relax.BlockBuilder()
    importer.block_builder = bb
    func_params = list(user_inputs.values()) + param_vars + buffer_vars
    const_params = [params_buffers[n] for n in const_binding]
    with bb.function("main", params=func_params + const_params, attrs={"num_input": len(user_inputs)}):
        with bb.dataflow():
            # every wrapper takes (node) alone, custom converters included: no custom_ops set
            outs = importer._translate_fx_graph(ep.graph_module, nodes, renamed, set())
            outs = list(outs)
            loss = outs[user_out[0]]
            if not isinstance(loss, relax.Expr) or loss.ty.ndim != 0:
                raise ValueError(
                    "the traced model must return a scalar loss tensor; got "
                    f"{getattr(loss, 'struct_info', loss)} (pass loss_fn=... to compile_training)"
                )
            ret = [loss] + [outs[i] for i, _ in mutated]
            # a Tuple literal, not a var bound to one: Gradient indexes it with target_index
            ret = [bb.emit_output(r) for r in ret]
        bb.emit_func_output(relax.Tuple(ret))
    mod = bb.get()
    if const_binding:
        mod = relax.transform.BindParams(
            "main",
            {n: importer._convert_pytorch_tensor_to_tvm(t) for n, t in const_binding.items()},
        )(mod)

    origins = {}  # the first op that produced a var (a pass-through such as an assert returns it again)
    for var, origin in origin_log:
        if isinstance(var, relax.Var):
            origins.setdefault(var, origin)
    input_specs = []
    for var in user_inputs.values():
        sinfo = var.ty
        input_specs.append((tuple(int(s) for s in sinfo.shape), str(sinfo.dtype)))
    return ImportedModel(
        mod=mod,
        input_names=list(user_inputs),
        param_names=list(param_values),
        buffer_names=list(buffer_values),
        mutated_buffers=[name for _, name in mutated],
        param_values=param_values,
        buffer_values=buffer_values,
        origins=origins,
        input_specs=input_specs,
        attention_fallbacks=[{"module": _module_path(node, strip_prefix), "reason": reason}
                             for node, reason in importer.attention_fallbacks],
    )


def from_torch(model, example_inputs: Sequence, loss_fn=None) -> ImportedModel:
    """Import a torch model for training.

    Each module runs in the mode it is in, as torch would run it (a model built from a config is in
    training mode; a batch norm set to ``eval()`` to freeze its statistics, or dropout switched
    off, stays so; ``from_pretrained`` returns models in eval mode: call ``.train()`` for dropout,
    as with torch).  Without `loss_fn` it must return a scalar loss; with
    `loss_fn` (a torch loss module such as ``nn.CrossEntropyLoss()``) the last example input
    is the loss target and `loss_fn(model(*inputs[:-1]), inputs[-1])` is traced as one graph.
    A Relax ``tvm.IRModule`` is accepted too and wrapped as is (its ``main`` must return a
    scalar loss, parameters after the first ``num_input`` arguments).
    """
    if isinstance(model, tvm.IRModule):
        return _wrap_irmodule(model)
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"expected a torch.nn.Module or a tvm.IRModule, got {type(model).__name__}")
    example_inputs = tuple(example_inputs)
    prefix = ""
    traced = model
    if loss_fn is not None:
        traced, prefix = _WithLoss(model, loss_fn), "model."
        traced.training = model.training  # the wrapper's own flag: train() would set every submodule's
    with warnings.catch_warnings():
        # torch's own pytree code trips its deprecation of LeafSpec while it exports (torch >= 2.10)
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                                category=FutureWarning)
        with _backward_only_code(model) as used:  # (module paths of the model's, not of the loss wrapper's)
            try:
                ep = torch.export.export(traced, example_inputs)
            except Exception as err:
                raise RuntimeError(f"torch.export could not trace {type(model).__name__}: {err}") from err
        if used:
            raise UnsupportedOpError(*used[0], "torch.export records the forward only, so the gradient would be "
                                     "the forward's and not the one the model defines")
        imported = import_exported_program(ep, strip_prefix=prefix)
    flags = [is_channels_last(t) for t in example_inputs]
    return _take_channels_last(imported, flags) if any(flags) else imported


# what a forward can do to its backward that torch.export does not record: (what is patched
# while exporting, how the error names a use of it)
_BACKWARD_ONLY = {
    "Function.apply": "torch.autograd.Function {name}",
    "Tensor.register_hook": "a gradient hook (Tensor.register_hook)",
}
_HOOK_FUNCTION = "torch.nn.modules._functions.BackwardHookFunction"  # a module's backward hook


@contextlib.contextmanager
def _backward_only_code(model):
    """A list that collects ``(what, module path)`` for each use, while the block runs, of what
    changes a gradient without a trace in torch.export's graph: a custom ``torch.autograd.Function``
    (its backward; module backward hooks are one) or a tensor gradient hook.  ``Function.apply``
    and ``Tensor.register_hook`` are wrapped, and global forward hooks keep the module path."""
    import torch
    from torch.autograd.function import Function

    names = {id(m): n for n, m in model.named_modules()}
    stack: list = []
    used: list = []
    apply, register_hook = Function.__dict__["apply"], torch.Tensor.register_hook

    def recording_apply(cls, *args, **kwargs):
        name = f"{cls.__module__}.{cls.__qualname__}"
        used.append(("a module backward hook (register_full_backward_hook)" if name == _HOOK_FUNCTION
                     else _BACKWARD_ONLY["Function.apply"].format(name=name), stack[-1] if stack else ""))
        return apply.__func__(cls, *args, **kwargs)

    def recording_register_hook(tensor, hook):
        used.append((_BACKWARD_ONLY["Tensor.register_hook"], stack[-1] if stack else ""))
        return register_hook(tensor, hook)

    def leave_module(_module, _args, _out):  # (a forward hook's result would replace the output)
        if stack:
            stack.pop()

    enter = torch.nn.modules.module.register_module_forward_pre_hook(
        lambda m, _args: stack.append(names.get(id(m), stack[-1] if stack else "")))
    leave = torch.nn.modules.module.register_module_forward_hook(leave_module)
    Function.apply, torch.Tensor.register_hook = classmethod(recording_apply), recording_register_hook
    try:
        yield used
    finally:
        Function.apply, torch.Tensor.register_hook = apply, register_hook
        enter.remove()
        leave.remove()


NCHW_TO_NHWC = (0, 2, 3, 1)
NHWC_TO_NCHW = (0, 3, 1, 2)


def is_channels_last(t) -> bool:
    """A 4-D torch tensor stored channels-last (NHWC in memory) and not also contiguous as NCHW."""
    import torch

    return t.dim() == 4 and not t.is_contiguous() and t.is_contiguous(memory_format=torch.channels_last)


def _take_channels_last(imported: ImportedModel, flags: Sequence[bool]) -> ImportedModel:
    """`imported` whose ``main`` takes each flagged input as [N, H, W, C], the memory order of a
    channels-last torch tensor, so a step hands the tensor over in place (torch runs such a model
    on the same tensors).  The old NCHW parameter is bound to ``permute_dims(x, [0, 3, 1, 2])`` at
    the top of the body; where the convolutions run NHWC (``ConvertConvLayout``) that transpose
    meets theirs and both go (``CancelTransposes``)."""
    func = imported.mod["main"]
    params = list(func.params)
    bindings = []
    for i, flag in enumerate(flags):
        if flag:
            old = params[i]
            n, c, h, w = (int(s) for s in old.ty.shape)
            params[i] = relax.Var(old.name, relax.TensorType((n, h, w, c), old.ty.dtype))
            bindings.append(relax.VarBinding(old, relax.op.permute_dims(params[i], NHWC_TO_NCHW)))
    body = func.body
    first = body.blocks[0] if body.blocks else None
    if isinstance(first, relax.DataflowBlock):  # Gradient wants the body's ops in its dataflow block
        blocks = [relax.DataflowBlock(bindings + list(first.bindings))] + list(body.blocks[1:])
    else:
        blocks = [relax.BindingBlock(bindings)] + list(body.blocks)
    seq = relax.BlockBuilder().normalize(relax.SeqExpr(blocks, body.body))
    main = relax.Function(params, seq, None, func.is_pure, func.attrs)
    return dataclasses.replace(imported, mod=_replace(imported.mod, main), channels_last=list(flags))


def _wrap_irmodule(mod: tvm.IRModule) -> ImportedModel:
    """Accept a Relax module whose ``main(*inputs, *params)`` returns a scalar loss (or a
    tuple starting with it).  Initial parameter values come from ``main``'s ``params``
    attribute (what ``from_exported_program(keep_params_as_input=True)`` leaves), else zeros
    — call ``load_parameters`` on the step to set them."""
    import numpy as np
    import torch

    func = mod["main"]
    attrs = func.attrs or {}
    num_input = int(attrs["num_input"]) if "num_input" in attrs else 1
    params = list(func.params)
    if not isinstance(func.body.body, relax.Tuple):
        body = func.body
        seq = relax.BlockBuilder().normalize(relax.SeqExpr(body.blocks, relax.Tuple([body.body])))
        func = relax.Function(params, seq, None, func.is_pure, func.attrs)
        mod = _replace(mod, func)
    names = [p.name for p in params]
    values = list(attrs["params"]) if "params" in attrs else []
    param_values = OrderedDict()
    for i, var in enumerate(params[num_input:]):
        ty = var.ty
        if i < len(values):
            param_values[var.name] = torch.from_numpy(values[i].numpy())
        else:
            shape = tuple(int(s) for s in ty.shape)
            param_values[var.name] = torch.from_numpy(np.zeros(shape, dtype=str(ty.dtype)))
    return ImportedModel(
        mod=mod,
        input_names=names[:num_input],
        param_names=names[num_input:],
        buffer_names=[],
        mutated_buffers=[],
        param_values=param_values,
        buffer_values=OrderedDict(),
        origins={},
        input_specs=[
            (tuple(int(s) for s in p.ty.shape), str(p.ty.dtype)) for p in params[:num_input]
        ],
    )


def _replace(mod: tvm.IRModule, func) -> tvm.IRModule:
    mod = tvm.IRModule(dict(mod.functions_items()))
    mod["main"] = func
    return mod
