"""The truth from inside the trainer (issue 37): at train start the attached client reports the
config a real `transformers.Trainer` runs at, and the real `memguard-sidecar` binary exports it
beside what admission planned (`memguard_sidecar_trainer_config`, `..._config_mismatch`).

The sidecar watches a cgroup v2 tree written by the test (as its own Rust tests do) and talks
HTTP over loopback; the trainer is a real tiny Trainer on CPU."""
import os
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict

import pytest

from memguard_client import Guard

ROOT = Path(__file__).resolve().parents[3]
SIDECAR = os.environ.get("MEMGUARD_SIDECAR_BIN", str(ROOT / "target" / "debug" / "memguard-sidecar"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def v2_tree(cg: Path) -> None:
    mib = 1 << 20
    files = {
        "memory.current": f"{300 * mib}\n",
        "memory.max": f"{4096 * mib}\n",
        "memory.high": "max\n",
        "memory.peak": f"{300 * mib}\n",
        "memory.stat": "anon 0\nfile 0\ninactive_file 0\nactive_file 0\n",
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "cgroup.events": "populated 1\nfrozen 0\n",
        "memory.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
    }
    cg.mkdir(parents=True)
    for name, text in files.items():
        (cg / name).write_text(text)


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def test_a_real_trainer_reports_its_config_and_the_sidecar_exports_the_mismatch(tmp_path: Path) -> None:
    if not Path(SIDECAR).exists():
        if os.environ.get("CI") == "true":
            pytest.fail(f"the sidecar binary is missing: {SIDECAR}")
        pytest.skip(f"build the sidecar first (cargo build): {SIDECAR}")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from memguard_client.hf import attach

    cg, proc = tmp_path / "cg", tmp_path / "proc"
    v2_tree(cg)
    (proc / "pressure").mkdir(parents=True)
    (proc / "pressure" / "memory").write_text((cg / "memory.pressure").read_text())
    api, prom = free_port(), free_port()
    sidecar = subprocess.Popen(
        [SIDECAR, "--cgroup", str(cg), "--proc-root", str(proc),
         "--signal-file", str(tmp_path / "signal.json"),
         "--termination-log", str(tmp_path / "termination"),
         "--listen", f"127.0.0.1:{api}", "--metrics-listen", f"127.0.0.1:{prom}",
         "--interval", "50ms", "--log-format", "text", "--exit-when-empty", "false",
         # What admission believed: batch 2 × 8 (a plan), the sequence it read.
         "--admitted-config", "batch-size=2,grad-accumulation=8,seq-length=2048,world-size=1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                metrics(prom)
                break
            except OSError:
                assert sidecar.poll() is None, sidecar.stderr.read() if sidecar.stderr else ""
                assert time.monotonic() < deadline, "the sidecar did not listen"
                time.sleep(0.1)

        class Tiny(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = torch.nn.Linear(3, 1)

            def forward(self, x: Any, labels: Any = None) -> Dict[str, Any]:
                out = self.lin(x).squeeze(-1)
                return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}

        data = [{"x": torch.randn(3), "labels": torch.randn(())} for _ in range(32)]
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=16,
            gradient_accumulation_steps=1, num_train_epochs=1, report_to=[],
            save_strategy="no", logging_strategy="no", use_cpu=True,
        )
        trainer = transformers.Trainer(model=Tiny(), args=args, train_dataset=data)
        attach(trainer, Guard(sidecar_url=f"http://127.0.0.1:{api}", env={}, oom_hook=False))
        trainer.train()

        text = metrics(prom)
        assert 'memguard_sidecar_trainer_config{knob="batch-size"} 16' in text, text
        assert 'memguard_sidecar_trainer_config{knob="grad-accumulation"} 1' in text
        assert 'memguard_sidecar_trainer_config{knob="grad-checkpointing"} 0' in text
        assert 'memguard_sidecar_trainer_config{knob="params"} 4' in text
        # Admission believed 2 × 8; the trainer runs 16 × 1. It said nothing of the sequence
        # that the trainer (stock TrainingArguments, no max_length) reports: no claim there.
        assert 'memguard_sidecar_config_mismatch{knob="batch-size"} 1' in text
        assert 'memguard_sidecar_config_mismatch{knob="grad-accumulation"} 1' in text
        assert 'memguard_sidecar_config_mismatch{knob="world-size"} 0' in text
        assert 'config_mismatch{knob="seq-length"}' not in text
    finally:
        sidecar.terminate()
        sidecar.wait(timeout=20)
