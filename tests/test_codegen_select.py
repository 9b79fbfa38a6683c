"""Kernel configuration selection (no GPU): candidate pruning, the persisted cache, deterministic choice."""
import dataclasses
import json
import math

import pytest
from tvm import relax

from tvm_evt.codegen import Decomposition, KernelConfig, Schedule, bench, default_config, emit, select
from tvm_evt.codegen.frontend import from_function
from tvm_evt.codegen.ir.nodes import AuxLoad
from tvm_evt.codegen.passes import lower
from tvm_evt.codegen.relax_ext import _config


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TVM_EVT_SELECT", raising=False)
    monkeypatch.delenv("TVM_EVT_SELECT_GPU", raising=False)
    return tmp_path


def case(epilogue="gemm", kind="fwd", m=512, n=256, k=128):
    return bench.Case("x", epilogue, bench.Problem("p", kind, m, n, k)).build().partition


# ------------------------------------------------------------------------------------ candidates
def test_table_is_valid_and_named_uniquely():
    names = [c.name for c in select.CANDIDATES]
    assert len(set(names)) == len(names)
    assert select.CANDIDATES[0] == default_config("bfloat16")
    for cfg in select.CANDIDATES:
        assert KernelConfig.from_json(json.loads(json.dumps(cfg.to_json()))) == cfg


def test_config_rejects_pingpong_stream_k_and_stray_splits():
    with pytest.raises(ValueError):
        KernelConfig(schedule=Schedule.PINGPONG, tile=(64, 128, 64), decomposition=Decomposition.STREAM_K)
    with pytest.raises(ValueError):
        KernelConfig(splits=4)
    assert KernelConfig(decomposition=Decomposition.SPLIT_K, splits=4).name == "coop_128x128x64_c1x1_splitk4"


def test_small_m_keeps_only_small_tiles():
    kept = select.prune(select.CANDIDATES, m=64, n=4096, k=1024)
    assert kept and all(c.tile[0] == 64 for c in kept)
    assert all(c.schedule is Schedule.PINGPONG for c in kept)


def test_thin_long_k_output_keeps_128_row_tiles_only_to_split_k():
    # 32 rows, K ~ 16000 (XML-CNN's weight gradients): a handful of output tiles streams a 75 MB
    # operand, so K-split 128-row tiles stay (their padding rows cost no memory traffic) ...
    kept = select.prune(select.CANDIDATES, m=32, n=2400, k=15776)
    assert any(c.decomposition is Decomposition.SPLIT_K and c.tile[0] == 128 for c in kept)
    assert any(c.decomposition is Decomposition.STREAM_K and c.tile[0] == 128 for c in kept)
    assert all(c.tile[0] == 64 for c in kept if c.decomposition is Decomposition.DATA_PARALLEL)
    # ... but not over a short K, nor over as many output tiles as a thin output's full wave
    assert all(c.tile[0] == 64 for c in select.prune(select.CANDIDATES, m=32, n=768, k=512))
    assert all(c.tile[0] == 64 for c in select.prune(select.CANDIDATES, m=32, n=8192, k=4096))


def test_clusters_and_big_tiles_pruned_for_small_problems():
    kept = select.prune(select.CANDIDATES, m=128, n=128, k=1024)
    assert all(c.cluster == (1, 1, 1) for c in kept)
    assert all(c.tile[0] <= 128 and c.tile[1] <= 128 for c in kept)


def test_stream_k_only_for_long_k():
    def has_sk(m, n, k):
        return any(c.decomposition is Decomposition.STREAM_K for c in select.prune(select.CANDIDATES, m, n, k))

    assert has_sk(1024, 1024, 16384)  # weight gradient: 64 output tiles, K = 16384
    assert not has_sk(16384, 4096, 1024)  # forward FFN1: thousands of tiles, short K


