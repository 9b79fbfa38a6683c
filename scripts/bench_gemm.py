#!/usr/bin/env python3
"""EVT GEMM + epilogue kernels vs torch on BERT-Large GEMM shapes (see --help and tvm_evt/codegen/bench.py).

    python scripts/bench_gemm.py --out bench_out            # full run (selection + all rows)
    python scripts/bench_gemm.py --quick --out bench_out    # 4 shapes, fewer configs
"""
import importlib.util
import sys
from pathlib import Path


def _codegen_bench():
    try:
        from tvm_evt.codegen import bench
    except ImportError:
        # an older install of the project without the benchmark: use this checkout's codegen package
        root = Path(__file__).resolve().parent.parent / "codegen"
        spec = importlib.util.spec_from_file_location(
            "tvm_evt.codegen", root / "__init__.py", submodule_search_locations=[str(root)]
        )
        if spec is None:
            raise
        import tvm_evt

        module = importlib.util.module_from_spec(spec)
        sys.modules["tvm_evt.codegen"] = module
        tvm_evt.codegen = module
        spec.loader.exec_module(module)
        from tvm_evt.codegen import bench
    return bench


if __name__ == "__main__":
    sys.exit(_codegen_bench().main(sys.argv[1:]))
