"""The trainer's phase and checkpoint saves put off under host-memory pressure (issue 39, item 3),
with a real `transformers.Trainer` on CPU and the real `memguard-sidecar` binary over loopback.

The sidecar watches a cgroup v2 tree written by the test (as test_train_start_config.py does):
raising `memory.current` past the warn threshold puts the signal at `warn`, lowering it brings
it back to `ok` (after the sidecar's hold)."""
import json
import os
import re
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from memguard_client import Guard
from memguard_client.phase import SaveDeferral

from test_train_start_config import SIDECAR, free_port, metrics, v2_tree

MIB = 1 << 20


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Tuple[Path, int, int]]:
    """A running sidecar: (its cgroup, API port, metrics port)."""
    if not Path(SIDECAR).exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"the sidecar binary is missing: {SIDECAR}")
        pytest.skip(f"build the sidecar first (cargo build): {SIDECAR}")
    cg, proc = tmp_path / "cg", tmp_path / "proc"
    v2_tree(cg)
    (proc / "pressure").mkdir(parents=True)
    (proc / "pressure" / "memory").write_text((cg / "memory.pressure").read_text())
    api, prom = free_port(), free_port()
    process = subprocess.Popen(
        [SIDECAR, "--cgroup", str(cg), "--proc-root", str(proc),
         "--signal-file", str(tmp_path / "signal.json"),
         "--termination-log", str(tmp_path / "termination"),
         "--listen", f"127.0.0.1:{api}", "--metrics-listen", f"127.0.0.1:{prom}",
         "--interval", "50ms", "--log-format", "text", "--exit-when-empty", "false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                metrics(prom)
                break
            except OSError:
                assert process.poll() is None, process.stderr.read() if process.stderr else ""
                assert time.monotonic() < deadline, "the sidecar did not listen"
                time.sleep(0.1)
        yield cg, api, prom
    finally:
        process.terminate()
        process.wait(timeout=20)


def phase_now(prom: int) -> str:
    """The phase the sidecar exports as current (`-` when none)."""
    found = re.findall(r'memguard_sidecar_trainer_phase\{phase="(\w+)"\} 1\n', metrics(prom))
    return found[0] if found else "-"


def tiny_trainer(tmp_path: Path, max_steps: int, save_steps: int, callbacks: List[Any]) -> Any:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def forward(self, x: Any, labels: Any = None) -> Dict[str, Any]:
            out = self.lin(x).squeeze(-1)
            return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

    data = [{"x": torch.randn(3), "labels": torch.randn(())} for _ in range(64)]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
        max_steps=max_steps, save_strategy="steps", save_steps=save_steps,
        logging_strategy="no", report_to=[], use_cpu=True,
    )
    return transformers.Trainer(model=Tiny(), args=args, train_dataset=data, callbacks=callbacks)


def test_the_reports_carry_load_then_step_then_save_then_step(
    sidecar: Tuple[Path, int, int], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    from memguard_client.hf import attach

    _, api, prom = sidecar
    seen: List[str] = []

    class Recorder(transformers.TrainerCallback):  # type: ignore[misc]
        # Added after memguard's callback: it sees what memguard's reported at each event.
        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen.append(phase_now(prom))

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if control.should_save:
                seen.append(phase_now(prom))

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            seen.append(phase_now(prom))

    trainer = tiny_trainer(tmp_path, max_steps=3, save_steps=2, callbacks=[])
    assert phase_now(prom) == "-", "nothing reported: no phase exported"
    attach(trainer, Guard(sidecar_url=f"http://127.0.0.1:{api}", env={}, oom_hook=False))
    seen.append(phase_now(prom))
    trainer.add_callback(Recorder())
    trainer.train()
    # load at attach; step once training begins; save from the step end that decided to save
    # (step 2, and the last step 3) until the checkpoint is written; step again after.
    assert seen == ["load", "step", "save", "step", "save", "step"], seen
    assert (tmp_path / "out" / "checkpoint-2").is_dir()


def test_a_save_due_under_pressure_waits_for_ok_and_happens(
    sidecar: Tuple[Path, int, int], tmp_path: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    from memguard_client.hf import attach

    cg, api, prom = sidecar
    guard = Guard(sidecar_url=f"http://127.0.0.1:{api}", env={}, oom_hook=False)

    def host_memory(mib: int, level: str) -> None:
        """Write the cgroup's usage and wait until the guard follows the level it brings."""
        (cg / "memory.current").write_text(f"{mib * MIB}\n")
        deadline = time.monotonic() + 30
        while guard.level != level:
            assert time.monotonic() < deadline, f"level stayed {guard.level}, wanted {level}"
            guard.wait_for_signal(0.1)

    checkpoints_at_step_end: Dict[int, bool] = {}

    class Pressure(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 1:
                host_memory(3000, "warn")  # 3000 / 4096 MiB: warn (0.70), under downgrade
            elif state.global_step == 2:
                host_memory(300, "ok")

    trainer = tiny_trainer(tmp_path, max_steps=6, save_steps=2, callbacks=[Pressure()])
    cb = attach(trainer, guard)
    trainer.train()
    out = tmp_path / "out"
    assert not (out / "checkpoint-2").exists(), "due at step 2 under warn: put off"
    assert (out / "checkpoint-3").is_dir(), "saved at the first step end back at ok"
    assert (out / "checkpoint-4").is_dir() and (out / "checkpoint-6").is_dir()
    assert cb.saves_deferred == 1
    text = metrics(prom)
    assert "memguard_sidecar_trainer_saves_deferred 1\n" in text, text
    assert 'memguard_sidecar_trainer_phase{phase="step"} 1\n' in text


def test_a_save_is_put_off_at_most_the_cap_and_never_past_the_last_step() -> None:
    d = SaveDeferral(max_steps=3)
    assert d.save_now(10, pressure=True, last=False) is False
    assert d.pending and d.deferred == 1
    assert d.save_now(11, pressure=True, last=False) is False
    assert d.save_now(12, pressure=True, last=False) is False
    assert d.save_now(13, pressure=True, last=False) is True, "3 steps late: saved anyway"
    assert not d.pending
    assert d.save_now(20, pressure=True, last=False) is False
    assert d.save_now(21, pressure=True, last=True) is True, "the last step saves"
    assert d.save_now(30, pressure=False, last=False) is True
    assert d.deferred == 2


def test_every_rank_puts_off_the_save_when_one_rank_is_under_pressure(tmp_path: Path) -> None:
    """2-rank torchrun, only rank 1 at warn: both ranks skip the save due at step 2 (the
    pressure is agreed in one collective) and both save at the last step."""
    import json
    import subprocess
    import sys

    pytest.importorskip("transformers")
    worker = Path(__file__).resolve().parent / "phase_worker.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(worker), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    r0, r1 = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert (r0["level"], r1["level"]) == ("ok", "warn")
    assert r0["saved"] == r1["saved"] == [4], (r0, r1)
    assert r0["saves_deferred"] == r1["saves_deferred"] == 1
    assert not (tmp_path / "ckpt" / "checkpoint-2").exists()
    assert (tmp_path / "ckpt" / "checkpoint-4").is_dir()


def test_a_sidecar_older_than_the_phase_still_gets_the_reports_and_never_the_phase_again(
    tmp_path: Path,
) -> None:
    from conftest import FakeSidecar

    sidecar = FakeSidecar()
    try:
        sidecar.unknown_fields = {"phase", "saves_deferred"}
        g = Guard(sidecar_url=sidecar.url, env={}, background=False, oom_hook=False)
        g._own_cgroup.stop()  # this test is about the phase alone
        assert g.report_phase("load") is True, "sent again without the phase, and accepted"
        assert [set(b) for b in sidecar.refused] == [{"phase"}]
        assert g.report(step=1) is True
        assert sidecar.reports == [{}, {"step": 1}], "no phase once refused"
        assert len(sidecar.refused) == 1
        assert g.phase == "load", "the client still knows its phase"
        with pytest.raises(ValueError, match="unknown phase 'eval'"):
            g.report_phase("eval")
    finally:
        sidecar.close()


def test_a_fatal_oom_record_names_the_phase_and_the_sidecar_counts_it_there(
    sidecar: Tuple[Path, int, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's record of a fatal OOM names the phase it last reported, as the sidecar's
    `oom_kill_phase` would for a kill: the termination message carries it, and the real
    sidecar counts the record under that phase."""
    torch = pytest.importorskip("torch")
    from memguard_client import oom

    _, api, prom = sidecar
    log = tmp_path / "termination-log"
    monkeypatch.setenv("MEMGUARD_TERMINATION_LOG", str(log))
    g = Guard(sidecar_url=f"http://127.0.0.1:{api}", env={}, oom_hook=False, background=False)
    g._own_cgroup.stop()  # this test is about the record alone
    assert g.report_phase("save") is True
    try:
        torch.empty(1 << 50, dtype=torch.uint8)  # the CPU allocator refuses: a real host OOM
    except RuntimeError as err:
        with pytest.raises(SystemExit) as exited:
            oom.record(err, g, step=7, outcome="fatal")
    assert exited.value.code == oom.EXIT_OOM
    written = json.loads(log.read_text())
    assert (written["kind"], written["outcome"], written["phase"]) == ("cpu_oom", "fatal", "save")
    text = metrics(prom)
    assert 'memguard_sidecar_oom_records_fatal_by_phase_total{phase="save"} 1\n' in text, text
    assert 'memguard_sidecar_oom_records_fatal_by_phase_total{phase="load"} 0\n' in text, text
    # Without a phase reported, none is named (never guessed); a phase not in the list is a
    # clear error.
    fresh = Guard(sidecar_url="", env={}, oom_hook=False, background=False)
    rec = oom.build_record(MemoryError(), fresh, step=1, outcome="fatal")
    assert "phase" not in rec
    with pytest.raises(ValueError, match="phase must be one of"):
        oom.build_record(MemoryError(), fresh, step=1, outcome="fatal", phase="eval")
