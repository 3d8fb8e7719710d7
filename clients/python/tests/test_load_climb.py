"""The sidecar's leak rule counts only what the trainer's steps do (issue 37, run-time gaps,
item 1), end to end: a 2-rank stock HF Trainer under torchrun (gloo, CPU) with the injected
client, in a real cgroup v1 memory limit, watched by the real `memguard-sidecar` binary.

Its ranks import torch and transformers and then load their model slowly, layer by layer: the
working set climbs steadily for longer than the rule needs to see a trend, and the client has
reported nothing yet (it attaches at ``Trainer.train``). That climb is not a leak. The run then
leaks for real during its steps; only that may downgrade it."""
import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import pytest

from test_auto import clean_env, install
from test_train_start_plan import SIDECAR, free_port, need_root_v1, v1_cgroup

HERE = Path(__file__).resolve().parent
WORKER = HERE / "load_climb_worker.py"
MIB = 1 << 20
#: Both ranks climb about 19 MiB/s while loading (to 1.5 GiB in 30 s), then leak about 12 MiB/s
#: in their steps (to about 2.9 GiB at the end, measured with no limit): a ratio under 0.75,
#: under the downgrade threshold (0.85), so only the leak rule can downgrade.
LIMIT = 4096 * MIB


@pytest.fixture
def limit() -> Iterator[Path]:
    need_root_v1()
    yield from v1_cgroup("load-climb", LIMIT)


class Watched:
    """The sidecar's `/metrics`, read every 200 ms: when its first downgrade was counted."""

    def __init__(self, prom: int) -> None:
        self.prom = prom
        self.first_downgrade: Optional[float] = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.thread.start()

    def poll(self) -> None:
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.prom}/metrics", timeout=5) as r:
                    text = r.read().decode()
                for line in text.splitlines():
                    if line.startswith("memguard_sidecar_downgrades_total ") and float(line.split()[1]) > 0:
                        if self.first_downgrade is None:
                            self.first_downgrade = time.time()
            except OSError:
                pass
            self.stop.wait(0.2)


def sidecar(tmp: Path, cgroup: Path) -> Tuple[subprocess.Popen, int, int]:
    api, prom = free_port(), free_port()
    cmd = [SIDECAR, "--cgroup", str(cgroup), "--signal-file", str(tmp / "signal.json"),
           "--termination-log", str(tmp / "termination"),
           "--listen", f"127.0.0.1:{api}", "--metrics-listen", f"127.0.0.1:{prom}",
           "--interval", "100ms", "--log-format", "text", "--exit-when-empty", "false",
           "--grow-back", "false",
           # Admission's plan for the trainer's 4 × 1, so that a downgrade shows as 2 × 2.
           "--batch-size", "4", "--grad-accumulation", "1",
           # Host-wide PSI from other work on this machine must not downgrade: the leak rule alone.
           "--psi-threshold", "100",
           # Both climbs reach this limit well within 600 s at their rates (about 2 minutes
           # from the load's end, 2 to 3 from the steps', slower on a loaded machine): the rule
           # sees both, and must count only the second.
           "--leak-horizon", "600s"]
    log = open(tmp / "sidecar.log", "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{prom}/metrics", timeout=5).read()
            return proc, api, prom
        except OSError:
            assert proc.poll() is None, (tmp / "sidecar.log").read_text()
            assert time.monotonic() < deadline, "the sidecar did not listen"
            time.sleep(0.1)


def test_the_load_climb_of_two_ranks_is_no_leak_and_a_leak_in_their_steps_is(
    tmp_path: Path, limit: Path
) -> None:
    pytest.importorskip("transformers")
    proc, api, prom = sidecar(tmp_path, limit)
    watched = Watched(prom)
    try:
        client = install(tmp_path / "client")
        env = clean_env(PYTHONPATH=str(client), MEMGUARD_SIDECAR_URL=f"http://127.0.0.1:{api}")
        run: List[str] = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc_per_node", "2", str(WORKER), str(tmp_path)]
        started = time.time()
        out = subprocess.run(["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(limit), *run],
                             env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    finally:
        watched.stop.set()
        proc.terminate()
        proc.wait(timeout=30)
    summary = json.loads((tmp_path / "termination").read_text())
    times = json.loads((tmp_path / "times.json").read_text())
    first = watched.first_downgrade
    assert first is not None, f"the leak during the steps was never seen: {summary}"
    assert first > times["train_begin"], (
        f"downgraded {first - started:.1f} s after launch, before training began "
        f"({times['train_begin'] - started:.1f} s): the load climb was taken for a leak"
    )
    assert first > times["leak_begin"], (first - started, times)
    assert summary["downgrades"] >= 1 and summary["batch_size"] < 4, summary
    # The leak rule did it, not a ratio: the first signal at downgrade says why.
    signals = [line for line in (tmp_path / "sidecar.log").read_text().splitlines()
               if "level=downgrade" in line or "level=critical" in line]
    assert signals and "steady growth" in signals[0], signals[:3]
