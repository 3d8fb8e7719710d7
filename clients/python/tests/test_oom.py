"""OOM classification, the record, the termination message and the exit code, with torch's real
exception classes and real allocator failures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, List

import pytest

from conftest import REPO, SRC, FakeSidecar

from memguard_client import Guard, oom

import torch  # noqa: E402 - scripts/install-deps.sh installs it; CI must not skip

RECORD_FIXTURE = REPO / "api" / "fixtures" / "oom-record-v1.json"

# torch ≥ 2.1's message, and the one before it (both still seen in the field).
CUDA_MSG = (
    "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.25 GiB "
    "of which 1.12 GiB is free. Including non-PyTorch memory, this process has 78.12 GiB memory "
    "in use. Of the allocated memory 75.50 GiB is allocated by PyTorch, and 1.50 GiB is reserved "
    "by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
CUDA_MSG_OLD = (
    "CUDA out of memory. Tried to allocate 512.00 MiB (GPU 0; 15.78 GiB total capacity; "
    "13.50 GiB already allocated; 100.00 MiB free; 14.25 GiB reserved in total by PyTorch)"
)
GiB = 1 << 30
MiB = 1 << 20


def real_cpu_allocator_error() -> RuntimeError:
    """What torch's CPU allocator raises when the kernel refuses the allocation (1 PiB)."""
    try:
        torch.empty(1 << 50, dtype=torch.uint8)
    except RuntimeError as err:
        return err
    raise AssertionError("allocating 1 PiB succeeded")


def real_memory_error() -> MemoryError:
    try:
        bytearray(1 << 62)
    except MemoryError as err:
        return err
    raise AssertionError("allocating 4 EiB succeeded")


def wrapped(inner: BaseException) -> RuntimeError:
    try:
        try:
            raise inner
        except BaseException as err:
            raise RuntimeError("step failed") from err
    except RuntimeError as outer:
        return outer


# (name, exception, expected kind)
CASES = [
    ("torch.OutOfMemoryError", lambda: torch.OutOfMemoryError(CUDA_MSG), "cuda_oom"),
    ("torch.cuda.OutOfMemoryError", lambda: torch.cuda.OutOfMemoryError(CUDA_MSG_OLD), "cuda_oom"),
    ("CPU allocator RuntimeError", real_cpu_allocator_error, "cpu_oom"),
    ("MemoryError", real_memory_error, "cpu_oom"),
    ("CUDA OOM text in a RuntimeError", lambda: RuntimeError(CUDA_MSG_OLD), "cuda_oom"),
    ("CUDA error: out of memory", lambda: RuntimeError("CUDA error: out of memory"), "cuda_oom"),
    ("HIP OOM text", lambda: RuntimeError("HIP out of memory. Tried to allocate 8.00 MiB"), "cuda_oom"),
    ("an OOM raised from", lambda: wrapped(torch.OutOfMemoryError(CUDA_MSG)), "cuda_oom"),
    ("another RuntimeError", lambda: RuntimeError("mat1 and mat2 shapes cannot be multiplied"), None),
    ("OOM text in a ValueError", lambda: ValueError("CUDA out of memory"), None),
    ("KeyboardInterrupt", lambda: KeyboardInterrupt(), None),
    ("OSError ENOMEM", lambda: OSError(12, "Cannot allocate memory"), None),
]


@pytest.mark.parametrize("name,make,kind", CASES, ids=[c[0] for c in CASES])
def test_classify(name: str, make: Any, kind: Any) -> None:
    assert oom.classify(make()) == kind


def test_request_size_and_figures_come_from_the_message() -> None:
    assert oom.message_figures(CUDA_MSG) == {
        "requested_bytes": 2 * GiB,
        "total_bytes": int(79.25 * GiB),
        "allocated_bytes": int(75.5 * GiB),
        "reserved_bytes": int(75.5 * GiB) + int(1.5 * GiB),
    }
    assert oom.message_figures(CUDA_MSG_OLD) == {
        "requested_bytes": 512 * MiB,
        "total_bytes": int(15.78 * GiB),
        "allocated_bytes": int(13.5 * GiB),
        "reserved_bytes": int(14.25 * GiB),
    }
    assert oom.requested_bytes(str(real_cpu_allocator_error())) == 1 << 50
    assert oom.message_figures("out of memory") == {}


