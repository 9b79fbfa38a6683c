"""PrebuildKernels: every kernel ``RunCodegen`` will ask for, built in one parallel batch.

``RunCodegen`` calls the codegens one after another (``relax.ext.evt``, ``evt_attention``,
``evt_conv``), and each builds its kernels in parallel: one wave of nvcc a codegen, so a model
with evt partitions and implicit-GEMM convolutions (ResNet-50) waited for two waves of CUTLASS
builds.  Right before ``RunCodegen``, this pass builds all of them at once into the content-keyed
object cache (``tvm_evt.codegen.relax_ext.prebuild``), where each codegen then finds its own.  The
7 kernels of tests/test_prebuild_kernels.py's module (an evt partition, 3 attention and 3
convolution calls) on a 2-core machine with nvcc 13.0, from an empty cache: 194 s codegen by
codegen (80 + 7 + 107), 163 s in one batch, after which the three codegens took 1.9 s (all cached).

An evt partition whose kernel nvcc rejects, and rejects again with the conservative configuration,
goes back to TVM: its ops are inlined into the caller (``InlineEVTPartitions``) with one warning
naming the partition and nvcc's first error line, so the step still builds and computes the same
values.  Otherwise the module is returned unchanged; an attention or convolution kernel that fails
is left to its codegen, which reports it.
"""
from __future__ import annotations

import warnings

import tvm

from ...codegen import relax_ext
from ..partition.inline_partitions import InlineEVTPartitions


class KernelBuildWarning(UserWarning):
    """A partition's kernel did not build; its ops run as TVM kernels instead."""


@tvm.transform.module_pass(opt_level=0, name="PrebuildKernels")
class PrebuildKernels:
    def __init__(self, jobs: int | None = None):
        self.jobs = jobs

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        failed = relax_ext.unbuildable(mod, relax_ext.prebuild(mod, jobs=self.jobs))
        for name, err in sorted(failed.items()):
            warnings.warn(f"relax.ext.evt: the kernel of partition {name} did not build ({err.first_error}); "
                          "its ops run as TVM kernels", KernelBuildWarning, stacklevel=2)
        return InlineEVTPartitions(only=set(failed))(mod) if failed else mod
