"""Kernel time a step by kind, from a bench_e2e.md "Top kernels" table: python3 kinds.py MD [SYSTEM]."""
import re
import sys

KINDS = [("CUTLASS partitions", r"^cutlass "), ("depthwise forward", r"depthwise_conv2d_fprop"),
         ("depthwise input gradient", r"depthwise_conv2d_dgrad"), ("depthwise weight gradient, first stage", r"depthwise_conv2d_wgrad"),
         ("batch-norm moments", r"column_moments"), ("sums", r"^sum\d*_kernel"), ("other TVM kernels", r"")]


def kinds(path: str, system: str = "tvm_evt") -> dict:
    text = open(path).read()
    start = text.index(f"/ {system} (")
    table = text[start:text.find("## Top kernels", start + 1)]
    out = {name: [0, 0.0] for name, _ in KINDS}
    for row in re.finditer(r"^\| `(.+?)` \| (\d+) \| ([\d.]+) \|", table, re.M):
        name = next(k for k, pattern in KINDS if re.search(pattern, row[1]))
        out[name][0] += int(row[2])
        out[name][1] += float(row[3])
    return out


if __name__ == "__main__":
    for name, (calls, ms) in kinds(*sys.argv[1:]).items():
        print(f"| {name} ({calls} launches) | {ms:.2f} |")
