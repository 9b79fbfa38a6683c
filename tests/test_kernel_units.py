"""nvcc's work counted, not timed (issue #40: torchvision's ResNet-18 did not compile in 200 s, nor
ResNet-50 in 240 s, on 16 cores): kernels that are one CUTLASS type (the same kind, dtype, tile and
epilogue; shapes differ) compile as one translation unit, so a ResNet's ~30 s (one core) nvcc
builds are its kernel types, not its layers' shapes."""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import tvm

from tvm_evt.codegen import relax_ext
from tvm_evt.codegen.backend.conv import emit_conv, splits, tile
from tvm_evt.codegen.backend.kernel_type import kernel_type
from tvm_evt.codegen.build import cache
from tvm_evt.codegen.build.units import translation_units
from tvm_evt.codegen.frontend.conv_call import conv_of_function
from tvm_evt.codegen.ir.conv import ConvCall

sys.path.insert(0, str(Path(__file__).parent))
from test_cnn_layers import resnet18  # noqa: E402


def _conv(symbol: str, kind: str = "fprop", channels: int = 128, size: int = 28) -> ConvCall:
    return ConvCall(symbol=symbol, kind=kind, dtype="bfloat16", x=(2, size, size, channels),
                    w=(channels, 3, 3, channels), y=(2, size, size, channels), pad=(1, 1, 1, 1), stride=(1, 1),
                    dilation=(1, 1))


def test_shapes_share_a_type_tiles_and_kinds_do_not():
    a, b = emit_conv(_conv("a", size=28)), emit_conv(_conv("b", size=14))
    assert a != b and kernel_type(a) == kernel_type(b) is not None
    assert kernel_type(emit_conv(_conv("c", channels=64))) != kernel_type(a)  # a 64-wide tile
    assert kernel_type(emit_conv(_conv("d", kind="dgrad"))) != kernel_type(a)
    units = translation_units({"b": b, "a": a, "c": emit_conv(_conv("c", channels=64))})
    assert [names for names, _ in units] == [["a", "b"], ["c"]]
    (_, ab), (_, c) = units
    assert ab == a + b and c == emit_conv(_conv("c", channels=64))  # a unit of one is its source
    assert ab.count("__tvm_ffi_a(") == ab.count("__tvm_ffi_b(") == 1


def test_build_each_compiles_a_unit_once_and_a_failed_unit_kernel_by_kernel(monkeypatch, tmp_path):
    sources = {s: emit_conv(_conv(s, size=size)) for s, size in (("a", 28), ("b", 14), ("c", 7))}
    sources["d"] = emit_conv(_conv("d", kind="dgrad"))
    compiled = []

    def build_object(source, name="kernel", nvcc=None):
        compiled.append(source)
        return tmp_path / f"{len(compiled)}.o", False

    monkeypatch.setattr(cache, "build_object", build_object)
    built = cache.build_each(sources, progress=False)
    assert len(compiled) == 2  # the three fprops in one unit, the dgrad alone
    assert list(built) == list(sources) and built["a"] == built["b"] == built["c"] != built["d"]

    compiled.clear()

    def reject_units(source, name="kernel", nvcc=None):
        compiled.append(source)
        if source.count("__tvm_ffi_") > 2:  # more than one entry (each names its symbol twice)
            raise cache.BuildError("nvcc failed", name=name, stderr="unit.cu(1): error: too many")
        return tmp_path / f"{len(compiled)}.o", False

    monkeypatch.setattr(cache, "build_object", reject_units)
    built = cache.build_each(sources, progress=False)
    assert len(compiled) == 1 + 3 + 1  # the unit, then each of its kernels alone; the dgrad
    assert len({built[s] for s in "abcd"}) == 4 and not any(isinstance(p, cache.BuildError) for p in built.values())


