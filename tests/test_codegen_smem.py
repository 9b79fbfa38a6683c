"""Shared memory: the model of CUTLASS's epilogue carve-out and main-loop stages, the fitting
configuration, legality's refusal, and relax.ext.evt's retry after an nvcc failure."""
import dataclasses
import os
import re
import shutil
import subprocess
import time

import pytest
import tvm
from tvm import relax

from tvm_evt.codegen import emit, from_function, lower, relax_ext
from tvm_evt.codegen.legality import CAPABILITIES, legality
from tvm_evt.codegen.backend import KernelConfig, Schedule, default_config, smem
from tvm_evt.codegen.build import BuildError, cache, toolchain


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path


def adamw_function(m=1000, n=64, k=32):
    """bert_tiny's word-embedding AdamW update as the partitioner formed it (train_step_evt0_40 on
    the H200): tf32 weight gradient + 3 fp32 aux loads (other gradient, m, v), both moments stored."""
    bb = relax.BlockBuilder()
    g_t = relax.Var("g_t", relax.TensorType((n, k), "float32"))
    x = relax.Var("x", relax.TensorType((m, k), "float32"))
    g2 = relax.Var("g2", relax.TensorType((m, n), "float32"))
    m1 = relax.Var("m1", relax.TensorType((m, n), "float32"))
    v1 = relax.Var("v1", relax.TensorType((m, n), "float32"))
    with bb.function("evt_adamw_moments", [g_t, x, g2, m1, v1]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(g_t, [1, 0])))
            g = bb.emit(relax.op.add(y, g2))
            m2 = bb.emit(relax.op.add(m1, relax.op.multiply(g, relax.const(0.1, "float32"))))
            v2 = bb.emit(relax.op.add(v1, relax.op.multiply(relax.op.multiply(g, g), relax.const(0.001, "float32"))))
            out = bb.emit_output(relax.Tuple([m2, v2]))
        bb.emit_func_output(out)
    return bb.get()["evt_adamw_moments"]


def many_loads_function(loads: int):
    """acc + sum of ``loads`` fp32 M x N aux loads: an epilogue no configuration can hold."""
    bb = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((512, 32), "float32"))
    w = relax.Var("w", relax.TensorType((256, 32), "float32"))
    rs = [relax.Var(f"r{i}", relax.TensorType((512, 256), "float32")) for i in range(loads)]
    with bb.function("evt_many_loads", [x, w, *rs]):
        with bb.dataflow():
            y = bb.emit(relax.op.matmul(x, relax.op.permute_dims(w, [1, 0])))
            for r in rs:
                y = bb.emit(relax.op.add(y, r))
            out = bb.emit_output(y)
        bb.emit_func_output(out)
    return bb.get()["evt_many_loads"]


def adamw_partition():
    return lower(from_function(adamw_function()))


# ------------------------------------------------------------------------------------ the model
def test_model_predicts_the_h200_failure():
    """Default tile 128x128x32, EpilogueTileAuto 128x32: 4 load / 2 store stages; D 32 KiB + 3 aux
    loads x 64 KiB + 1 aux store 32 KiB = 263,168 B, more than the 232,448 B of an SM90 CTA."""
    p = adamw_partition()
    u = smem.usage(p, default_config("float32"))
    assert u.epi_tile == (128, 32) and (u.stages_c, u.stages_d) == (4, 2)
    assert u.epilogue_bytes == 263168  # sizeof(CollectiveEpilogue::SharedStorage) printed by nvcc
    assert u.stage_bytes == 2 * 128 * 32 * 4 + 16
    assert u.stages < smem.MIN_STAGES and not u.fits
    assert "263,168 B" in u.describe() and "need 2" in u.describe()


def test_chosen_config_fits():
    p = adamw_partition()
    chosen = smem.fit_config(p, default_config("float32"))
    assert chosen == KernelConfig(tile=(128, 128, 32), epi_tile=(128, 16))
    u = smem.usage(p, chosen)
    # nvcc: sizeof(CollectiveEpilogue::SharedStorage) 131584, Stages 3, SharedStorageSize 229888
    assert (u.epilogue_bytes, u.stages, u.kernel_bytes) == (131584, 3, 229888) and u.fits
    assert relax_ext._config({}, p) == chosen
    assert legality(adamw_function()).ok