def test_candidates_per_space_and_tf32_k_tile():
    p = case(m=4096, n=4096, k=256)
    quick, default, full = (select.candidates(p, s) for s in ("quick", "default", "full"))
    assert len(quick) < len(default) < len(full)
    assert quick[0] == default_config("bfloat16")
    tf32 = bench.Case("x", "gemm", bench.Problem("p", "fwd", 4096, 4096, 256))
    p32 = dataclasses.replace(p, gemm=dataclasses.replace(p.gemm, dtype_a="float32", dtype_b="float32"))
    assert all(c.tile[2] == 32 for c in select.candidates(p32, "full"))
    assert tf32.problem.m == 4096


def test_narrow_problems_get_tiles_fitted_to_their_n_and_k():
    """MobileNet's first stages (N or K of 16-96 over a million pixels) are offered tiles as wide
    as their N and, for a 16-bit K of at most 32, as deep as K; wide problems are offered none."""
    names = lambda m, n, k: [c.name for c in select.narrow_configs(m, n, k)]  # noqa: E731
    assert names(1605632, 96, 16) == ["coop_128x96x32_c1x1", "coop_256x96x32_c1x1", "pp_128x96x32_c1x1"]
    assert names(1605632, 16, 96) == ["coop_128x16x64_c1x1", "coop_256x16x64_c1x1", "pp_128x16x64_c1x1"]
    assert names(401408, 144, 24)[0] == "coop_128x128x32_c1x1"  # a short K alone
    assert names(401408, 40, 240)[0] == "coop_128x48x64_c1x1"
    assert names(4096, 4096, 256) == [] and names(16384, 128, 64) == []
    assert all(c.tile[2] == 32 for c in select.narrow_configs(1605632, 16, 32, "float32"))  # tf32's K tile as ever
    # candidates add them to every space, once, and prune keeps the 32-deep K tile only where K fits it
    p = case(m=1605632, n=32, k=16)
    quick = select.candidates(p, "quick")
    assert {"coop_128x32x32_c1x1", "coop_256x32x32_c1x1", "pp_128x32x32_c1x1"} <= {c.name for c in quick}
    assert len({c.name for c in quick}) == len(quick)
    assert not select.prune(select.narrow_configs(1605632, 96, 16), 1605632, 96, 64)
    for cfg in quick:
        src = emit(dataclasses.replace(p, symbol="evt_t"), cfg)
        assert f"Shape<_{cfg.tile[0]}, _{cfg.tile[1]}, _{cfg.tile[2]}>" in src


def test_every_candidate_emits_for_every_bench_case():
    for c in bench.bert_cases(quick=True):
        for cfg in select.candidates(c.partition, "full"):
            src = emit(dataclasses.replace(c.partition, symbol="evt_t"), cfg)
            assert f"Shape<_{cfg.tile[0]}, _{cfg.tile[1]}, _{cfg.tile[2]}>" in src


# ------------------------------------------------------------------------------------ emitter
def test_emitter_tile_scheduler():
    p = case()
    default = emit(p)
    assert "cutlass::gemm::PersistentScheduler>" in default and "decomposition_mode" not in default
    assert "tvm_evt::launch<Gemm>" in default and "ResettingStreamK" not in default  # source unchanged
    sk = emit(p, KernelConfig(decomposition=Decomposition.STREAM_K))
    assert "tvm_evt::ResettingStreamK>" in sk and "DecompositionMode::StreamK;" in sk
    split = emit(p, KernelConfig(decomposition=Decomposition.SPLIT_K, splits=3))
    assert "args.scheduler.splits = 3;" in split and "DecompositionMode::SplitK;" in split
    for src in (sk, split):  # the self-clearing scheduler, its selector and the launcher that keeps
        assert src.count("struct ResettingStreamKScheduler") == 1  # the workspace
        assert "TileSchedulerSelector<tvm_evt::ResettingStreamK, arch::Sm90" in src
        assert "tvm_evt::launch_kept<Gemm>" in src
        # under CUDA-graph capture the kept workspace's cudaMalloc would end the capture: launch's path
        assert "cudaStreamIsCapturing(stream, &capture)" in src


