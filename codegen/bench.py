"""GEMM + epilogue benchmark on the GEMM shapes of a BERT-Large layer, against torch (cuBLAS).

Rows (all bf16, fp32 accumulation; tokens T=16384, hidden H=1024, FFN F=4096):
  a  plain GEMM                                   vs torch.matmul
  b  GEMM + bias + GELU, pre-activation aux store vs torch matmul, +bias, gelu (and F.linear + gelu)
  c  GEMM + fp32 column sums (bias gradient)      vs torch matmul + sum(0)
  d  GEMM + bias + Philox dropout + residual      vs torch F.linear + dropout + add
  e  GEMM * gelu'(pre) / relu mask (backward)     vs torch matmul + aten.gelu_backward / threshold_backward

Method: kernels are called directly through their TVM FFI entry (``__tvm_ffi_<symbol>``, the
function ``relax.ext.evt`` links into a Relax VM module) on torch tensors; every kernel is first
checked against a float32 torch reference (relative L2 error <= 1e-2), then timed with CUDA events:
warm-up, fresh random inputs (regenerated in place) and NaN-poisoned outputs before every run,
median of ``--iters`` runs; torch is timed the same way in the same process.  Configurations are
chosen as in ``codegen.select.tune`` (plain-GEMM ranking, then the best few re-timed with the
epilogue) and persisted in the selection cache.  The overhead of the Relax VM route is measured on
one kernel and reported.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import select
from .backend import CODEGEN_VERSION, KernelConfig, emit
from .build import cache, link_module, toolchain
from .errors import Unsupported
from .frontend import DROPOUT_EXTERN, GELU_BACKWARD_EXTERN, RELU_BACKWARD_EXTERN, from_function
from .ir import Partition
from .passes import lower

TOKENS, HIDDEN, FFN = 16384, 1024, 4096
DTYPE = "bfloat16"
DROPOUT_P, DROPOUT_SITE, DROPOUT_SEED = 0.1, 3, (0x1234ABCD, 0x0BADF00D)
TOLERANCE = 1e-2


@dataclasses.dataclass(frozen=True)
class Problem:
    """D (M x N) = A (M x K) B (K x N); ``kind`` says how torch holds the operands:
    fwd: x (M,K), w (N,K), D = x wᵀ;  dgrad: dy (M,K), w (K,N), D = dy w;  wgrad: dy (K,M), x (K,N), D = dyᵀ x."""

    label: str
    kind: str
    m: int
    n: int
    k: int

    @property
    def key(self) -> str:
        return f"{self.label.replace(' ', '_').replace('-', '')}"


def bert_problems(quick: bool = False) -> list[Problem]:
    T, H, F = TOKENS, HIDDEN, FFN
    fwd = [Problem("QKV fwd", "fwd", T, 3 * H, H), Problem("attn-out fwd", "fwd", T, H, H),
           Problem("FFN1 fwd", "fwd", T, F, H), Problem("FFN2 fwd", "fwd", T, H, F)]
    dgrad = [Problem("QKV dX", "dgrad", T, H, 3 * H), Problem("attn-out dX", "dgrad", T, H, H),
             Problem("FFN1 dX", "dgrad", T, H, F), Problem("FFN2 dX", "dgrad", T, F, H)]
    wgrad = [Problem("QKV dW", "wgrad", 3 * H, H, T), Problem("attn-out dW", "wgrad", H, H, T),
             Problem("FFN1 dW", "wgrad", F, H, T), Problem("FFN2 dW", "wgrad", H, F, T)]
    if quick:
        return [fwd[2], fwd[3], dgrad[3], wgrad[0], wgrad[1]]
    return fwd + dgrad + wgrad


# ------------------------------------------------------------------------------- Relax partitions
def _operands(problem: Problem):
    from tvm import relax

    m, n, k = problem.m, problem.n, problem.k
    tt = lambda *s: relax.TensorType(s, DTYPE)  # noqa: E731
    if problem.kind == "fwd":
        a, b = relax.Var("x", tt(m, k)), relax.Var("w", tt(n, k))
        return [a, b], relax.op.matmul(a, relax.op.permute_dims(b, [1, 0]))
    if problem.kind == "dgrad":
        a, b = relax.Var("dy", tt(m, k)), relax.Var("w", tt(k, n))
        return [a, b], relax.op.matmul(a, b)
    a, b = relax.Var("dy", tt(k, m)), relax.Var("x", tt(k, n))
    return [a, b], relax.op.matmul(relax.op.permute_dims(a, [1, 0]), b)


def relax_function(epilogue: str, problem: Problem, name: str):
    """The Relax partition of one benchmark case (what the partitioner hands to relax.ext.evt)."""
    from tvm import relax

    m, n = problem.m, problem.n
    params, mm = _operands(problem)
    extra = {
        "gemm": [],
        "bias_gelu_aux": [relax.Var("bias", relax.TensorType((n,), DTYPE))],
        "colsum": [],
        "dropout_residual": [relax.Var("bias", relax.TensorType((n,), DTYPE)),
                             relax.Var("residual", relax.TensorType((m, n), DTYPE)),
                             relax.Var("seed", relax.TensorType((2,), "uint32"))],
        "gelu_bwd": [relax.Var("pre", relax.TensorType((m, n), DTYPE))],
        "relu_bwd": [relax.Var("pre", relax.TensorType((m, n), DTYPE))],
    }[epilogue]
    bb = relax.BlockBuilder()
    with bb.function(name, params + extra):
        with bb.dataflow():
            y = bb.emit(mm)
            if epilogue == "gemm":
                out = bb.emit_output(y)
            elif epilogue == "bias_gelu_aux":
                h = bb.emit(relax.op.add(y, extra[0]))
                g = bb.emit(relax.op.nn.gelu(h))
                out = bb.emit_output(relax.Tuple([g, h]))
            elif epilogue == "colsum":
                s = bb.emit(relax.op.sum(relax.op.astype(y, "float32"), axis=[0]))
                out = bb.emit_output(relax.Tuple([y, s]))
            elif epilogue == "dropout_residual":
                h = bb.emit(relax.op.add(y, extra[0]))
                d = bb.emit(relax.call_pure_packed(DROPOUT_EXTERN, h, extra[2], relax.prim_value(DROPOUT_SITE),
                                                   relax.prim_value(DROPOUT_P), ty_args=h.ty))
                out = bb.emit_output(relax.op.add(d, extra[1]))
            else:
                fn = GELU_BACKWARD_EXTERN if epilogue == "gelu_bwd" else RELU_BACKWARD_EXTERN
                out = bb.emit_output(relax.call_pure_packed(fn, y, extra[0], ty_args=y.ty))
        bb.emit_func_output(out)
    return bb.get()[name]


@dataclasses.dataclass
class Case:
    group: str  # a..e
    epilogue: str
    problem: Problem
    partition: Partition = None  # lowered, symbol = name

    @property
    def name(self) -> str:
        return f"evt_{self.epilogue}_{self.problem.key}"

    def build(self) -> "Case":
        self.partition = lower(from_function(relax_function(self.epilogue, self.problem, self.name)))
        return self


def bert_cases(quick: bool = False) -> list[Case]:
    problems = bert_problems(quick)
    by = {p.label: p for p in bert_problems(False)}
    cases = [Case("a", "gemm", p) for p in problems]
    fused = [("b", "bias_gelu_aux", "FFN1 fwd"), ("c", "colsum", "FFN2 dX"), ("d", "dropout_residual", "FFN2 fwd"),
             ("e", "gelu_bwd", "FFN2 dX"), ("e", "relu_bwd", "FFN2 dX")]
    if not quick:
        fused += [("c", "colsum", "FFN1 dX"), ("d", "dropout_residual", "attn-out fwd")]
    cases += [Case(g, e, by[label]) for g, e, label in fused]
    return [c.build() for c in cases]


def pick_cases(cases: list[Case], patterns: str | None) -> list[Case]:
    """The cases whose name (``evt_<epilogue>_<problem>``, e.g. ``evt_gemm_QKV_dW``) contains one
    of the comma-separated ``patterns``; all of them when ``patterns`` is empty."""
    if not patterns:
        return cases
    wanted = [w.strip() for w in patterns.split(",") if w.strip()]
    for w in wanted:
        if not any(w in c.name for c in cases):
            raise SystemExit(f"bench_gemm: --cases {w!r} matches none of: {', '.join(c.name for c in cases)}")
    return [c for c in cases if any(w in c.name for w in wanted)]


# -------------------------------------------------------------------------- building and loading
def build_tolerant(sources: dict[str, str], jobs: int) -> tuple[dict[str, Path], dict[str, str], dict]:
    """``build_many`` that records a failing kernel instead of stopping (a candidate may not fit):
    (objects, errors, stats).  Kernels of one CUTLASS type share one translation unit, as in a
    model's build (``cache.build_each``): a sweep of one configuration over many partitions with
    the same epilogue compiles it once."""
    start, wall = time.monotonic(), time.time()
    results = cache.build_each(sources, jobs, progress=True)
    objects = {n: r for n, r in results.items() if not isinstance(r, cache.BuildError)}
    failed = {n: str(r)[-3000:] for n, r in results.items() if isinstance(r, cache.BuildError)}
    fresh = {o for o in set(objects.values()) if o.stat().st_mtime >= wall - 1}  # compiled by this call
    stats = {"built": len(fresh), "cached": len(set(objects.values()) - fresh), "failed": len(failed),
             "seconds": round(time.monotonic() - start, 1)}
    return objects, failed, stats


def load_library(objects: dict[str, Path]):
    """Link kernel objects into one shared library and load it with tvm_ffi: symbol -> Function."""
    import tvm_ffi

    symbols = sorted(objects)
    obj = link_module([objects[s] for s in symbols], symbols)
    so = obj.with_suffix(".so")
    if not so.exists():
        tmp = so.with_name(so.name + f".{os.getpid()}.tmp")
        cmd = [shutil.which("g++") or "g++", "-shared", "-o", str(tmp), str(obj), "-ldl", "-lpthread", "-lrt"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise cache.BuildError(f"linking {so} failed: {proc.stderr[-4000:]}")
        os.replace(tmp, so)
    module = tvm_ffi.load_module(str(so))
    return {s: module[s] for s in symbols}


# ------------------------------------------------------------------------------ torch side
class Torch:
    """Inputs, references and baselines of each case on the GPU (imports torch lazily)."""

    def __init__(self, device: str = "cuda"):
        import torch

        self.torch, self.device = torch, device
        torch.backends.cuda.matmul.allow_tf32 = False  # float32 references are exact fp32 (bf16 timings unaffected)

    def mm(self, kind, a, b):
        return a @ b.T if kind == "fwd" else a @ b if kind == "dgrad" else a.T @ b

    def inputs(self, case: Case) -> list:
        t, p = self.torch, case.partition
        out = []
        for i, desc in enumerate(p.params):
            if desc.dtype == "uint32":
                seed = t.tensor(np.array(DROPOUT_SEED, dtype=np.uint32).view(np.int32), device=self.device)
                out.append(seed.view(t.uint32))
            else:
                out.append(t.empty(desc.shape, dtype=t.bfloat16, device=self.device))
        self.refresh(case, out)
        return out

    def refresh(self, case: Case, inputs) -> None:
        """Fresh random values in place: operands scaled so that D is O(1)."""
        k = case.problem.k
        for i, x in enumerate(inputs):
            if x.dtype == self.torch.bfloat16:
                x.normal_(0.0, k ** -0.5 if i == 1 else 1.0)

    def outputs(self, partition: Partition) -> list:
        t = self.torch
        dt = {"bfloat16": t.bfloat16, "float32": t.float32, "float16": t.float16, "bool": t.bool}
        return [t.empty(d.shape, dtype=dt[d.dtype], device=self.device) for d in partition.outputs]

    def poison(self, outputs) -> None:
        for o in outputs:
            if o.is_floating_point():
                o.fill_(float("nan"))

    # the float32 reference (what the kernel must compute)
    def reference(self, case: Case, inputs) -> list:
        t, F = self.torch, self.torch.nn.functional
        a, b, *extra = [x.float() if x.is_floating_point() else x for x in inputs]
        y = self.mm(case.problem.kind, a, b)
        e = case.epilogue
        if e == "gemm":
            return [y]
        if e == "bias_gelu_aux":
            h = y + extra[0]
            return [F.gelu(h), h]
        if e == "colsum":
            return [y, y.to(t.bfloat16).float().sum(0)]
        if e == "dropout_residual":
            return [y + extra[0], extra[1]]  # checked on samples (see verify)
        if e == "gelu_bwd":
            return [t.ops.aten.gelu_backward(y, extra[0])]
        return [t.where(extra[0] > 0, y, t.zeros_like(y))]

    def baselines(self, case: Case) -> dict:
        """name -> callable(inputs) running torch's separate kernels."""
        t, F, kind = self.torch, self.torch.nn.functional, case.problem.kind
        mm = lambda a, b: self.mm(kind, a, b)  # noqa: E731
        e = case.epilogue
        if e == "gemm":
            return {"torch.matmul": lambda a, b: mm(a, b)}
        if e == "bias_gelu_aux":
            return {"torch matmul, +bias, gelu": lambda a, b, bias: F.gelu(mm(a, b) + bias),
                    "torch F.linear (cuBLASLt bias), gelu": lambda a, b, bias: F.gelu(F.linear(a, b, bias))}
        if e == "colsum":
            def colsum(a, b):
                y = mm(a, b)
                return y, y.sum(0, dtype=t.float32)
            return {"torch matmul, sum(0)": colsum}
        if e == "dropout_residual":
            return {"torch F.linear, dropout, +residual":
                    lambda a, b, bias, r, seed: F.dropout(F.linear(a, b, bias), DROPOUT_P, training=True) + r}
        if e == "gelu_bwd":
            return {"torch matmul, gelu_backward": lambda a, b, pre: t.ops.aten.gelu_backward(mm(a, b), pre)}
        return {"torch matmul, threshold_backward": lambda a, b, pre: t.ops.aten.threshold_backward(mm(a, b), pre, 0)}

    def rel_err(self, got, want) -> float:
        got, want = got.double(), want.double()
        denom = want.norm().item()
        err = (got - want).norm().item()
        return err / denom if denom else err

    def verify(self, case: Case, inputs, outputs, refs) -> float:
        """Largest relative L2 error over the outputs (NaN if an output was not written)."""
        if case.epilogue == "dropout_residual":
            return self._verify_dropout(case, inputs, outputs[0], *refs)
        return max(self.rel_err(o.float(), r) for o, r in zip(outputs, refs))

    def _verify_dropout(self, case, inputs, out, h, residual) -> float:
        from . import philox

        t = self.torch
        m, n = case.problem.m, case.problem.n
        if not bool(t.isfinite(out).all()):
            return math.nan
        rng = np.random.default_rng(0)
        idx = np.unique(rng.integers(0, m * n, size=1 << 20, dtype=np.int64))
        keep = philox.keep(idx.astype(np.uint64), DROPOUT_SEED, DROPOUT_SITE, DROPOUT_P)
        tidx = t.from_numpy(idx).to(self.device)
        tkeep = t.from_numpy(keep).to(self.device)
        hb = h.to(t.bfloat16).float().flatten()[tidx]  # the epilogue adds the bias in bf16 precision
        want = t.where(tkeep, hb * float(philox.dropout_scale(DROPOUT_P)), t.zeros_like(hb)) + residual.flatten()[tidx]
        return self.rel_err(out.float().flatten()[tidx], want)

    def time(self, fn, refresh, iters: int, warmup: int) -> float:
        return median_ms(fn, refresh, iters, warmup)

    def checked_call(self, case: Case, fn, inputs, outputs, refs=None) -> float:
        """``verify`` of one call of kernel ``fn`` on ``inputs``, its ``outputs`` poisoned first
        (``refs``: the float32 reference, computed here if None)."""
        self.poison(outputs)
        fn(*inputs, *outputs)
        self.torch.cuda.synchronize()
        return self.verify(case, inputs, outputs, self.reference(case, inputs) if refs is None else refs)

    def time_kernel(self, case: Case, fn, inputs, outputs, iters: int, warmup: int) -> float:
        """``time`` of kernel ``fn``, with fresh ``inputs`` and poisoned ``outputs`` before each call."""

        def refresh():
            self.refresh(case, inputs)
            self.poison(outputs)

        return self.time(lambda: fn(*inputs, *outputs), refresh, iters, warmup)


