"""The injected client (``inject/sitecustomize.py`` + :mod:`memguard_client.auto`) with real
interpreters: each case starts Python with the client's directory first on ``PYTHONPATH``,
laid out as ``memguard client install`` writes it (the Rust test of that command checks it
writes these very files).

The stock script is ``bench/survival/stock_hf_trainer.py`` (``HfArgumentParser``, no memguard
import); the signal comes from a signal file the test writes, as the sidecar would.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from conftest import signal_dict

HERE = Path(__file__).resolve().parent
CLIENT = HERE.parent
REPO = CLIENT.parents[1]
STOCK = REPO / "bench" / "survival" / "stock_hf_trainer.py"


def install(dest: Path) -> Path:
    """The directory ``memguard client install DEST`` writes."""
    shutil.copytree(CLIENT / "src" / "memguard_client", dest / "memguard_client",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(CLIENT / "inject" / "sitecustomize.py", dest / "sitecustomize.py")
    return dest


def clean_env(**extra: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_") and k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def python(code: str, env: Dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=60)


PROBE = (
    "import sys, json; print(json.dumps(sorted(m for m in sys.modules if m.startswith("
    "('memguard', 'urllib.request', 'http.client', 'transformers', 'torch', 'logging')))))"
)


def test_a_script_that_never_imports_transformers_runs_unchanged(tmp_path: Path) -> None:
    client = install(tmp_path / "client")
    script = "import json, os; print(json.dumps({'sum': sum(range(10)), 'cwd': os.getcwd()}))"
    plain = python(script, clean_env(), tmp_path)
    guarded = python(script, clean_env(PYTHONPATH=str(client), MEMGUARD_SIGNAL_FILE="/nonexistent"),
                     tmp_path)
    assert (guarded.returncode, guarded.stdout, guarded.stderr) == (plain.returncode, plain.stdout, "")
    loaded = json.loads(python(PROBE, clean_env(PYTHONPATH=str(client)), tmp_path).stdout)
    # The hook itself and nothing heavy: no Guard, no urllib, no logging, no transformers.
    assert loaded == ["memguard_client", "memguard_client.auto"]
    off = json.loads(python(PROBE, clean_env(PYTHONPATH=str(client), MEMGUARD_AUTO_ATTACH="0"),
                            tmp_path).stdout)
    assert off == ["memguard_client", "memguard_client.auto"]
    hooked = python("import sys; print(sys.excepthook is sys.__excepthook__)",
                    clean_env(PYTHONPATH=str(client), MEMGUARD_AUTO_ATTACH="0"), tmp_path)
    assert hooked.stdout.strip() == "True", "MEMGUARD_AUTO_ATTACH=0 installs nothing"


def test_the_shadowed_sitecustomize_still_runs(tmp_path: Path) -> None:
    client = install(tmp_path / "client")
    image = tmp_path / "image"
    image.mkdir()
    (image / "sitecustomize.py").write_text("import os\nos.environ['IMAGE_SITE'] = 'ran'\n")
    out = python("import os, sys; print(os.environ.get('IMAGE_SITE'), sys.excepthook.__module__)",
                 clean_env(PYTHONPATH=f"{client}:{image}"), tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["ran", "memguard_client.auto"]


def test_an_uncaught_oom_in_any_script_writes_the_record_and_exits_86_or_87(tmp_path: Path) -> None:
    client = install(tmp_path / "client")
    term = tmp_path / "termination-log"
    raise_oom = "raise MemoryError(\"DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes\")"
    for cannot_fit, code in (("false", 86), ("true", 87)):
        env = clean_env(PYTHONPATH=str(client), MEMGUARD_TERMINATION_LOG=str(term),
                        MEMGUARD_CANNOT_FIT=cannot_fit)
        out = python(raise_oom, env, tmp_path)
        assert out.returncode == code, out.stderr
        assert "MemoryError" in out.stderr, "the traceback is still printed"
        record = json.loads(term.read_text())
        assert (record["kind"], record["outcome"], record["requested_bytes"]) == ("cpu_oom", "fatal", 4096)
    other = python("raise ValueError('not memory')", clean_env(PYTHONPATH=str(client)), tmp_path)
    assert other.returncode == 1 and "ValueError: not memory" in other.stderr


def test_a_broken_client_copy_leaves_the_script_running_with_one_log_line(tmp_path: Path) -> None:
    client = install(tmp_path / "client")
    with open(client / "memguard_client" / "auto.py", "a") as f:
        f.write("\ndef broken(:\n")
    out = python("print('trained')", clean_env(PYTHONPATH=str(client)), tmp_path)
    assert out.returncode == 0 and out.stdout == "trained\n"
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("memguard: the injected client is off"), lines
    assert "SyntaxError" in lines[0]


# --- with transformers ------------------------------------------------------------------------


def stock_args(tmp: Path, log: Path, batch: int, samples: int, extra: Optional[List[str]] = None) -> List[str]:
    return [
        str(STOCK), "--output_dir", str(tmp / "out"), "--per_device_train_batch_size", str(batch),
        "--num_train_epochs", "1", "--learning_rate", "1e-3", "--train_sampling_strategy", "sequential",
        "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--logging_strategy", "no",
        "--disable_tqdm", "true", "--samples", str(samples), "--min_len", "8", "--max_len", "24",
        "--log_file", str(log), *(extra or []),
    ]


def steps(log: Path) -> List[Dict[str, Any]]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "step"]


def done(log: Path) -> List[Dict[str, Any]]:
    return [e for e in map(json.loads, log.read_text().splitlines()) if e["event"] == "done"]


@pytest.fixture(scope="module")
def hf() -> None:
    pytest.importorskip("torch", reason="torch is installed by scripts/install-deps.sh")
    pytest.importorskip("transformers", reason="transformers is installed by scripts/install-deps.sh")


def test_a_stock_trainer_follows_the_signal_file_with_no_code_change(tmp_path: Path, hf: None) -> None:
    client = install(tmp_path / "client")
    sig = tmp_path / "signal.json"
    sig.write_text(json.dumps(signal_dict(3, batch=3, accum=1)))
    log = tmp_path / "log.jsonl"
    env = clean_env(PYTHONPATH=str(client), MEMGUARD_SIGNAL_FILE=str(sig), MEMGUARD_BATCH_SIZE="8")
    out = subprocess.run([sys.executable, *stock_args(tmp_path, log, 8, 16)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [e["micro"] for e in steps(log)] == [[3, 3, 2], [3, 3, 2]]
    assert done(log)[0]["attached"] is True
    mine = [line for line in out.stderr.splitlines() if line.startswith("memguard:")]
    assert mine == ["memguard: Trainer follows the sidecar's signal (attached automatically)"]
    # Off: the same script, the same env, whole batches.
    log2 = tmp_path / "off.jsonl"
    off = subprocess.run([sys.executable, *stock_args(tmp_path, log2, 8, 16)],
                         env={**env, "MEMGUARD_AUTO_ATTACH": "0"}, capture_output=True, text=True, timeout=300)
    assert off.returncode == 0, off.stderr[-3000:]
    assert [e["micro"] for e in steps(log2)] == [[8], [8]]
    assert done(log2)[0]["attached"] is False


def test_an_explicit_attach_wins_and_attaches_once(tmp_path: Path, hf: None) -> None:
    client = install(tmp_path / "client")
    sig = tmp_path / "signal.json"
    sig.write_text(json.dumps(signal_dict(3, batch=4, accum=1)))
    script = tmp_path / "explicit.py"
    script.write_text(
        "import runpy, sys, transformers\n"
        "from memguard_client import Guard\n"
        "from memguard_client.hf import attach, MemguardCallback\n"
        "inner = transformers.Trainer.train\n"
        "def train(self, *a, **k):\n"
        "    cb = attach(self, Guard(batch_size=8))\n"
        "    out = inner(self, *a, **k)\n"
        "    cbs = [c for c in self.callback_handler.callbacks if isinstance(c, MemguardCallback)]\n"
        "    assert cbs == [cb] and self._memguard_callback is cb, cbs\n"
        "    print('explicit-only')\n"
        "    return out\n"
        "transformers.Trainer.train = train\n"
        f"sys.argv = [{str(STOCK)!r}] + sys.argv[1:]\n"
        f"runpy.run_path({str(STOCK)!r}, run_name='__main__')\n"
    )
    log = tmp_path / "log.jsonl"
    env = clean_env(PYTHONPATH=str(client), MEMGUARD_SIGNAL_FILE=str(sig))
    out = subprocess.run([sys.executable, str(script), *stock_args(tmp_path, log, 8, 16)[1:]], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "explicit-only" in out.stdout
    assert [e["micro"] for e in steps(log)] == [[4, 4], [4, 4]]
    assert "attached automatically" not in out.stderr


def test_a_broken_adapter_leaves_the_trainer_training_with_one_log_line(tmp_path: Path, hf: None) -> None:
    client = install(tmp_path / "client")
    with open(client / "memguard_client" / "hf.py", "a") as f:
        f.write("\ndef broken(:\n")
    sig = tmp_path / "signal.json"
    sig.write_text(json.dumps(signal_dict(3, batch=3, accum=1)))
    log = tmp_path / "log.jsonl"
    env = clean_env(PYTHONPATH=str(client), MEMGUARD_SIGNAL_FILE=str(sig))
    out = subprocess.run([sys.executable, *stock_args(tmp_path, log, 8, 16)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [e["micro"] for e in steps(log)] == [[8], [8]], "trains as if memguard were absent"
    mine = [line for line in out.stderr.splitlines() if line.startswith("memguard:")]
    assert len(mine) == 1 and "could not attach to Trainer" in mine[0] and "SyntaxError" in mine[0], mine


def test_two_ranks_under_torchrun_agree_on_every_step(tmp_path: Path, hf: None) -> None:
    """Each rank has its own signal (its own pod's sidecar): rank 1's says 2, rank 0's says 8.
    A second sitecustomize (the image's, chained by ours) points each rank at its own file."""
    client = install(tmp_path / "client")
    image = tmp_path / "image"
    image.mkdir()
    (image / "sitecustomize.py").write_text(
        "import os\n"
        "if 'LOCAL_RANK' in os.environ:\n"
        "    os.environ['MEMGUARD_SIGNAL_FILE'] += '.' + os.environ['LOCAL_RANK']\n"
    )
    sig = tmp_path / "signal.json"
    Path(f"{sig}.0").write_text(json.dumps(signal_dict(3, batch=8, accum=1)))
    Path(f"{sig}.1").write_text(json.dumps(signal_dict(3, batch=2, accum=1)))
    log = tmp_path / "log.jsonl"
    env = clean_env(PYTHONPATH=f"{client}:{image}", MEMGUARD_SIGNAL_FILE=str(sig))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           *stock_args(tmp_path, log, 4, 32, ["--ddp_backend", "gloo"])]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    by_rank = {r: [e["micro"] for e in steps(log) if e["rank"] == r] for r in (0, 1)}
    assert by_rank[0] == by_rank[1] == [[2, 2]] * 4, by_rank
    assert [d["attached"] for d in done(log)] == [True, True]


def test_a_plain_torch_loop_reports_its_optimizer_steps(tmp_path: Path, hf: None, sidecar: Any) -> None:
    """No transformers: the loop cannot be re-chunked from outside, but its steps are reported
    (with allocator figures where the device has them: none on this CPU)."""
    client = install(tmp_path / "client")
    script = (
        "import time, torch\n"
        "m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for i in range(3):\n"
        "    m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "    time.sleep(1.1)\n"
        "print('done')\n"
    )
    out = python(script, clean_env(PYTHONPATH=str(client), MEMGUARD_SIDECAR_URL=sidecar.url), tmp_path)
    assert out.returncode == 0 and out.stdout == "done\n", out.stderr
    assert out.stderr == ""
    assert [r["step"] for r in sidecar.reports if "step" in r] == [0, 1, 2]
    # Before the first step report, what the loop's objects say for sure (issue 37): no process
    # group (so no world size), the optimizer's 4 + 1 parameters, SGD without momentum.
    assert sidecar.reports[0] == {"config": {"trainable-params": 5.0, "optimizer": 2.0}}