# ------------------------------------------------------------------------------------ signatures
def test_plain_partition_matches_relax_plain_gemm():
    for kind in ("fwd", "dgrad", "wgrad"):
        fused = case("bias_gelu_aux" if kind == "fwd" else "gelu_bwd", kind)
        plain = case("gemm", kind)
        assert select.signature(select.plain_partition(fused)) == select.signature(plain)
        assert select.signature(fused) != select.signature(plain)


def test_signature_ignores_symbol():
    p = case("colsum", "dgrad")
    assert select.signature(p) == select.signature(dataclasses.replace(p, symbol="evt_other"))


# ------------------------------------------------------------------------------------ the cache
def test_cache_round_trip(cache_home):
    store = select.SelectionCache()
    assert store.path == cache_home / "tvm_evt" / f"select-v{select.CODEGEN_VERSION}.json"
    cfg = KernelConfig(tile=(128, 256, 64), cluster=(2, 1, 1))
    store.put("sig", "NVIDIA H100 80GB HBM3", cfg, {cfg: 1.5, default_config("bfloat16"): math.inf})
    assert select.SelectionCache().get("sig", "NVIDIA H100 80GB HBM3") == cfg
    assert store.get("sig", "NVIDIA H200") is None and store.get("other", "NVIDIA H100 80GB HBM3") is None
    store.put("sig2", "NVIDIA H100 80GB HBM3", default_config("bfloat16"))  # merges, keeps the first
    assert store.get("sig", "NVIDIA H100 80GB HBM3") == cfg
    data = json.loads(store.path.read_text())
    assert set(data) == {select.entry_key(s, "NVIDIA H100 80GB HBM3") for s in ("sig", "sig2")}
    assert [p.name for p in store.path.parent.iterdir() if p.suffix == ".tmp"] == []


def test_corrupt_cache_is_ignored(cache_home):
    store = select.SelectionCache()
    store.path.parent.mkdir(parents=True)
    store.path.write_text("{not json")
    assert store.get("sig", "gpu") is None
    store.put("sig", "gpu", default_config("bfloat16"))
    assert store.get("sig", "gpu") == default_config("bfloat16")


# ------------------------------------------------------------------------------------ choice
def fake_measure(plain_ms, fused_ms, calls):
    """Timings by config name; plain jobs are named evt_plain_*."""
    def measure(jobs):
        calls.append(sorted(jobs))
        out = {}
        for name, (p, cfg) in jobs.items():
            table = plain_ms if name.startswith("evt_plain_") else fused_ms
            out[name] = table.get(cfg.name, math.inf)
        return out
    return measure


def test_tune_two_stages_is_deterministic_and_persisted(cache_home):
    p = case("bias_gelu_aux", "fwd", m=4096, n=4096, k=256)
    names = [c.name for c in select.candidates(p, "default")]
    plain_ms = {n: 2.0 for n in names}
    plain_ms.update({"coop_128x256x64_c1x1": 1.0, "pp_128x128x64_c1x1": 1.0, "coop_256x128x64_c2x1": 1.1})
    # the epilogue changes the order: the tie in the main loop goes to the table order, then the
    # epilogue makes ping-pong the winner
    fused_ms = {"coop_128x256x64_c1x1": 1.4, "pp_128x128x64_c1x1": 1.2, "coop_128x128x64_c1x1": 2.5,
                "coop_256x128x64_c2x1": 0.1}
    calls = []
    choices = select.tune([p], fake_measure(plain_ms, fused_ms, calls), gpu="fake-gpu", top_k=2)
    choice = choices[p.symbol]
    assert choice.config.name == "pp_128x128x64_c1x1" and choice.time_ms == 1.2
    # stage 2 timed only the top 2 main loops and the default (never coop_256x128, ranked 3rd)
    assert len(calls) == 2 and len(calls[0]) == len(names)
    # (each also with the narrow epilogue subtile)
    picked = ["coop_128x256x64_c1x1", "pp_128x128x64_c1x1", "coop_128x128x64_c1x1"]
    variants = ["coop_128x256x64_c1x1_e128x16", "pp_128x128x64_c1x1_e64x16", "coop_128x128x64_c1x1_e128x16"]
    assert sorted(c.split("__")[1] for c in calls[1]) == sorted(picked + variants)
    calls = []
    select.tune([p], fake_measure(plain_ms, fused_ms, calls), gpu="other-gpu", top_k=2, epilogue_tiles=False)
    assert sorted(c.split("__")[1] for c in calls[1]) == sorted(picked)
    assert select.lookup(p, gpu="fake-gpu") == choice.config
    again = select.tune([p], fake_measure(plain_ms, fused_ms, []), gpu="fake-gpu", top_k=2)
    assert again[p.symbol].config == choice.config