def median_ms(fn, refresh, iters: int, warmup: int) -> float:
    """Median milliseconds of ``fn()`` between CUDA events; ``refresh()`` runs before each."""
    import torch

    for _ in range(warmup):
        refresh()
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        refresh()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


# ------------------------------------------------------------------------------------ the run
def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def _tflops(p: Problem, ms: float) -> float:
    return 2 * p.m * p.n * p.k / (ms * 1e-3) / 1e12 if ms and math.isfinite(ms) else math.nan


class Bench:
    def __init__(self, args):
        self.args = args
        self.cases = pick_cases(bert_cases(args.quick), args.cases)
        self.by_sig = {}
        for c in self.cases:
            self.by_sig.setdefault(select.signature(c.partition), c)
        for c in list(self.cases):  # plain GEMMs that tune() derives from fused cases
            plain = select.signature(select.plain_partition(c.partition))
            if plain not in self.by_sig:
                self.by_sig[plain] = Case("a", "gemm", c.problem).build()
        self.direct: dict[str, object] = {}  # job name -> FFI function (kept for the VM comparison)
        self.kernels: dict[str, dict] = {}  # job name -> {case, config, ms, rel_err, error}
        self.builds: list[dict] = []
        self.gpu = None
        self.th = None

    # a select.Measure: build every job in parallel, then verify and time each
    def measure(self, jobs: dict[str, tuple[Partition, KernelConfig]]) -> dict[str, float]:
        sources, times = {}, {}
        for name, (p, cfg) in jobs.items():
            case = self.by_sig[select.signature(p)]
            self.kernels[name] = {"case": case.name, "config": cfg.name, "ms": math.inf, "rel_err": None, "error": None}
            try:
                sources[name] = emit(p, cfg)
            except Unsupported as err:
                self.kernels[name]["error"] = f"unsupported: {err.reason}"
        _log(f"building {len(sources)} kernels with {self.args.jobs} jobs")
        objects, failed, stats = build_tolerant(sources, self.args.jobs)
        self.builds.append(stats)
        for name, err in failed.items():
            self.kernels[name]["error"] = "nvcc: " + err.strip().splitlines()[-1][:300]
        if not objects:
            return {n: math.inf for n in jobs}
        lib = load_library(objects)
        th, inputs_of = self.th, {}
        for name in sorted(objects):
            p, cfg = jobs[name]
            case = self.by_sig[select.signature(p)]
            if case.name not in inputs_of:
                inputs = th.inputs(case)
                inputs_of[case.name] = (inputs, th.reference(case, inputs))
            inputs, refs = inputs_of[case.name]
            outputs = th.outputs(p)
            fn = self.direct[name] = lib[name]
            rec = self.kernels[name]
            try:
                rec["rel_err"] = th.checked_call(case, fn, inputs, outputs, refs)
                if not rec["rel_err"] <= TOLERANCE:
                    rec["error"] = f"wrong result: relative error {rec['rel_err']:.3g}"
                    _log(f"{name}: {rec['error']}")
                    continue
                rec["ms"] = th.time_kernel(case, fn, th.inputs(case), outputs, self.args.iters, self.args.warmup)
                times[name] = rec["ms"]
                _log(f"{name}: {rec['ms']:.3f} ms (rel err {rec['rel_err']:.2e})")
            except Exception as err:  # noqa: BLE001 - one bad kernel must not stop the benchmark
                rec["error"] = f"{type(err).__name__}: {str(err)[:300]}"
                _log(f"{name}: {rec['error']}")
        out = Path(self.args.out)
        (out / "bench_gemm_kernels.json").write_text(json.dumps(_clean(self.kernels), indent=1, default=_json_default))
        return {n: times.get(n, math.inf) for n in jobs}

    def torch_rows(self, case: Case) -> dict:
        th, out = self.th, {}
        inputs = th.inputs(case)
        for label, fn in th.baselines(case).items():
            out[label] = th.time(lambda: fn(*inputs), lambda: th.refresh(case, inputs), self.args.iters, self.args.warmup)
        return out

    def vm_overhead(self, case: Case, config: KernelConfig) -> dict:
        """One kernel through the Relax VM route (RunCodegen + tvm.compile + VM) vs the direct call."""
        import tvm
        from tvm import relax

        from .relax_ext import register

        register()
        name = f"evt_plain_{case.name}__{config.name}"  # the symbol and config tune() built: a cached object
        func = relax_function(case.epilogue, case.problem, name).with_attrs({"Codegen": "evt", "global_symbol": name})
        bb = relax.BlockBuilder()
        gv = bb.add_func(func, name)  # a GlobalVar that carries the function's type
        params = [relax.Var(p.name, p.ty) for p in func.params]
        with bb.function("main", params):
            bb.emit_func_output(bb.emit(relax.Call(gv, params)))
        options = {"evt": {**config.to_json(), "jobs": self.args.jobs}}
        mod = relax.transform.RunCodegen(options)(bb.get())
        t0 = time.monotonic()
        ex = tvm.compile(mod, target=tvm.target.Target({"kind": "cuda", "arch": "sm_90a"}))
        vm = relax.VirtualMachine(ex, tvm.cuda(0))
        compile_s = time.monotonic() - t0
        th = self.th
        inputs = th.inputs(case)
        args = [tvm.runtime.from_dlpack(x) for x in inputs]
        main = vm["main"]
        ms = th.time(lambda: main(*args), lambda: th.refresh(case, inputs), self.args.iters, self.args.warmup)
        host = []
        for _ in range(20):
            th.torch.cuda.synchronize()
            t0 = time.perf_counter()
            main(*args)
            host.append((time.perf_counter() - t0) * 1e6)
        th.torch.cuda.synchronize()
        direct_host = []
        fn, outputs = self.direct.get(name), th.outputs(case.partition)
        for _ in range(20 if fn else 0):
            th.torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn(*inputs, *outputs)
            direct_host.append((time.perf_counter() - t0) * 1e6)
        th.torch.cuda.synchronize()
        return {"case": case.name, "config": config.name, "vm_ms": ms, "vm_host_us": statistics.median(host),
                "direct_host_us": statistics.median(direct_host) if direct_host else None,
                "compile_s": round(compile_s, 1)}

    def run(self) -> dict:
        import torch

        Path(self.args.out).mkdir(parents=True, exist_ok=True)
        self.th = Torch()
        self.gpu = torch.cuda.get_device_name(0)
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        out = Path(self.args.out)
        out.mkdir(parents=True, exist_ok=True)
        t_start = time.monotonic()
        plain_ms: dict = {}
        choices = select.tune([c.partition for c in self.cases], self.measure, self.gpu,
                              space=self.args.space, top_k=self.args.top_k, num_sms=num_sms, plain_ms=plain_ms,
                              include_default=self.args.with_default)
        rows = []
        for case in self.cases:
            choice = choices.get(case.partition.symbol)
            if choice is None:
                _log(f"{case.name}: no candidate built and verified; see bench_gemm_kernels.json")
                continue
            rec = next(r for r in self.kernels.values()
                       if r["case"] == case.name and r["config"] == choice.config.name and r["ms"] == choice.time_ms)
            baselines = self.torch_rows(case)
            default_ms = choice.fused_ms.get(select.default_config(DTYPE), math.nan)
            for label, torch_ms in baselines.items():
                p = case.problem
                rows.append({
                    "group": case.group, "case": case.epilogue, "problem": p.label, "m": p.m, "n": p.n, "k": p.k,
                    "layout": case.partition.gemm.layout_name, "config": choice.config.name,
                    "ours_ms": choice.time_ms, "default_config_ms": default_ms, "baseline": label,
                    "torch_ms": torch_ms, "speedup": torch_ms / choice.time_ms, "rel_err": rec["rel_err"],
                    "ours_tflops": _tflops(p, choice.time_ms),
                    "mainloop_ms": {c.name: v for c, v in choice.mainloop_ms.items()},
                    "fused_ms": {c.name: v for c, v in choice.fused_ms.items()},
                })
        report = self.report(rows, time.monotonic() - t_start)
        self.write(report, out)
        if not self.args.no_vm_check:
            try:
                case = min((c for c in self.cases if c.epilogue == "gemm"), key=lambda c: c.problem.m * c.problem.n)
                choice = choices[case.partition.symbol]
                vm = self.vm_overhead(case, choice.config)
                direct = next(r for r in rows if r["case"] == "gemm" and r["problem"] == case.problem.label)
                vm["direct_ms"] = direct["ours_ms"]
                vm["overhead_ms"] = vm["vm_ms"] - direct["ours_ms"]
                report["vm_route"] = vm
            except Exception as err:  # noqa: BLE001
                report["vm_route"] = {"error": f"{type(err).__name__}: {str(err)[:500]}"}
            self.write(report, out)
        return report

    def report(self, rows, seconds) -> dict:
        import torch

        return {
            "gpu": self.gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
            "nvcc": toolchain.nvcc_version(toolchain.find_nvcc()), "cutlass": toolchain.cutlass_version(),
            "codegen": CODEGEN_VERSION, "python": platform.python_version(),
            "mode": "quick" if self.args.quick else "full", "space": self.args.space, "top_k": self.args.top_k,
            "iters": self.args.iters, "warmup": self.args.warmup, "tolerance": TOLERANCE,
            "selection_cache": str(select.cache_path()), "seconds": round(seconds, 1),
            "builds": self.builds, "rows": rows, "kernels": self.kernels,
        }

    def write(self, report: dict, out: Path) -> None:
        (out / "bench_gemm.json").write_text(json.dumps(_clean(report), indent=1, default=_json_default))
        (out / "bench_gemm.md").write_text(markdown(report))
        _log(f"wrote {out / 'bench_gemm.md'} and {out / 'bench_gemm.json'}")


