"""Step reports for the growth back (issue 37, item 5): at every step boundary the runner tells
the sidecar (real HTTP over loopback) which step runs at which micro-batch, without waiting for
it; a dead sidecar costs the step nothing."""

from __future__ import annotations

import socket
import time
from typing import Any

from memguard_client import Guard
from memguard_client.peaks import StepReporter, device_figures
from memguard_client.recovery import StepRunner


def wait_for(pred: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return False


def test_each_step_boundary_reports_the_step_and_the_agreed_micro_batch(sidecar: Any) -> None:
    guard = Guard(signal_file="", sidecar_url=sidecar.url, env={}, batch_size=4, background=False, oom_hook=False)
    runner = StepRunner(guard)
    runner.step_reports.min_interval = 0.0
    for _ in range(3):
        runner.begin_step()
        assert wait_for(lambda: any(r.get("step") == runner.steps for r in sidecar.reports))
    last = [r for r in sidecar.reports if "step" in r][-1]
    # On a CPU only the step and the micro-batch: the sidecar reads the cgroup itself.
    assert last == {"step": 3, "batch_size": 4}
    assert runner.step_reports.sent >= 3


def test_a_sidecar_that_never_answers_never_holds_a_step() -> None:
    # Listening but never accepting: the sender's POST connects and then waits for an answer.
    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(16)
        url = f"http://127.0.0.1:{hung.getsockname()[1]}"
        guard = Guard(signal_file="", sidecar_url=url, env={}, background=False, oom_hook=False,
                      report_timeout=30.0)
        reporter = StepReporter(guard, min_interval=0.0)
        for i in range(1000):
            reporter.step(i, 2)
        # Every step was handed over while the one POST in flight is still unanswered.
        assert reporter._thread is not None and reporter._thread.is_alive()
        assert reporter.sent == 0
        reporter.close()


def test_no_sidecar_url_no_reports_and_no_thread() -> None:
    reporter = StepReporter(Guard(signal_file="", sidecar_url="", env={}, oom_hook=False))
    reporter.step(1, 2)
    assert not reporter.active and reporter._thread is None
    assert device_figures() == {}, "no CUDA initialised here: nothing read, nothing sent"