def test_tune_ties_and_failures(cache_home):
    p = case("colsum", "dgrad", m=4096, n=4096, k=256)
    plain_ms = {c.name: 1.0 for c in select.candidates(p, "quick")}
    fused_ms = {n: 1.0 for n in plain_ms}
    fused_ms[select.CANDIDATES[0].name] = math.inf  # the default failed to verify
    choices = select.tune([p], fake_measure(plain_ms, fused_ms, []), gpu="g", space="quick", top_k=2)
    assert choices[p.symbol].config == select.CANDIDATES[1]  # equal times: first in table order that ran


def test_tune_plain_partition_needs_no_second_stage(cache_home):
    p = case("gemm", "wgrad", m=1024, n=1024, k=16384)
    names = [c.name for c in select.candidates(p, "default")]
    assert "coop_128x128x64_c1x1_streamk" in names
    plain_ms = {n: 3.0 for n in names}
    plain_ms["coop_128x128x64_c1x1_streamk"] = 1.0
    calls = []
    choices = select.tune([p], fake_measure(plain_ms, {}, calls), gpu="g")
    assert len(calls) == 1 and choices[p.symbol].config.decomposition is Decomposition.STREAM_K


def test_relax_ext_uses_persisted_choice(cache_home, monkeypatch):
    p = case("gelu_bwd", "dgrad")
    cfg = KernelConfig(tile=(64, 128, 64), schedule=Schedule.PINGPONG)
    select.SelectionCache().put(select.signature(p), "fake-gpu", cfg)
    monkeypatch.setenv("TVM_EVT_SELECT_GPU", "fake-gpu")
    assert _config({}, p) == select.heuristic_config(p)  # selection is opt-in
    assert _config({"select": True}, p) == cfg
    monkeypatch.setenv("TVM_EVT_SELECT", "1")
    assert _config({}, p) == cfg
    assert _config({"tile": [128, 256, 64]}, p).tile == (128, 256, 64)  # explicit options win
    monkeypatch.delenv("TVM_EVT_SELECT_GPU")
    monkeypatch.setattr(select, "gpu_name", lambda: None)  # no GPU at build time: by shape
    assert _config({}, p) == select.heuristic_config(p)


