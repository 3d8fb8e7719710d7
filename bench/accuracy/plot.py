#!/usr/bin/env python3
"""Plots the estimate against the measurement for every row of bench/accuracy (ground truth and
collected, fit and held-out) into docs/accuracy-fit.png.

Usage: python3 bench/accuracy/plot.py [--out PATH] [--csv FILE]
Needs matplotlib (`pip install matplotlib`; not part of the CI suite). Without --csv it runs the
accuracy example (`cargo run --release -p memguard-estimator --example accuracy -- --csv`).
"""
import argparse
import csv
import io
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def rows(csv_path):
    if csv_path:
        text = pathlib.Path(csv_path).read_text()
    else:
        text = subprocess.run(
            ["cargo", "run", "--quiet", "--release", "-p", "memguard-estimator",
             "--example", "accuracy", "--", "--csv"],
            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return list(csv.DictReader(io.StringIO(text)))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=str(ROOT / "docs" / "accuracy-fit.png"))
    ap.add_argument("--csv", help="the example's --csv output, instead of running it")
    args = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot.py needs matplotlib: pip install matplotlib")

    data = rows(args.csv)
    fig, ax = plt.subplots(figsize=(9, 8), dpi=110)
    lo, hi = 0.3, 200.0
    ax.plot([lo, hi], [lo, hi], color="black", lw=1, label="estimate = measured")
    ax.fill_between([lo, hi], [lo * 0.9, hi * 0.9], [lo * 1.1, hi * 1.1], color="grey",
                    alpha=0.2, label="±10 %")
    sources = sorted({r["source"] for r in data})
    colours = plt.get_cmap("tab10")
    for i, source in enumerate(sources):
        for split, marker in (("fit", "o"), ("held-out", "^")):
            pick = [r for r in data if r["source"] == source and r["split"] == split]
            scored = [r for r in pick if r["oom"] == "false" and r["unmodelled"] == "false"]
            unmodelled = [r for r in pick if r["oom"] == "false" and r["unmodelled"] == "true"]
            ooms = [r for r in pick if r["oom"] == "true"]
            c = colours(i % 10)
            if scored:
                ax.scatter([float(r["measured_bytes"]) / 1e9 for r in scored],
                           [float(r["estimated_bytes"]) / 1e9 for r in scored],
                           marker=marker, color=c, s=36, alpha=0.85,
                           label=f"{source} ({split}, {len(scored)})")
            if unmodelled:
                ax.scatter([float(r["measured_bytes"]) / 1e9 for r in unmodelled],
                           [float(r["estimated_bytes"]) / 1e9 for r in unmodelled],
                           marker=marker, facecolors="none", edgecolors=c, s=36,
                           label=f"{source} ({split}, unmodelled, {len(unmodelled)})")
            if ooms:
                # An OOM row has no measurement: drawn at the device's memory, which the
                # estimate must exceed (above the diagonal).
                ax.scatter([float(r["device_memory_bytes"]) / 1e9 for r in ooms],
                           [float(r["estimated_bytes"]) / 1e9 for r in ooms],
                           marker="X", color=c, s=70, edgecolors="black",
                           label=f"{source} ({split}, OOM at device memory, {len(ooms)})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("measured peak (GB)")
    ax.set_ylabel("estimated peak (GB)")
    ax.set_title("memguard estimator: estimate vs measured, every row\n"
                 "(circles: fit, triangles: held-out; X: OOM runs at the device's memory)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(args.out)
    print(f"wrote {args.out} ({len(data)} rows)")


if __name__ == "__main__":
    main()