def test_the_record_matches_the_api_schema_fixture(sidecar: FakeSidecar) -> None:
    fixture = json.loads(RECORD_FIXTURE.read_text())
    guard = Guard(signal_file="", sidecar_url=sidecar.url, env={"MEMGUARD_BATCH_SIZE": "8",
                  "MEMGUARD_GRAD_ACCUMULATION": "4"}, background=False, oom_hook=False)
    guard.report(step=411)
    rec = oom.build_record(torch.OutOfMemoryError(CUDA_MSG), guard, step=None, outcome="fatal")
    assert set(rec) <= set(fixture), set(rec) - set(fixture)
    for key, value in rec.items():
        assert type(value) is type(fixture[key]), key
    assert rec["version"] == fixture["version"] == oom.OOM_RECORD_VERSION
    assert (rec["kind"], rec["step"], rec["batch_size"], rec["grad_accumulation"]) == (
        "cuda_oom", 411, 8, 4)
    assert rec["requested_bytes"] == 2 * GiB
    assert rec["message"].startswith("CUDA out of memory. Tried to allocate 2.00 GiB")
    line = oom.termination_line(rec)
    assert line.endswith("\n") and line.count("\n") == 1
    huge = dict(rec, message="x" * 5000)
    assert len(oom.termination_line(huge).encode()) <= oom.MAX_TERMINATION_MESSAGE_BYTES


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not an out-of-memory error"):
        oom.build_record(ValueError("x"), None, step=1, outcome="fatal")
    with pytest.raises(ValueError, match="outcome"):
        oom.build_record(MemoryError(), None, step=1, outcome="retried")


def test_a_recovery_that_grows_the_batch_is_refused(sidecar: FakeSidecar) -> None:
    with pytest.raises(ValueError, match="new_batch_size 2 is larger than batch_size 1"):
        oom.build_record(MemoryError(), None, step=1, outcome="recovered",
                         batch_size=1, new_batch_size=2)
    # Through record(): refused before anything is reported.
    guard = Guard(signal_file="", sidecar_url=sidecar.url, env={"MEMGUARD_BATCH_SIZE": "4"},
                  background=False, oom_hook=False)
    with pytest.raises(ValueError, match="larger than batch_size 4"):
        oom.record(MemoryError(), guard, step=3, outcome="recovered", new_batch_size=8)
    assert sidecar.reports == []
    # Shrinking is a recovery.
    rec = oom.build_record(MemoryError(), None, step=1, outcome="recovered",
                           batch_size=4, new_batch_size=2)
    assert rec["new_batch_size"] == 2


def test_a_recovered_oom_is_reported_and_nothing_is_written(
    sidecar: FakeSidecar, tmp_path: Path
) -> None:
    log = tmp_path / "termination-log"
    guard = Guard(signal_file="", sidecar_url=sidecar.url, env={"MEMGUARD_BATCH_SIZE": "8"},
                  background=False, oom_hook=False)
    rec = oom.record(real_cpu_allocator_error(), guard, step=7, outcome="recovered",
                     new_batch_size=4)
    assert (rec["kind"], rec["outcome"], rec["new_batch_size"]) == ("cpu_oom", "recovered", 4)
    assert rec["peak_bytes"] > 0, "peak RSS of this process"
    [report] = sidecar.reports
    assert report["oom"] == rec
    assert (report["step"], report["batch_size"]) == (7, 8)
    assert not log.exists()


def run_trainer(body: str, tmp_path: Path, sidecar: FakeSidecar, **env: str) -> subprocess.CompletedProcess:
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(body))
    environ = dict(os.environ)
    environ.update(
        PYTHONPATH=str(SRC),
        MEMGUARD_SIDECAR_URL=sidecar.url,
        MEMGUARD_BATCH_SIZE="8",
        MEMGUARD_GRAD_ACCUMULATION="2",
        MEMGUARD_TERMINATION_LOG=str(tmp_path / "termination-log"),
        MARKER=str(tmp_path / "atexit-ran"),
    )
    environ.update(env)
    return subprocess.run([sys.executable, str(script)], env=environ, capture_output=True,
                          text=True, timeout=120)


UNCAUGHT = """
    import torch
    from memguard_client import Guard
    guard = Guard(background=False)
    for step in range(3):
        guard.report(step=step, batch_size=guard.batch_size)
    torch.empty(1 << 50, dtype=torch.uint8)  # the CPU allocator refuses: an uncaught OOM
"""