@pytest.mark.parametrize("epilogue,kind,mnk,want", [
    ("gemm", "wgrad", (1024, 1024, 16384), "coop_128x128x64_c1x1_splitk2"),  # long K, one wave
    ("gemm", "wgrad", (1152, 128, 100352), "coop_128x128x64_c1x1_splitk14"),  # 9 tiles: 126 CTAs
    ("gemm", "wgrad", (768, 3072, 25216), "coop_128x128x64_c1x1_streamk"),  # 144 tiles: 1.1 waves
    ("gemm", "wgrad", (3072, 1024, 16384), "coop_128x256x64_c1x1_streamk"),  # 192: 1.45 waves
    ("gemm", "wgrad", (2304, 768, 25216), "coop_128x128x64_c1x1"),  # 108: one wave, data-parallel
    ("gemm", "wgrad", (1024, 4096, 16384), "coop_128x256x64_c1x1"),  # 128 tiles of 128x256: one wave
    ("gemm", "wgrad", (256, 128, 401408), "coop_128x64x64_c1x1_streamk"),  # 4 tiles of 128x64
    ("gemm", "wgrad", (512, 128, 100352), "coop_128x64x64_c1x1_streamk"),  # 8
    ("gemm", "wgrad", (512, 256, 100352), "coop_128x128x64_c1x1_splitk16"),  # 16: split-K
    # a thin output over long K: split-K 4, on 128x64 tiles while 4 slices of them fit a wave
    ("gemm", "wgrad", (32, 1200, 15904), "coop_128x64x64_c1x1_splitk4"),
    ("gemm", "wgrad", (32, 512, 3956), "coop_128x64x64_c1x1_splitk4"),
    ("gemm", "wgrad", (32, 2400, 15776), "coop_128x128x64_c1x1_splitk4"),  # 38 tiles of 128x64
    ("gemm", "wgrad", (32, 768, 512), "pp_64x256x64_c1x1"),  # short K: no split
    # ... but a thin output over a reduction longer than 4 slices of THIN_SLICE takes the long-K
    # rules (ResNet-50's weight gradients: 64 output channels, K = batch x 56 x 56, or a 7x7 stem's)
    ("gemm", "wgrad", (64, 256, 401408), "coop_128x64x64_c1x1_streamk"),
    ("gemm", "wgrad", (64, 152, 1605632), "coop_128x64x64_c1x1_streamk"),
    ("gemm", "wgrad", (64, 64, 401408), "coop_128x64x64_c1x1_streamk"),
    ("gemm", "wgrad", (64, 2048, 401408), "coop_128x128x64_c1x1_splitk8"),  # 16 tiles: split-K
    # N <= 64 over a weight gradient's long K: not the 128x64 data-parallel tiles (2 CTAs)
    ("gemm", "wgrad", (256, 64, 401408), "coop_128x64x64_c1x1_streamk"),
    ("gemm", "wgrad", (128, 64, 50176), "coop_128x64x64_c1x1_streamk"),
    ("gemm", "fwd", (16384, 1024, 1024), "pp_128x128x64_c1x1"),  # short K, many tiles
    ("gemm", "fwd", (16384, 4096, 1024), "pp_128x128x64_c2x1"),
    ("gemm", "fwd", (16384, 1024, 4096), "coop_128x256x64_c1x1"),  # long K, one store
    ("gemm", "fwd", (16384, 64, 512), "coop_128x64x64_c1x1"),  # head dim 64
    # 64 output channels over many rows: 256x64, half the tiles at no more padding
    ("gemm", "fwd", (1605632, 64, 152), "coop_256x64x64_c1x1"),  # a 7x7 stem's im2col GEMM
    ("gemm", "fwd", (401408, 64, 256), "coop_256x64x64_c1x1"),
    ("relu_bwd", "dgrad", (401408, 64, 256), "coop_256x64x64_c1x1"),
    # N under 128 or K at most 32 over many rows: tiles as wide as N and as deep as K, 256 rows
    # (MobileNetV2's first stages)
    ("gemm", "fwd", (1605632, 96, 16), "coop_256x96x32_c1x1"),
    ("relu_bwd", "dgrad", (1605632, 32, 16), "coop_256x32x32_c1x1"),
    ("gemm", "fwd", (1605632, 16, 96), "coop_256x16x64_c1x1"),
    ("relu_bwd", "dgrad", (401408, 24, 144), "coop_256x32x64_c1x1"),
    ("gemm", "fwd", (401408, 144, 24), "coop_256x128x32_c1x1"),  # a short K alone
    ("gemm", "fwd", (401408, 64, 24), "coop_256x64x32_c1x1"),
    ("gemm", "fwd", (8192, 96, 16), "coop_128x96x32_c1x1"),  # under two waves of 256-row tiles
    ("gemm", "fwd", (100352, 512, 128), "pp_128x128x64_c1x1"),  # K 128, nothing loaded: ping-pong
    ("relu_bwd", "dgrad", (100352, 512, 128), "coop_128x128x64_c1x1"),  # ... one M x N load needs K 256
    ("relu_bwd", "dgrad", (100352, 512, 256), "pp_128x128x64_c1x1"),
    ("gemm", "fwd", (512, 256, 128), "coop_128x128x64_c1x1"),  # small: the default
    ("bias_gelu_aux", "fwd", (16384, 4096, 1024), "coop_128x256x64_c1x1"),  # two stores and erf: no ping-pong
    ("bias_gelu_aux", "fwd", (16384, 2048, 1024), "coop_128x128x64_c1x1"),  # N < 4096: not measured
    ("dropout_residual", "fwd", (16384, 1024, 4096), "coop_128x128x64_c1x1"),  # Philox draws: no ping-pong
    # an M x N load and one store behind long K: the narrow-tile ping-pong lost on H100
    ("relu_bwd", "dgrad", (16384, 1024, 4096), "coop_128x256x64_c1x1"),
    ("relu_bwd", "dgrad", (16384, 1024, 2048), "coop_128x128x64_c1x1"),
    ("relu_bwd", "dgrad", (16384, 1024, 1536), "coop_128x128x64_c1x1"),
    ("relu_bwd", "dgrad", (16384, 1024, 1024), "pp_128x128x64_c1x1"),  # short K, light epilogue
    ("gelu_bwd", "dgrad", (16384, 1024, 4096), "coop_128x128x64_c1x1"),  # ... but not with erf
])
def test_heuristic_config_by_shape(epilogue, kind, mnk, want):
    m, n, k = mnk
    assert select.heuristic_config(case(epilogue, kind, m, n, k)).name == want


