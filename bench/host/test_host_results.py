"""bench/host/measure.py and its committed results agree: every case the harness defines has
exactly one record in results/host.jsonl, run with the same parameters, successfully, with the
machine facts and versions; and the figures the estimator's replay test reads are there."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Loaded under its own name: bench/gpu has a measure.py too, and pytest runs both.
_spec = importlib.util.spec_from_file_location("host_measure", HERE / "measure.py")
measure = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(measure)

RESULTS = HERE / "results" / "host.jsonl"


def records() -> list:
    return [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]


def test_every_case_has_exactly_one_successful_record_with_its_parameters():
    by_name = {}
    for r in records():
        assert r["case"]["name"] not in by_name, f"two records of {r['case']['name']}"
        by_name[r["case"]["name"]] = r
    cases = {c["name"]: c for c in measure.cases()}
    assert set(by_name) == set(cases)
    for name, case in cases.items():
        r = by_name[name]
        assert r["case"] == case, name
        assert r["ok"], name
        assert r["peak_bytes"] > 0, name
        for fact in ("torch", "transformers", "kernel", "mem_total_bytes", "cgroup"):
            assert r["machine"][fact], (name, fact)


def test_the_figures_the_replay_reads_are_recorded():
    for r in records():
        kind = r["case"]["kind"]
        work = r.get("workload", {})
        if kind == "load":
            assert r["checkpoint"]["params"] > 0 and r["checkpoint"]["storage_dtype"]
            assert work["usage_after_load"] >= work["usage_before_load"] > 0
        elif kind == "input":
            assert work["batch_bytes"] > 0
        elif kind == "save":
            assert work["params"] > 0 and work["save_peak"] >= work["train_baseline"]
            assert work["spike"] == work["save_peak"] - work["train_baseline"]
