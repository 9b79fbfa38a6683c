"""The EVT graph passes (ASPLOS'24): rewrites of the joint forward + backward graph that expose
GEMM-epilogue fusion, run in the order of ``graph_passes.evt_graph_passes``."""