def test_model_matches_cutlass_for_kernels_that_build():
    """Numbers nvcc printed (sizeof of the epilogue's and the kernel's SharedStorage, Stages)."""
    from test_codegen_build import batched_kernel, dropout_kernel

    pp = KernelConfig(tile=(128, 128, 64), schedule=Schedule.PINGPONG)
    for p, cfg, want in (
        (dropout_kernel(), default_config("float16"), (33792, 6, 230400)),
        (batched_kernel(), default_config("bfloat16"), (58368, 5, 222208)),
        (batched_kernel(), pp, (29696, 6, 226304)),
        (adamw_partition(), KernelConfig(tile=(128, 64, 32)), (164864, 2, 214016)),
        (adamw_partition(), smem.conservative_configs(32)[1], (66048, 10, 229888)),
    ):
        u = smem.usage(p, cfg)
        assert (u.epilogue_bytes, u.stages, u.kernel_bytes) == want, cfg.name
        assert smem.fit_config(p, cfg) == cfg  # a configuration that fits is kept


def test_epilogue_tile_auto():
    assert smem.epilogue_tile(KernelConfig(), "float32") == (128, 32)
    assert smem.epilogue_tile(KernelConfig(tile=(64, 128, 64), schedule=Schedule.PINGPONG), "bfloat16") == (64, 32)
    assert smem.epilogue_tile(KernelConfig(tile=(128, 16, 64)), "float32") == (128, 16)
    assert smem.epilogue_tile(KernelConfig(epi_tile=(128, 16)), "float32") == (128, 16)


def test_config_choice_is_deterministic():
    p = adamw_partition()
    big = KernelConfig(tile=(128, 256, 32))
    order = smem.fallbacks(big)
    assert order == smem.fallbacks(big) and order[0] == big and len(set(order)) == len(order)
    assert [c.name for c in order[:6]] == [
        "coop_128x256x32_c1x1", "coop_128x256x32_c1x1_e128x16", "coop_128x128x32_c1x1",
        "coop_128x128x32_c1x1_e128x16", "coop_128x64x32_c1x1", "coop_128x64x32_c1x1_e128x16",
    ]
    assert smem.fit_config(p, big) == smem.fit_config(p, big) == KernelConfig(tile=(128, 256, 32), epi_tile=(128, 16))


# ----------------------------------------------------------------------------------- legality
def test_legality_refuses_an_epilogue_too_large_for_any_config():
    assert legality(many_loads_function(4)).ok
    result = legality(many_loads_function(14))
    assert not result.ok
    assert "shared memory" in result.reason and "232,448 B" in result.reason and "need 2" in result.reason
    assert "smallest: pp_64x64x32_c1x1_e64x16" in result.reason
    assert any("shared memory" in rule for rule in CAPABILITIES.rules)  # partition cache key


def test_partitioner_output_for_bert_tiny_adamw_fits(cache_home):
    """Reconstruct the failing module (scripts/train.py: bert_tiny, AdamW, fp32): every partition
    the partitioner forms gets a configuration that fits; the AdamW updates need the narrow
    epilogue subtile."""
    import tvm_evt
    import tvm_evt.models
    from tvm_evt.relax_passes.graph.graph_passes import evt_graph_passes
    from tvm_evt.relax_passes.partition.partition_evt import PartitionEVT

    m = tvm_evt.models.ZOO["bert_tiny"]()
    graph = tvm_evt.build_training_module(
        tvm_evt.from_torch(m.model, m.example_inputs(), m.loss_fn), tvm_evt.optim.AdamW(lr=1e-3), "fp32")
    mod = tvm.transform.Sequential(
        [evt_graph_passes(), relax.transform.CanonicalizeBindings(), PartitionEVT()])(graph.mod)
    narrowed = []
    for gv, func in mod.functions_items():
        if not (isinstance(func, relax.Function) and func.attrs and "Codegen" in func.attrs):
            continue
        p = lower(from_function(func))
        cfg = relax_ext._config({}, p)
        assert smem.usage(p, cfg).fits, gv.name_hint
        if not smem.usage(p, default_config(p.gemm.dtype_a)).fits:
            narrowed.append((gv.name_hint, cfg.name))
    assert narrowed and all(re.search(r"_e\d+x16$", name) for _, name in narrowed)  # narrow epilogue subtiles