def termination_record(tmp_path: Path) -> Dict[str, Any]:
    text = (tmp_path / "termination-log").read_text()
    assert text.count("\n") == 1
    return json.loads(text)


def test_an_uncaught_oom_is_recorded_and_exits_with_the_documented_code(
    tmp_path: Path, sidecar: FakeSidecar
) -> None:
    proc = run_trainer(UNCAUGHT, tmp_path, sidecar)
    assert proc.returncode == oom.EXIT_OOM == 86, proc.stderr
    assert "DefaultCPUAllocator: can't allocate memory" in proc.stderr, "traceback still printed"
    rec = termination_record(tmp_path)
    assert (rec["kind"], rec["outcome"], rec["step"], rec["batch_size"]) == (
        "cpu_oom", "fatal", 2, 8)
    assert rec["requested_bytes"] == 1 << 50
    ooms: List[Dict[str, Any]] = [r["oom"] for r in sidecar.reports if "oom" in r]
    assert ooms == [rec], "the sidecar got the same record"


def test_cannot_fit_changes_the_exit_code(tmp_path: Path, sidecar: FakeSidecar) -> None:
    proc = run_trainer(
        """
        from memguard_client import Guard
        guard = Guard(background=False)
        bytearray(1 << 62)  # MemoryError, no torch in this trainer
        """,
        tmp_path,
        sidecar,
        MEMGUARD_CANNOT_FIT="true",
    )
    assert proc.returncode == oom.EXIT_OOM_CANNOT_FIT == 87, proc.stderr
    assert termination_record(tmp_path)["kind"] == "cpu_oom"


def test_other_uncaught_errors_are_left_alone(tmp_path: Path, sidecar: FakeSidecar) -> None:
    proc = run_trainer(
        """
        from memguard_client import Guard
        guard = Guard(background=False)
        raise KeyError("not memory")
        """,
        tmp_path,
        sidecar,
    )
    assert proc.returncode == 1
    assert "KeyError" in proc.stderr
    assert not (tmp_path / "termination-log").exists()
    assert not sidecar.reports


def test_exit_on_oom_runs_atexit_handlers(tmp_path: Path, sidecar: FakeSidecar) -> None:
    proc = run_trainer(
        """
        import atexit, os
        import torch
        from memguard_client import Guard
        from memguard_client.oom import exit_on_oom
        atexit.register(lambda: open(os.environ["MARKER"], "w").close())
        guard = Guard(background=False, oom_hook=False)
        step = 0
        with exit_on_oom(guard, step=lambda: step):
            for step in range(5):
                if step == 3:
                    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")
        """,
        tmp_path,
        sidecar,
    )
    assert proc.returncode == 86, proc.stderr
    rec = termination_record(tmp_path)
    assert (rec["kind"], rec["step"], rec["requested_bytes"]) == ("cuda_oom", 3, 20 * MiB)
    assert (tmp_path / "atexit-ran").exists()


def test_classify_and_record_do_not_import_torch(tmp_path: Path) -> None:
    code = """
        import sys
        from memguard_client import oom
        assert oom.classify(MemoryError()) == "cpu_oom"
        assert oom.classify(RuntimeError("CUDA out of memory. Tried to allocate 1.00 GiB")) == "cuda_oom"
        rec = oom.build_record(MemoryError(), None, step=1, outcome="recovered")
        assert "torch" not in sys.modules, "torch was imported"
        print(rec["kind"])
    """
    env = dict(os.environ, PYTHONPATH=str(SRC))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "cpu_oom"


def test_the_default_termination_log_is_written_only_where_the_kubelet_made_it(
    tmp_path: Path,
) -> None:
    rec = oom.build_record(MemoryError(), None, step=1, outcome="fatal")
    if not os.path.exists(oom.DEFAULT_TERMINATION_LOG):
        assert oom.write_termination_message(rec, environ={}) is None
        assert not os.path.exists(oom.DEFAULT_TERMINATION_LOG)
    target = tmp_path / "log"
    assert oom.write_termination_message(rec, {"MEMGUARD_TERMINATION_LOG": str(target)}) == str(target)
    assert json.loads(target.read_text()) == rec
    unwritable = tmp_path / "missing-dir" / "log"
    assert oom.write_termination_message(rec, {"MEMGUARD_TERMINATION_LOG": str(unwritable)}) is None
