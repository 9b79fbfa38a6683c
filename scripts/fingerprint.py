#!/usr/bin/env python3
"""Hash the partitions and emitted kernel sources of every zoo and bench model (no GPU, no nvcc),
or compare two such files: the check that a refactoring changed no behaviour.

    python scripts/fingerprint.py --out before.json            # on the old tree
    python scripts/fingerprint.py --out after.json --compare before.json
"""
import argparse
import json
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="fingerprint.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=None, help="comma-separated names (default: all; see --list)")
    ap.add_argument("--list", action="store_true", help="print the model names and stop")
    ap.add_argument("--full", action="store_true", help="bench models at full size, not --quick's")
    ap.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    ap.add_argument("--out", default=None, help="write {model: fingerprint} as JSON here")
    ap.add_argument("--compare", default=None, help="a JSON of an earlier run: print what differs, exit 1 if any")
    args = ap.parse_args(argv)

    from tvm_evt import fingerprint as fp

    factories = fp.models(quick=not args.full)
    if args.list:
        print("\n".join(factories))
        return 0
    names = args.models.split(",") if args.models else list(factories)
    found = {}
    for name in names:
        start = time.monotonic()
        try:
            found[name] = fp.fingerprint(factories[name](), args.precision)
        except Exception as err:  # noqa: BLE001 - a model that fails is recorded, as the other tree must fail too
            found[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
        got = found[name]
        print(f"{name:24s} {time.monotonic() - start:6.1f} s  "
              + (got["error"] if "error" in got else
                 f"module {got['module']}, {len(got['partitions'])} partitions, {len(got['sources'])} sources"),
              flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(found, f, indent=1, sort_keys=True)
    if args.compare:
        with open(args.compare) as f:
            before = json.load(f)
        common = sorted(set(before) & set(found))
        diff = fp.differences({k: before[k] for k in common}, {k: found[k] for k in common})
        print("\n".join(diff) if diff else f"same partitions and sources on all {len(common)} models both have")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
