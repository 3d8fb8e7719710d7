"""The plan at train start (issue 37, items 2 and 3), end to end: a stock HF Trainer script
(bench/survival/stock_hf_trainer.py, a tiny Llama built from its config, on the CPU) runs with
the injected client in a real cgroup v1 memory limit, watched by the real `memguard-sidecar`
binary over loopback. Configured at a micro-batch the sidecar's budget says does not fit, it
is planned down before its first step, finishes every step, and ends with the parameters of
an unguarded run at the same effective batch."""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import pytest

from test_auto import STOCK, clean_env, done, install, steps

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
SIDECAR = os.environ.get("MEMGUARD_SIDECAR_BIN", str(ROOT / "target" / "debug" / "memguard-sidecar"))
V1_ROOT = Path("/sys/fs/cgroup/memory")
CI = os.environ.get("CI") == "true"
MIB = 1 << 20
#: What the webhook writes for a CPU trainer under the default policy (safety ratio 0.9, the
#: upper bound at 0.95, the default floors).
TRAIN_START = ("safety-ratio=0.9,estimate-level=0.95,allow-quality=0,floor-batch-size=1,"
               "floor-seq-length=256,floor-lora-rank=4,floor-lora-layers=1")
#: The stock script's tiny Llama at 256 tokens over a 32000-token vocabulary: the logits
#: dominate. Its upper bounds (`memguard estimate`, CPU, fp32, AdamW, eager attention): 3874 MiB
#: at 16 rows, 2220 at 8, 1392 at 4. Under a 2 GiB limit (budget 1843 MiB) 4 rows fit, 8 do not.
VOCAB, SEQ, BATCH, SAMPLES = 32000, 256, 16, 32


def need_root_v1() -> None:
    if os.geteuid() != 0 or not (V1_ROOT / "memory.limit_in_bytes").exists():
        why = "needs root and a cgroup v1 memory controller"
        if CI:
            pytest.fail(why)
        pytest.skip(why)
    if not Path(SIDECAR).exists():
        if CI:
            pytest.fail(f"the sidecar binary is missing: {SIDECAR}")
        pytest.skip(f"build the sidecar first (cargo build -p memguard-sidecar): {SIDECAR}")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")


def v1_cgroup(name: str, limit: int) -> Iterator[Path]:
    path = V1_ROOT / f"memguard-train-start-{name}-{os.getpid()}"
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(limit))
        swap = path / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(limit))
        (path / "memory.swappiness").write_text("0")
        yield path
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), 9)
            except OSError:
                pass
        for _ in range(50):
            try:
                path.rmdir()
                break
            except OSError:
                time.sleep(0.1)


@pytest.fixture
def limit_2g() -> Iterator[Path]:
    need_root_v1()
    yield from v1_cgroup("2g", 2048 * MIB)


@pytest.fixture
def limit_4g() -> Iterator[Path]:
    need_root_v1()
    yield from v1_cgroup("4g", 4096 * MIB)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Sidecar:
    """The real sidecar binary watching `cgroup`, its API and metrics on loopback."""

    def __init__(self, tmp: Path, cgroup: Path, train_start: Optional[str] = TRAIN_START,
                 env: Optional[Dict[str, str]] = None) -> None:
        self.api, self.prom = free_port(), free_port()
        self.termination = tmp / "sidecar-termination"
        cmd = [SIDECAR, "--cgroup", str(cgroup), "--signal-file", str(tmp / "signal.json"),
               "--termination-log", str(self.termination),
               "--listen", f"127.0.0.1:{self.api}", "--metrics-listen", f"127.0.0.1:{self.prom}",
               "--interval", "100ms", "--log-format", "text", "--exit-when-empty", "false",
               # Only the train-start plan moves the micro-batch in these runs.
               "--grow-back", "false"]
        if train_start is not None:
            cmd += ["--train-start", train_start]
        # `env`: what the webhook writes into the sidecar's container (its starting knobs).
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + 30
        while True:
            try:
                self.metrics()
                return
            except OSError:
                assert self.proc.poll() is None, self.proc.stderr.read() if self.proc.stderr else ""
                assert time.monotonic() < deadline, "the sidecar did not listen"
                time.sleep(0.1)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api}"

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.prom}/metrics", timeout=5) as r:
            return r.read().decode()

    def stop(self) -> Dict[str, Any]:
        """SIGTERM; the summary it wrote."""
        self.proc.terminate()
        self.proc.wait(timeout=30)
        return json.loads(self.termination.read_text())