# ------------------------------------------------------------------------- relax.ext.evt retry
def test_build_retries_with_the_conservative_config(monkeypatch):
    p = adamw_partition()
    cfg = relax_ext._config({}, p)
    kernels = {p.symbol: (p, cfg, emit(p, cfg))}
    calls = []
    err = BuildError("nvcc failed", name=p.symbol, stderr="x.hpp(137): error: static assertion failed\nmore")

    def fake_build_each(sources, jobs=None):
        calls.append(dict(sources))
        return {s: (err if len(calls) == 1 else f"/obj/{s}.o") for s in sources}

    monkeypatch.setattr(relax_ext, "build_each", fake_build_each)
    assert relax_ext.build_kernels(kernels) == {p.symbol: f"/obj/{p.symbol}.o"}
    retry = calls[1][p.symbol]  # the conservative configuration: 128x64 tile, 128x16 epilogue subtile
    assert len(calls) == 2 and "Shape<_128, _64, _32>" in retry and "Shape<_128, _16>" in retry

    calls.clear()
    monkeypatch.setattr(relax_ext, "build_each", lambda sources, jobs=None: {s: err for s in sources})
    with pytest.raises(BuildError) as exc:
        relax_ext.build_kernels(kernels)
    msg = str(exc.value)
    assert p.symbol in msg and cfg.name in msg and "x.hpp(137): error: static assertion failed" in msg
    assert "coop_128x64x32_c1x1_e128x16" in msg


# --------------------------------------------------------------------------------------- nvcc
def _need_nvcc():
    if toolchain.find_nvcc() is None:
        pytest.skip("nvcc absent")


@pytest.mark.slow
def test_nvcc_builds_the_failing_partition_with_the_chosen_config(cache_home):
    _need_nvcc()
    p = adamw_partition()
    cfg = relax_ext._config({}, p)
    start = time.monotonic()
    obj, cached = cache.build_object(emit(p, cfg), p.symbol)
    assert not cached and os.path.getsize(obj) > 0
    print(f"built {p.symbol} with {cfg.name} in {time.monotonic() - start:.0f}s")


@pytest.mark.slow
def test_model_matches_sizeof_printed_by_nvcc(tmp_path):
    """Compile the kernels' type declarations (no device code) and print CUTLASS's own numbers."""
    _need_nvcc()
    from test_codegen_build import batched_kernel, dropout_kernel

    jobs = [
        (adamw_partition(), default_config("float32")),
        (adamw_partition(), KernelConfig(tile=(128, 128, 32), epi_tile=(128, 16))),
        (dropout_kernel(), default_config("float16")),
        (batched_kernel(), KernelConfig(tile=(128, 128, 64), schedule=Schedule.PINGPONG)),
    ]
    parts, lines, want = [], [], []
    for i, (p, cfg) in enumerate(jobs):
        p = dataclasses.replace(p, symbol=f"smem{i}")
        head, kernel = emit(p, cfg).split("#endif  // TVM_EVT_PRELUDE", 1)
        if i == 0:
            parts.append(head + "#endif  // TVM_EVT_PRELUDE\n")
        u = smem.usage(p, cfg)
        cut = "int run(" if u.fits else "using CollectiveMainloop"
        parts.append(kernel[: kernel.index(cut)] + "}\n")
        ns = f"evt_smem{i}"
        more = (f"(int){ns}::CollectiveMainloop::DispatchPolicy::Stages, (int){ns}::GemmKernel::SharedStorageSize"
                if u.fits else "-1, -1")
        lines.append(f'  std::printf("%zu %d %d\\n", sizeof({ns}::CollectiveEpilogue::SharedStorage), {more});')
        want.append(f"{u.epilogue_bytes} {u.stages if u.fits else -1} {u.kernel_bytes if u.fits else -1}")
    src = tmp_path / "smem.cu"
    src.write_text("".join(parts) + "#include <cstdio>\nint main() {\n" + "\n".join(lines) + "\n}\n")
    exe = tmp_path / "smem"
    cmd = [toolchain.find_nvcc(), *toolchain.ARCH_FLAGS, "-std=c++17", "--expt-relaxed-constexpr",
           *[f"-I{d}" for d in toolchain.include_dirs()], str(src), "-o", str(exe)]
    subprocess.run(cmd, check=True, capture_output=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split("\n")[:-1]
    assert got == want


def test_tune_times_only_configs_that_fit(cache_home):
    from tvm_evt.codegen import select

    p = adamw_partition()
    jobs_seen = []

    def measure(jobs):
        jobs_seen.append(jobs)
        return {name: 1.0 for name in jobs}

    choices = select.tune([p], measure, gpu="g", space="quick")
    fused = jobs_seen[1]
    assert fused and all(smem.usage(q, cfg).fits for q, cfg in fused.values())
    assert smem.usage(p, choices[p.symbol].config).fits


def test_epilogue_subtile_n_is_a_multiple_of_16():
    with pytest.raises(ValueError):  # CUTLASS static_asserts N % 16 == 0 for an explicit subtile
        KernelConfig(tile=(128, 64, 64), epi_tile=(128, 8))