def _residual_relu_dgrad(m, n, k):
    """An input gradient whose epilogue loads two M x N operands: where(x > 0, A·B + residual, 0)."""
    bt = lambda *shape: relax.TensorType(shape, "bfloat16")  # noqa: E731
    a, b, res, pre = (relax.Var(name, bt(*shape)) for name, shape in
                      (("dy", (m, k)), ("w", (k, n)), ("res", (m, n)), ("pre", (m, n))))
    bb = relax.BlockBuilder()
    with bb.function("dgrad", [a, b, res, pre]):
        with bb.dataflow():
            total = bb.emit(relax.op.add(bb.emit(relax.op.matmul(a, b)), res))
            zero = relax.const(0.0, "bfloat16")
            out = bb.emit_output(bb.emit(relax.op.where(relax.op.greater(pre, zero), total, zero)))
        bb.emit_func_output(out)
    return lower(from_function(bb.get()["dgrad"]))


@pytest.mark.parametrize("k,want", [(256, "coop_128x128x64_c1x1"), (384, "pp_128x128x64_c1x1"),
                                    (512, "pp_128x128x64_c1x1")])
def test_two_loaded_operands_need_k_384_for_ping_pong(k, want):
    """ResNet-50's 1x1 input gradients that add the residual's gradient under the ReLU mask: at K
    256 one warp group's epilogue (two M x N loads, one store) is too long to hide behind the
    other's main loop (H200: 25088x1024 0.059 ms ping-pong / 0.051 cooperative)."""
    p = _residual_relu_dgrad(25088, 1024, k)
    assert sum(isinstance(node, AuxLoad) for node in p.epilogue.nodes) == 2
    assert select.heuristic_config(p).name == want


def test_heuristic_config_keeps_the_default_where_the_emitter_says_no(monkeypatch):
    p = case("gemm", "fwd", 16384, 1024, 1024)
    monkeypatch.setattr(select, "check_partition", lambda *a: False)
    assert select.heuristic_config(p) == default_config("bfloat16")