def stock(tmp: Path, log: Path, weights: Path, extra: Optional[List[str]] = None,
          samples: int = SAMPLES) -> List[str]:
    return [
        str(STOCK), "--output_dir", str(tmp / "out"), "--per_device_train_batch_size", str(BATCH),
        "--num_train_epochs", "1", "--learning_rate", "1e-3", "--train_sampling_strategy", "sequential",
        "--use_cpu", "--report_to", "none", "--save_strategy", "no", "--logging_strategy", "no",
        "--disable_tqdm", "true", "--samples", str(samples), "--min_len", str(SEQ),
        "--max_len", str(SEQ), "--vocab_size", str(VOCAB), "--seed", "7",
        "--log_file", str(log), "--weights_file", str(weights), *(extra or []),
    ]


def in_cgroup(cgroup: Path, cmd: List[str]) -> List[str]:
    """The shell joins the cgroup, then becomes the trainer: it runs there from its first line."""
    return ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *cmd]


def unguarded(tmp: Path, extra: Optional[List[str]] = None, world: int = 1,
              samples: int = SAMPLES) -> Path:
    """The same run without memguard (no client, no limit): its final parameters."""
    ref = tmp / "reference"
    ref.mkdir()
    weights = ref / "weights.npz"
    launch = [sys.executable] if world == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    out = subprocess.run([*launch, *stock(ref, ref / "log.jsonl", weights, extra, samples)],
                         env=clean_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return weights


def assert_same_parameters(a: Path, b: Path, atol: float = 1e-6) -> None:
    import numpy as np

    x, y = np.load(a), np.load(b)
    assert sorted(x.files) == sorted(y.files)
    for k in x.files:
        np.testing.assert_allclose(x[k], y[k], rtol=1e-4, atol=atol, err_msg=k)


def test_a_trainer_configured_above_its_budget_is_planned_down_before_its_first_step(
    tmp_path: Path, limit_2g: Path
) -> None:
    sidecar = Sidecar(tmp_path, limit_2g)
    try:
        client = install(tmp_path / "client")
        log, weights = tmp_path / "log.jsonl", tmp_path / "weights.npz"
        env = clean_env(PYTHONPATH=str(client), MEMGUARD_SIDECAR_URL=sidecar.url)
        out = subprocess.run(in_cgroup(limit_2g, [sys.executable, *stock(tmp_path, log, weights)]),
                             env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        text = sidecar.metrics()
    finally:
        summary = sidecar.stop()
    # Planned before the first forward: the first step ran 4 micro-batches of 4 rows (16 × 1 as
    # configured, 4 × 4 as planned). Later steps never above it: the sidecar may still shrink
    # under pressure (on a loaded machine the host's PSI does), never grow (--grow-back false).
    ran = [e["micro"] for e in steps(log)]
    assert len(ran) == SAMPLES // BATCH and ran[0] == [4, 4, 4, 4], ran
    assert all(sum(m) == BATCH and max(m) <= 4 for m in ran), ran
    assert [d["attached"] for d in done(log)] == [True]
    assert 'memguard_sidecar_trainer_config{knob="batch-size"} 16' in text, text
    assert f'memguard_sidecar_trainer_config{{knob="seq-length"}} {SEQ}' in text
    assert f'memguard_sidecar_trainer_config{{knob="vocab-size"}} {VOCAB}' in text
    assert 'memguard_sidecar_trainer_config{knob="flash-attention"} 0' in text
    assert 'memguard_sidecar_train_start_planned 1' in text
    assert 'memguard_sidecar_train_start_plan{knob="batch-size"} 4' in text
    assert 'memguard_sidecar_train_start_plan{knob="grad-accumulation"} 4' in text
    plan = summary["train_start"]
    assert plan["planned"] and plan["fits"] and plan["batch_size"] == 4, plan
    assert plan["upper_bytes"] <= plan["budget_bytes"], plan
    assert abs(plan["budget_bytes"] - 2048 * MIB * 0.9) < 1, "the cgroup's limit × the safety ratio"
    assert summary["oom_events"] == 0, summary
    # The effective batch kept: the parameters of a run at 16 × 1 without memguard.
    assert_same_parameters(weights, unguarded(tmp_path))


def test_a_lora_trainer_is_planned_as_the_lora_it_trains(tmp_path: Path, limit_2g: Path) -> None:
    """The same script with PEFT's LoRA (rank 8 on q_proj and v_proj): the client reports the
    adapter it wrapped, the sidecar sizes that LoRA (its trainable count checked against the
    reported one) and plans it down before the first step; the effective batch is kept."""
    lora = ["--lora_rank", "8"]
    sidecar = Sidecar(tmp_path, limit_2g)
    try:
        client = install(tmp_path / "client")
        log, weights = tmp_path / "log.jsonl", tmp_path / "weights.npz"
        env = clean_env(PYTHONPATH=str(client), MEMGUARD_SIDECAR_URL=sidecar.url)
        out = subprocess.run(in_cgroup(limit_2g, [sys.executable, *stock(tmp_path, log, weights, lora)]),
                             env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        text = sidecar.metrics()
    finally:
        summary = sidecar.stop()
    plan = summary["train_start"]
    print(f"LoRA planned at train start: {json.dumps(plan)}")
    assert plan["planned"] and plan["fits"] and 1 <= plan["batch_size"] < BATCH, plan
    assert plan["batch_size"] * plan["grad_accumulation"] == BATCH, plan
    ran = [e["micro"] for e in steps(log)]
    assert ran[0] == [plan["batch_size"]] * plan["grad_accumulation"], ran
    assert all(sum(m) == BATCH for m in ran), ran
    # q (bit 1) and v (bit 4), rank 8, no dropout: 2 layers × 8·((64 + 64) + (64 + 32)) trainable.
    for knob, value in {"lora-rank": 8, "lora-targets": 5, "lora-dropout": 0,
                        "trainable-params": 2 * 8 * ((64 + 64) + (64 + 32))}.items():
        assert f'memguard_sidecar_trainer_config{{knob="{knob}"}} {value}\n' in text, (knob, text)
    assert summary["oom_events"] == 0, summary
    assert_same_parameters(weights, unguarded(tmp_path, lora))


def test_a_value_the_estimate_needs_and_the_trainer_did_not_report_means_no_plan(
    tmp_path: Path, limit_4g: Path
) -> None:
    # Adagrad: an optimizer the client does not name for the estimator, so it is not reported.
    sidecar = Sidecar(tmp_path, limit_4g)
    try:
        client = install(tmp_path / "client")
        log = tmp_path / "log.jsonl"
        env = clean_env(PYTHONPATH=str(client), MEMGUARD_SIDECAR_URL=sidecar.url)
        cmd = stock(tmp_path, log, tmp_path / "w.npz", ["--optim", "adagrad", "--max_steps", "1"])
        out = subprocess.run(in_cgroup(limit_4g, [sys.executable, *cmd]), env=env,
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        text = sidecar.metrics()
    finally:
        summary = sidecar.stop()
    plan = summary["train_start"]
    assert not plan["planned"], plan
    assert plan["reason"] == "no train-start plan: not reported: optimizer", plan
    assert "batch_size" not in plan
    assert 'memguard_sidecar_train_start_planned 0' in text
    assert "memguard_sidecar_train_start_plan{" not in text


#: Optimizer steps each of the two ranks runs: several, so that a rank falling out of step with
#: the other (a plan applied at different steps, a micro-batch agreed late) shows.
TWO_RANK_STEPS = 4


def test_two_ranks_apply_the_same_plan_from_their_first_step(tmp_path: Path, limit_4g: Path) -> None:
    """Two gloo ranks in one cgroup, one sidecar: each reports its config, both get the one
    plan and run it from step 1, and at every one of their steps after. The two share the
    4 GiB limit: each is planned against half the budget (1843 MiB: 4 rows fit, 8 do not)."""
    samples = 2 * BATCH * TWO_RANK_STEPS
    sidecar = Sidecar(tmp_path, limit_4g)
    try:
        client = install(tmp_path / "client")
        log, weights = tmp_path / "log.jsonl", tmp_path / "weights.npz"
        env = clean_env(PYTHONPATH=str(client), MEMGUARD_SIDECAR_URL=sidecar.url)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               *stock(tmp_path, log, weights, ["--ddp_backend", "gloo"], samples)]
        out = subprocess.run(in_cgroup(limit_4g, cmd), env=env, capture_output=True, text=True,
                             timeout=600)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        text = sidecar.metrics()
    finally:
        summary = sidecar.stop()
    by_rank = {r: {e["step"]: e["micro"] for e in steps(log) if e["rank"] == r} for r in (0, 1)}
    assert sorted(by_rank[0]) == list(range(TWO_RANK_STEPS)), by_rank
    assert by_rank[0] == by_rank[1], "every rank runs the same micro-batch at every step"
    assert by_rank[0][0] == [4, 4, 4, 4], by_rank
    assert all(sum(m) == BATCH and max(m) <= 4 for m in by_rank[0].values()), by_rank
    assert [d["steps"] for d in done(log)] == [TWO_RANK_STEPS] * 2, done(log)
    assert 'memguard_sidecar_trainer_config{knob="world-size"} 2' in text, text
    assert 'memguard_sidecar_trainer_config{knob="local-ranks"} 2' in text
    assert summary["train_start"]["batch_size"] == 4, summary
    assert abs(summary["train_start"]["budget_bytes"] - 4096 * MIB * 0.9 / 2) < 1
    assert summary["oom_events"] == 0, summary
    # The effective batch kept at every step: the parameters of an unguarded 2-rank run at
    # 16 × 1. gloo sums the two ranks' gradients in its own order: Adam turns the last-bit
    # differences of near-zero gradients into ~1e-6 (seen: 1 element of 2M at 2e-6 after one
    # step).
    reference = unguarded(tmp_path, ["--ddp_backend", "gloo"], world=2, samples=samples)
    assert_same_parameters(weights, reference, atol=1e-5)