def _json_default(x):
    return str(x)


def _clean(x):
    """Strict JSON: non-finite floats become null."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


GROUPS = {
    "a": "plain GEMM", "b": "GEMM+bias+GELU (+aux store)", "c": "GEMM + column-sum (bias grad)",
    "d": "GEMM+bias+dropout+residual", "e": "GEMM x activation-grad mask",
}


def markdown(report: dict) -> str:
    lines = [
        f"# EVT GEMM benchmark — {report['gpu']}",
        "",
        f"torch {report['torch']} (CUDA {report['cuda']}), nvcc {report['nvcc']}, CUTLASS {report['cutlass']}, "
        f"codegen {report['codegen']}; bf16, median of {report['iters']} runs (CUDA events, fresh inputs, "
        f"poisoned outputs); mode {report['mode']}, search space {report['space']}, top-k {report['top_k']}.",
        "Speedup = torch ms / ours ms (>1: ours faster). Every kernel matched a float32 torch reference "
        f"(relative L2 error <= {report['tolerance']}) before timing.",
        "",
        "| | case | problem | M×N×K (layout) | config | ours ms | TFLOP/s | torch variant | torch ms | speedup | "
        "default cfg ms | rel err |",
        "|---|---|---|---|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['group']} | {GROUPS[r['group']]}: {r['case']} | {r['problem']} | {r['m']}×{r['n']}×{r['k']} "
            f"({r['layout']}) | {r['config']} | {r['ours_ms']:.3f} | {r['ours_tflops']:.0f} | {r['baseline']} | "
            f"{r['torch_ms']:.3f} | **{r['speedup']:.2f}** | {_fmt(r['default_config_ms'])} | {_fmt(r['rel_err'], 'e')} |"
        )
    vm = report.get("vm_route")
    if vm:
        lines += ["", "## Relax VM route vs direct FFI call", ""]
        if "error" in vm:
            lines.append(f"VM route failed: {vm['error']}")
        else:
            lines.append(
                f"{vm['case']} ({vm['config']}): VM {vm['vm_ms']:.3f} ms vs direct {vm['direct_ms']:.3f} ms "
                f"(overhead {vm['overhead_ms'] * 1e3:.1f} µs GPU-timed; host time per call: VM {vm['vm_host_us']:.0f} µs, "
                f"direct {_fmt(vm['direct_host_us'])} µs; "
                f"tvm.compile {vm['compile_s']} s)."
            )
    failed = {k: v for k, v in report["kernels"].items() if v.get("error")}
    if failed:
        lines += ["", "## Candidates that failed (excluded from selection)", ""]
        lines += [f"- {k}: {v['error']}" for k, v in sorted(failed.items())]
    lines += ["", "Builds: " + "; ".join(
        f"{b['built']} built, {b['cached']} cached, {b['failed']} failed in {b['seconds']} s" for b in report["builds"])]
    return "\n".join(lines) + "\n"


def _fmt(x, how="f") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–"
    return f"{x:.3f}" if how == "f" else f"{x:.1e}"


# ------------------------------------------------------------------------------------ the CLI
def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="bench_gemm.py",
        description="EVT GEMM+epilogue kernels vs torch on BERT-Large GEMM shapes (needs an SM90 GPU and nvcc). "
        "Kernels are built in parallel up front and cached under $XDG_CACHE_HOME/tvm_evt.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--out", default="./bench_out", help="output directory (bench_gemm.md, bench_gemm.json)")
    ap.add_argument("--quick", action="store_true", help="5 GEMM shapes, 5 fused cases, the 'quick' search space")
    ap.add_argument("--cases", metavar="NAMES",
                    help="only the cases whose name contains one of these comma-separated strings, e.g. "
                    "'gemm_QKV_dW,dropout_residual' (names: evt_<epilogue>_<problem>)")
    ap.add_argument("--space", choices=sorted(select.SPACES), default=None,
                    help="candidate table size (default: 'quick' with --quick, else 'default')")
    ap.add_argument("--top-k", type=int, default=None, help="main-loop configs re-profiled with the epilogue (default 1 with --quick, else 2)")
    ap.add_argument("--with-default", action=argparse.BooleanOptionalAction, default=None,
                    help="also re-profile the default config with each epilogue (default: on with --quick)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel nvcc processes")
    ap.add_argument("--iters", type=int, default=25, help="timed runs per kernel (median)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-vm-check", action="store_true", help="skip measuring the Relax VM route's overhead")
    ap.add_argument("--emit-only", metavar="DIR", help="write every candidate's C++ source to DIR and exit (no GPU)")
    ap.add_argument("--prebuild", action="store_true",
                    help="build (into the cache, no GPU) every kernel a run builds before it has timings: the "
                    "main-loop candidates and each fused case on the default configuration and its variants")
    return ap


def prebuild(cases: list[Case], args) -> dict:
    """Build what ``select.tune`` builds when no timing is known, i.e. everything but the fused
    kernels of the main loops a GPU run will rank first; nothing is timed or persisted."""
    stats = []

    def build_only(jobs):
        sources = {}
        for name, (p, cfg) in jobs.items():
            try:
                sources[name] = emit(p, cfg)
            except Unsupported:
                continue
        _log(f"building {len(sources)} kernels with {args.jobs} jobs")
        stats.append(build_tolerant(sources, args.jobs)[2])
        return {n: math.inf for n in jobs}

    with tempfile.TemporaryDirectory() as tmp:
        select.tune([c.partition for c in cases], build_only, "prebuild", space=args.space, top_k=args.top_k,
                    include_default=True, cache=select.SelectionCache(Path(tmp) / "select.json"))
    return {k: sum(s[k] for s in stats) for k in ("built", "cached", "failed", "seconds")}


def emit_all(cases: list[Case], space: str, directory: Path) -> list[Path]:
    """Every kernel a run could build: plain candidates and each fused case on every candidate."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for case in cases:
        plain = select.plain_partition(case.partition, symbol=f"evt_plain_{case.name}")
        for cfg in select.candidates(case.partition, space):
            for p in {plain.symbol: plain, case.name: case.partition}.values():
                name = f"{p.symbol}__{cfg.name}"
                path = directory / f"{name}.cu"
                path.write_text(emit(dataclasses.replace(p, symbol=name), cfg))
                paths.append(path)
    return sorted(set(paths))