# ------------------------------------------------------------------------------------ the CLI
def test_bench_cli_without_gpu(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        bench.main(["--help"])
    assert exc.value.code == 0
    monkeypatch.setattr(bench, "gpu_problem", lambda: "no CUDA GPU is visible")
    assert bench.main(["--quick", "--out", str(tmp_path)]) == 2
    assert "cannot run: no CUDA GPU" in capsys.readouterr().err


def test_bench_emit_only(tmp_path):
    assert bench.main(["--quick", "--emit-only", str(tmp_path)]) == 0
    sources = sorted(tmp_path.glob("*.cu"))
    assert any("streamk" in s.name for s in sources) and any(s.name.startswith("evt_plain_") for s in sources)


def test_bench_cases_filter(tmp_path):
    names = [c.name for c in bench.pick_cases(bench.bert_cases(), "gemm_QKV_dW,dropout_residual")]
    assert names == ["evt_gemm_QKV_dW", "evt_dropout_residual_FFN2_fwd", "evt_dropout_residual_attnout_fwd"]
    assert bench.main(["--cases", "colsum_FFN1", "--emit-only", str(tmp_path)]) == 0
    assert {s.name.split("__")[0] for s in tmp_path.glob("*.cu")} == {"evt_plain_evt_colsum_FFN1_dX", "evt_colsum_FFN1_dX"}
    with pytest.raises(SystemExit, match="matches none of"):
        bench.pick_cases(bench.bert_cases(), "gemm_nope")


def test_tune_gives_no_choice_when_nothing_ran(cache_home):
    p = case("relu_bwd", "dgrad", m=4096, n=4096, k=256)
    assert select.tune([p], fake_measure({}, {}, []), gpu="g", space="quick") == {}
    assert select.lookup(p, gpu="g") is None


def test_colsum_partitions_also_try_atomic_sums(cache_home):
    p = case("colsum", "dgrad", m=4096, n=4096, k=256)
    plain_ms = {c.name: 1.0 for c in select.candidates(p, "quick")}
    fused_ms = {n: 1.0 for n in plain_ms}
    fused_ms["coop_128x128x64_c1x1_atomic"] = 0.5
    calls = []
    choices = select.tune([p], fake_measure(plain_ms, fused_ms, calls), gpu="g", space="quick", top_k=1,
                          epilogue_tiles=False)
    # the best main loop (top_k=1) is the default here; the shape heuristic's choice is timed too
    assert select.heuristic_config(p).name == "pp_128x128x64_c2x1"
    assert sorted(c.split("__")[1] for c in calls[1]) == ["coop_128x128x64_c1x1", "coop_128x128x64_c1x1_atomic",
                                                          "pp_128x128x64_c2x1", "pp_128x128x64_c2x1_atomic"]
    chosen = choices[p.symbol].config
    assert chosen.atomic_reduce and KernelConfig.from_json(json.loads(json.dumps(chosen.to_json()))) == chosen
    assert select.lookup(p, gpu="g") == chosen
    # no float32 row/column sum: no atomic variant
    assert select.reduction_variant(case("gelu_bwd", "dgrad"), default_config("bfloat16")) is None


def test_bench_prebuild_builds_what_needs_no_timing(cache_home, monkeypatch, capsys):
    built = []

    def fake_build(sources, jobs):
        built.extend(sources)
        return {}, {}, {"built": len(sources), "cached": 0, "failed": 0, "seconds": 0.0}

    monkeypatch.setattr(bench, "build_tolerant", fake_build)
    assert bench.main(["--quick", "--prebuild", "--jobs", "2"]) == 0
    assert "prebuilt: {'built': %d" % len(built) in capsys.readouterr().out
    plain = [n for n in built if n.startswith("evt_plain_")]
    fused = {n.split("__")[0]: [] for n in built if not n.startswith("evt_plain_")}
    for n in built:
        if not n.startswith("evt_plain_"):
            fused[n.split("__")[0]].append(n.split("__")[1])
    assert any(n.endswith("_streamk") for n in plain)  # the long-K weight gradients' candidates
    coop = ["coop_128x128x64_c1x1", "coop_128x128x64_c1x1_atomic", "coop_128x128x64_c1x1_e128x16",
            "coop_128x128x64_c1x1_e128x16_atomic"]
    pingpong = ["pp_128x128x64_c2x1", "pp_128x128x64_c2x1_atomic", "pp_128x128x64_c2x1_e64x16",
                "pp_128x128x64_c2x1_e64x16_atomic"]  # the shape heuristic's choice, and its variants
    assert sorted(fused["evt_colsum_FFN2_dX"]) == coop + pingpong
    assert sorted(fused["evt_gelu_bwd_FFN2_dX"]) == ["coop_128x128x64_c1x1", "coop_128x128x64_c1x1_e128x16",
                                                      "pp_128x128x64_c2x1", "pp_128x128x64_c2x1_e64x16"]
    assert select.SelectionCache().load() == {}  # nothing persisted


def _epilogue_case(m, n, k, stores):
    """A GEMM whose epilogue stores ``stores``: "f32" (the float32 result: a weight gradient),
    "bf16" (the result), "two_bf16" (the result and twice it), "bf16_f32" (the result and twice
    it in float32: two light stores, as ViT-B/16's residual-gradient sums with a layer norm's gamma)
    or "silu_pair" (the result and its SiLU: heavy arithmetic)."""
    from tvm import relax

    from tvm_evt.codegen.frontend import from_function
    from tvm_evt.codegen.passes import lower

    params, mm = bench._operands(bench.Problem("p", "dgrad", m, n, k))
    bb = relax.BlockBuilder()
    with bb.function("wide", params):
        with bb.dataflow():
            y = bb.emit(mm)
            two = relax.const(2.0, "bfloat16")
            outs = {
                "f32": lambda: [bb.emit(relax.op.astype(y, "float32"))],
                "bf16": lambda: [y],
                "two_bf16": lambda: [y, bb.emit(relax.op.multiply(y, two))],
                "bf16_f32": lambda: [y, bb.emit(relax.op.multiply(relax.op.astype(y, "float32"),
                                                                  relax.const(2.0, "float32")))],
                "silu_pair": lambda: [y, bb.emit(relax.op.nn.silu(y))],
            }[stores]()
            out = bb.emit_output(outs[0] if len(outs) == 1 else relax.Tuple(outs))
        bb.emit_func_output(out)
    return lower(from_function(bb.get()["wide"]))


@pytest.mark.parametrize("mnk,want", [
    ((16384, 1024, 4096), "pp_128x128x64_c1x1_e64x16"),  # long K: the narrow epilogue tile hides the stores
    ((25216, 768, 768), "pp_128x128x64_c1x1"),  # short K: ping-pong, as with one store
])
def test_heuristic_two_light_stores_take_ping_pong(mnk, want):
    p = _epilogue_case(*mnk, "bf16_f32")
    assert sum(type(n).__name__ == "AuxStore" for n in p.epilogue.nodes) == 2 and not select.alu_heavy(p)
    assert select.heuristic_config(p).name == want


@pytest.mark.parametrize("stores,mnk,want", [
    # Llama-7B's layer (hidden 4096, FFN 11008, 8192 tokens): wide outputs over K >= 4096
    ("f32", (11008, 4096, 8192), "pp_128x128x64_c1x1_e64x16"),  # a weight gradient into float32
    ("f32", (4096, 4096, 8192), "pp_128x128x64_c1x1_e64x16"),
    ("f32", (32000, 4096, 8192), "coop_128x256x64_c1x1"),  # past 16384: the head's, 128x256 measured faster
    ("f32", (4096, 1024, 16384), "coop_128x256x64_c1x1"),  # BERT-Large's FFN weight gradient: not wide
    ("bf16", (8192, 11008, 4096), "coop_128x256x64_c1x1"),  # one 16-bit store keeps 128x256
    ("two_bf16", (8192, 11008, 4096), "coop_256x128x64_c1x2_e128x16"),
    ("bf16_f32", (8192, 4096, 4096), "pp_128x128x64_c1x1_e64x16"),  # a float32 store at K 4096: as before
    ("bf16_f32", (8192, 4096, 32000), "coop_256x128x64_c1x2_e128x16"),  # ... but K >= 16384 (the head's dX)
    ("bf16_f32", (16384, 1024, 4096), "pp_128x128x64_c1x1_e64x16"),  # BERT-Large's and GPT-2's: not wide
    ("silu_pair", (8192, 11008, 4096), "pp_128x128x64_c2x1"),  # heavy, two stores
])
def test_heuristic_wide_outputs(stores, mnk, want):
    p = _epilogue_case(*mnk, stores)
    assert select.alu_heavy(p) == (stores == "silu_pair")
    assert select.heuristic_config(p).name == want
