#!/usr/bin/env python3
"""The measured host peaks of bench/host/results/host.jsonl as a Markdown table (GiB, 2^30).

    python3 bench/host/table.py [bench/host/results/host.jsonl]
"""

import json
import sys

GIB = 2**30


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else "bench/host/results/host.jsonl"
    print("| case | peak | rss at peak | cache at peak | detail |")
    print("|---|---:|---:|---:|---|")
    for line in open(path):
        r = json.loads(line)
        case, sample, work = r["case"], r["at_peak_sample"], r.get("workload", {})
        if case["kind"] == "load":
            detail = (f"{r['checkpoint']['params'] / 1e6:.0f}M params, files {r['checkpoint']['checkpoint_bytes'] / GIB:.3f} GiB, "
                      f"loaded {work.get('loaded_dtype', '?')}, before load {work.get('usage_before_load', 0) / GIB:.3f}")
        elif case["kind"] == "input":
            detail = f"batch {work.get('batch_bytes', 0) / 2**20:.2f} MiB"
        elif case["kind"] == "save":
            detail = (f"{work.get('params', 0) / 1e6:.0f}M params, train baseline {work.get('train_baseline', 0) / GIB:.3f}, "
                      f"spike {work.get('spike', 0) / GIB:.3f}, written {work.get('written_bytes', 0) / GIB:.3f}")
        else:
            detail = ""
        ok = "" if r["ok"] else " (FAILED)"
        print(f"| {case['name']}{ok} | {r['peak_bytes'] / GIB:.3f} | {sample['rss'] / GIB:.3f} | {sample['cache'] / GIB:.3f} | {detail} |")


if __name__ == "__main__":
    main()