@pytest.fixture(scope="module")
def resnet18_kernels() -> dict[str, str]:
    """symbol -> source of every kernel ``PrebuildKernels`` builds for torchvision's ResNet-18 (batch 8,
    64x64 images, channels-last, bf16, sm_90a), as the CUDA route builds them."""
    from tvm_evt import optim
    from tvm_evt.frontend import from_torch
    from tvm_evt.pipeline import phases
    from tvm_evt.training import build_training_module, hopper_target, runtime_module

    torch.manual_seed(0)
    x = torch.randn(8, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    graph = build_training_module(from_torch(resnet18(), (x, torch.randint(0, 1000, (8,))), F.cross_entropy),
                                  optim.AdamW(lr=1e-4), "bf16", inplace=True)
    target = hopper_target()
    passes = phases(target)
    at = [p.info.name for p in passes].index("PrebuildKernels")
    with target:
        mod = tvm.transform.Sequential(passes[:at])(runtime_module(graph.mod))
    return relax_ext.kernel_sources(mod), mod


def test_resnet18_compiles_its_kernel_types_not_its_kernels(resnet18_kernels, monkeypatch):
    """ResNet-18's 44 kernels (30 convolutions: 7 fprop, 7 wgrad and 16 dgrad, a strided one being
    four stride phases; 14 GEMMs) are 17 nvcc builds: a convolution unit per kind, tile and split."""
    sources, mod = resnet18_kernels
    units = translation_units(sources)
    assert len(sources) >= 40 and len(units) <= len(sources) // 2, (len(sources), len(units))

    convs = [conv_of_function(f) for _, f in mod.functions_items()
             if f.attrs and f.attrs.get("Codegen") == "evt_conv"]
    conv_units = [names for names, _ in units if "conv" in names[0]]
    assert len(convs) == sum(map(len, conv_units))
    assert len(conv_units) == len({(c.kind, tile(c), splits(c) > 1) for c in convs}), conv_units

    batches = []  # what PrebuildKernels hands to build_each: every kernel, nvcc once per unit
    monkeypatch.setattr(relax_ext, "build_each", lambda s, jobs=None: batches.append(s) or {})
    relax_ext.prebuild(mod)
    assert batches == [sources]


def test_each_codegen_builds_the_units_the_prebuild_did(resnet18_kernels, monkeypatch):
    """RunCodegen's evt and evt_conv codegens each build their own kernels: the units they form are
    those of the prebuild's batch (every kernel of a type is of one codegen), so they find them
    in the object cache."""
    sources, mod = resnet18_kernels
    by_codegen = {}
    for _, f in mod.functions_items():
        if f.attrs and "Codegen" in f.attrs:
            by_codegen.setdefault(str(f.attrs["Codegen"]), []).append(f)
    own = {**relax_ext.generate_sources(by_codegen["evt"]),
           **relax_ext.conv_sources([conv_of_function(f) for f in by_codegen["evt_conv"]])}
    assert own == sources
    gemm = {s: t for s, t in sources.items() if "conv" not in s}
    conv = {s: t for s, t in sources.items() if "conv" in s}
    assert sorted(translation_units(gemm) + translation_units(conv)) == sorted(translation_units(sources))


def test_a_unit_of_one_kernel_is_the_kernel_as_before():
    """A kernel alone (its unit of one) is built from its own source: the cache keys, and so the
    objects, of kernels that share no type are those of emitting them one by one."""
    src = emit_conv(dataclasses.replace(_conv("solo"), dtype="float16"))
    assert translation_units({"solo": src}) == [(["solo"], src)]


@pytest.mark.slow
def test_nvcc_builds_a_unit_whose_entries_each_check_their_arguments(tmp_path, monkeypatch):
    """A minute or two of nvcc, no GPU: two convolutions of one type are one object (one CUTLASS
    kernel), linked and exported with both entries, each checking its own shapes."""
    import shutil
    import subprocess

    import numpy as np

    from tvm_evt.codegen.build import kernel_entries, toolchain

    if toolchain.find_nvcc() is None or shutil.which("ld") is None:
        pytest.skip("nvcc absent")
    import tvm_ffi

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = [_conv("unit_a", size=28), _conv("unit_b", size=14)]
    lib = relax_ext.build_conv(calls)
    kernels = [o for o in (tmp_path / "tvm_evt").rglob("*.o") if kernel_entries(o) and "module-" not in o.name]
    assert len(kernels) == 1 and len(kernel_entries(kernels[0])) == 1  # one unit, one CUTLASS kernel
    assert set(relax_ext.kernel_partitions(kernel_entries(kernels[0])[0])) >= {"unit_a", "unit_b"}
    so = tmp_path / "unit.so"
    lib.export_library(str(so))
    syms = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True).stdout
    assert "__tvm_ffi_unit_a" in syms and "__tvm_ffi_unit_b" in syms
    module = tvm_ffi.load_module(str(so))
    for c in calls:
        x = tvm_ffi.from_dlpack(np.zeros(c.x, np.float32))
        with pytest.raises(ValueError, match=f"{c.symbol}.*x must be on cuda"):
            module[c.symbol](x, x, x)