def gpu_problem() -> str | None:
    """Why this machine cannot run the benchmark, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible to torch {torch.__version__} (this benchmark needs an SM90 GPU, e.g. H100)"
    major, minor = torch.cuda.get_device_capability(0)
    if (major, minor) != (9, 0):
        return f"GPU {torch.cuda.get_device_name(0)} is sm_{major}{minor}; the kernels are built for sm_90a (H100/H200)"
    if toolchain.find_nvcc() is None:
        return "nvcc not found (set TVM_EVT_NVCC or CUDA_HOME)"
    return None


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    args.space = args.space or ("quick" if args.quick else "default")
    args.top_k = args.top_k if args.top_k is not None else (1 if args.quick else 2)
    args.with_default = args.quick if args.with_default is None else args.with_default
    if args.emit_only:
        paths = emit_all(pick_cases(bert_cases(args.quick), args.cases), args.space, Path(args.emit_only))
        print(f"wrote {len(paths)} kernel sources to {args.emit_only}")
        return 0
    if args.prebuild:
        print(f"prebuilt: {prebuild(pick_cases(bert_cases(args.quick), args.cases), args)}")
        return 0
    why = gpu_problem()
    if why:
        print(f"bench_gemm: cannot run: {why}.", file=sys.stderr)
        return 2
    report = Bench(args).run()
    print(markdown(report))
    return 0
