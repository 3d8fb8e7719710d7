"""bench/gpu/measure.py, rehearsed here: the cases' estimates through the real `memguard`
binary, the batch lengths, and the CPU rehearsal (the same code path as the GPU run on tiny
configs: real torch, transformers and peft, real `memguard estimate`).

The binary is ``MEMGUARD_BIN``, else ``target/debug/memguard`` (scripts/test.sh builds it first),
else it is built with cargo. The CPU rehearsal needs torch, transformers and peft
(scripts/install-deps.sh installs them); in CI (``CI=true``) it fails without them, elsewhere it
skips loudly.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(HERE))
import measure  # noqa: E402


@pytest.fixture(scope="module")
def memguard() -> str:
    path = os.environ.get("MEMGUARD_BIN") or str(ROOT / "target" / "debug" / "memguard")
    if not Path(path).is_file():
        subprocess.run(["cargo", "build", "-q", "-p", "memguard"], cwd=ROOT, check=True)
    return path


def write_config(tmp: Path, shape: measure.Shape) -> Path:
    path = tmp / shape.name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(measure.model_config_json(shape)))
    return path


def test_every_case_has_an_estimate_and_fits_an_h100(memguard: str, tmp_path: Path) -> None:
    estimates = {}
    for case in measure.gpu_cases():
        config = write_config(tmp_path, measure.SHAPES[case.shape])
        e = measure.memguard_estimate(memguard, case, config, "cuda")
        assert e["total_upper_bytes"] >= e["total_bytes"] > e["tensor_peak_bytes"] > 0
        # Every case must be able to run on one 80 GB H100.
        assert e["total_bytes"] < 75e9, (case.name, e["total_bytes"])
        estimates[case.name] = e["total_bytes"]
    even = estimates["llama-lora-b2-s4096-even"]
    # Padded batches of varying length fragment the allocator without expandable segments;
    # packed batches and expandable segments do not.
    assert estimates["llama-lora-b2-s4096-spread"] > even
    assert estimates["llama-lora-b2-s4096-spread-exp"] == even
    assert estimates["llama-lora-b2-s4096-packed"] == even
    assert len({c.name for c in measure.gpu_cases()}) == len(measure.gpu_cases())


def test_the_reserve_cases_have_estimates_that_state_the_spread_they_run(memguard: str, tmp_path: Path) -> None:
    cases = {c.name: c for c in measure.reserve_cases()}
    assert len(cases) == len(measure.reserve_cases())
    totals = {}
    for name, case in cases.items():
        config = write_config(tmp_path, measure.SHAPES[case.shape])
        e = measure.memguard_estimate(memguard, case, config, "cuda")
        assert 0 < e["total_bytes"] < 75e9, (name, e["total_bytes"])
        totals[name] = e["total_bytes"]
        flags = measure.estimate_args(case, config, "cuda")
        spread = float(flags[flags.index("--seq-length-spread") + 1])
        lengths = measure.batch_lengths(case)
        assert spread == round((max(lengths) - min(lengths)) / max(lengths), 3), (name, spread)
    # The drawn lengths fragment the allocator in the estimate; expandable segments do not.
    assert totals["qwen-lora-b1-s4096-msswift"] > totals["qwen-lora-b1-s4096-even"]
    assert totals["qwen-lora-b1-s4096-msswift-exp"] == totals["qwen-lora-b1-s4096-even"]


def test_ms_swift_lengths_are_its_benchmarks_cut_at_the_cap_and_seeded() -> None:
    case = measure.Case("x", "tiny", "lora", 1, 2048, steps=400, lengths="ms-swift")
    lengths = measure.batch_lengths(case)
    assert lengths == measure.batch_lengths(case), "the same draw every run"
    assert len(lengths) == 400 and min(lengths) >= 91 and max(lengths) == 2048
    # N(3234, 2547) is above 2,048 about 68 % of the time: most rows are cut at the cap.
    at_cap = sum(n == 2048 for n in lengths) / len(lengths)
    assert 0.6 < at_cap < 0.76, at_cap
    assert lengths != sorted(lengths), "in the order drawn, not the longest last"
    with pytest.raises(ValueError, match="neither uniform nor ms-swift"):
        measure.batch_lengths(measure.Case("y", "tiny", "lora", 1, 64, lengths="zipf"))


def test_batch_lengths_vary_within_the_spread_and_end_at_the_longest() -> None:
    case = measure.Case("x", "tiny", "lora", 2, 1000, spread=0.75, steps=20)
    lengths = measure.batch_lengths(case)
    assert len(lengths) == 20 and lengths[-1] == 1000
    assert all(250 <= n <= 1000 for n in lengths)
    assert len(set(lengths)) > 5
    packed = measure.Case("y", "tiny", "lora", 2, 1000, spread=0.75, packing=True, steps=4)
    assert measure.batch_lengths(packed) == [1000] * 4


def test_estimate_flags_state_what_the_run_does() -> None:
    case = measure.Case("x", "tiny", "qlora", 2, 64, checkpointing=True, spread=0.5)
    args = measure.estimate_args(case, Path("c.json"), "cuda")
    flag = {args[i]: args[i + 1] for i in range(1, len(args) - 1) if args[i].startswith("--")}
    assert flag["--method"] == "qlora" and flag["--grad-checkpointing"] == "true"
    assert flag["--seq-length-spread"] == "0.5" and flag["--packing"] == "false"
    assert flag["--pytorch-cuda-alloc-conf"] == "expandable_segments:False"
    assert flag["--lora-targets"] == "q,v"


def torch_stack_missing() -> str:
    try:
        import peft  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return ""


def test_cpu_rehearsal_runs_the_gpu_code_path_on_tiny_configs(memguard: str, tmp_path: Path) -> None:
    missing = torch_stack_missing()
    if missing:
        msg = f"SKIP SKIP SKIP: the CPU rehearsal of bench/gpu/measure.py did NOT run: {missing}"
        print("\n" + msg, file=sys.stderr)
        if os.environ.get("CI") == "true":
            pytest.fail(msg + " (CI installs torch, transformers and peft)")
        pytest.skip(msg)
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(HERE / "measure.py"), "all", "--device", "cpu", "--tiny",
         "--out", str(out), "--memguard", memguard],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads(line) for line in (out / "cases.jsonl").read_text().splitlines()]
    assert [r["case"]["name"] for r in results] == [c.name for c in measure.tiny_cases()]
    for r in results:
        assert "error" not in r and "skipped" not in r, r
        fig = r["figures"]
        assert fig["max_rss"] > 50e6, fig  # a process that imported torch
        assert fig["trainable"] < fig["params"] or r["case"]["method"] == "full"
        assert fig["batch_lengths"][-1] == r["case"]["seq"]
        assert r["estimate"]["total_bytes"] > 0
    with open(out / "gpu-measured.csv", newline="") as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == measure.COLUMNS
        rows = list(reader)
    assert len(rows) == len(results)
    for row in rows:
        assert row["source_group"] == measure.SOURCE_GROUP and row["device"] == "cpu"
        assert int(row["measured_bytes"]) > 0 and row["compare_to"] == "total"
        assert "memguard estimate: total" in row["notes"]


# bench/gpu/trainstart.py: its CPU side (the GPU path needs a CUDA device; docs/sidecar.md).
import trainstart  # noqa: E402


def test_trainstart_reads_its_arguments_and_refuses_bad_ones(capsys: pytest.CaptureFixture) -> None:
    a = trainstart.parse_args(["--out", "o", "--batch", "8", "--budget-gib", "12.5"])
    assert (a.out, a.batch, a.seq, a.budget_gib, a.shape) == (
        Path("o"), 8, 1024, 12.5, "llama-3.2-1b-shape")
    for bad, says in ((["--batch", "0"], "0 is not at least 1"),
                      (["--steps", "two"], "`two` is not a whole number"),
                      (["--budget-gib", "-1"], "-1 is not a positive number"),
                      (["--budget-gib", "nan"], "nan is not a positive number"),
                      (["--shape", "gpt-9"], "invalid choice")):
        with pytest.raises(SystemExit) as exit:
            trainstart.parse_args(bad)
        assert exit.value.code == 2
        assert says in capsys.readouterr().err, bad


def test_trainstart_without_a_gpu_says_so_and_writes_nothing(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, str(HERE / "trainstart.py"), "--out", str(tmp_path / "o")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == trainstart.NO_GPU, out.stderr
    assert "no CUDA device" in out.stderr and "GPU machine only" in out.stderr, out.stderr
    assert not (tmp_path / "o").exists()


def test_trainstart_sees_the_shrink_and_the_growth_and_writes_them_whole(tmp_path: Path) -> None:
    steps = [{"step": 1, "micro_batch": 4, "max_reserved_bytes": 30},
             {"step": 2, "micro_batch": 4, "max_reserved_bytes": 31},
             {"step": 3, "micro_batch": 8, "max_reserved_bytes": 52},
             {"step": 4, "micro_batch": 16, "max_reserved_bytes": 90}]
    summary = {"train_start": {"planned": True, "batch_size": 4}, "growths": 2, "downgrades": 0}
    out = trainstart.summarize(16, steps, summary)
    assert out["shrunk"] and out["grew"], out
    assert (out["planned_batch"], out["first_micro_batch"], out["last_micro_batch"]) == (4, 4, 16)
    assert out["max_reserved_bytes_at"] == {"4": 31, "8": 52, "16": 90}
    assert out["growths"] == 2
    unplanned = trainstart.summarize(16, steps[:1], {"train_start": {"planned": False}})
    assert (unplanned["planned_batch"], unplanned["shrunk"], unplanned["grew"]) == (None, False, False)
    assert unplanned["growths"] == 0, "the summary leaves out a zero"
    path = trainstart.write_result(tmp_path / "o", {"outcome": out})
    assert json.loads(path.read_text()) == {"outcome": out}
    assert [p.name for p in path.parent.iterdir()] == [trainstart.RESULT]


def test_trainstart_default_budget_fits_four_rows_and_not_eight(tmp_path: Path, memguard: str) -> None:
    """The default run must shrink: `memguard estimate`'s upper bound for its model at 4 rows
    fits the default budget, at 8 does not (as the sidecar's train-start plan checks)."""
    a = trainstart.parse_args([])
    config = write_config(tmp_path, measure.SHAPES[a.shape])
    upper = {}
    for rows in (4, 8):
        case = measure.Case("budget", a.shape, "full", rows, a.seq)
        upper[rows] = measure.memguard_estimate(memguard, case, config, "cuda")["total_upper_bytes"]
    budget = a.budget_gib * (1 << 30)
    assert upper[4] <= budget < upper[8], (upper, budget)
