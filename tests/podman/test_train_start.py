"""Issue 37's done-when, under podman: a stock HF Trainer script that takes every setting from a
JSON file shipped with the job, as its only argument (the transformers examples' convention),
with only the opt-in label. Admission cannot read its config, so it is guarded at run time; at
train start the sidecar plans it on the config it reports, and it finishes every step and
every sample, with no OOM kill, at a limit that kills it alone, with the parameters of an
unlimited run. The next admission of the same job plans on that run's report: its summary, fed
through `memguard explain` (the profile controller's observe/update, offline) and `memguard
mutate --profile`, admits the next pod at the plan as `MEMGUARD_*` env, and that pod runs it
from its first step.

Run: `MEMGUARD_IMAGE=<an image of this checkout> python3 -m pytest -q tests/podman/test_train_start.py`
as root (the image embeds the client and the sidecar under test). Skips without podman, root
or cgroup v1, except under CI=true.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, Iterator, List

import pytest

from harness import (
    CI,
    MIB,
    ROOT,
    TRAINER_BASE,
    Pod,
    ensure_image,
    ensure_trainer_base,
    explain,
    for_podman,
    kernel_oom_kills,
    metric,
    missing_runtime,
    mutate,
    podman,
    read_jsonl,
    wait_for,
)

#: The stock tiny Llama at 16 rows of 256 tokens over 32000 tokens: about 2.4 GiB at its peak
#: unguarded, OOM-killed under 2 GiB; the estimate's upper bound fits 4 rows in the budget.
LIMIT = "2Gi"
STOCK_DIR = ROOT / "bench" / "survival"
#: The interpreter with torch and transformers: this one's installation, mounted at its own path
#: (as the host's /usr is for python3 in the other pod tests).
PREFIX = Path(sys.base_prefix).resolve()
PYTHON = str(PREFIX / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}")
SETTINGS: Dict[str, Any] = {
    "output_dir": "/tmp/out", "per_device_train_batch_size": 16, "num_train_epochs": 1,
    "learning_rate": 1e-3, "train_sampling_strategy": "sequential", "use_cpu": True,
    "report_to": "none", "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True,
    "samples": 32, "min_len": 256, "max_len": 256, "vocab_size": 32000, "seed": 7,
    "log_file": "/var/log/mgtest/log.jsonl", "weights_file": "/var/log/mgtest/weights.npz",
}


@pytest.fixture(scope="module")
def runtime() -> Iterator[None]:
    why = missing_runtime()
    if why:
        if CI:
            pytest.fail(f"podman pod tests cannot run under CI=true: {why}")
        pytest.skip(why)
    ensure_image()
    ensure_trainer_base()
    yield


def job_pod(name: str, job: Path, logdir: Path, opted_in: bool) -> Dict[str, Any]:
    """What a user writes: the stock script and its JSON file, the limit, the label; nothing
    else of memguard."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"memguard.io/enabled": "true"} if opted_in else {}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "train",
                "image": TRAINER_BASE,
                "command": [PYTHON, "/opt/stock/stock_hf_trainer.py", "/opt/job/train.json"],
                "env": [{"name": "PYTHONUNBUFFERED", "value": "1"},
                        {"name": "OMP_NUM_THREADS", "value": "1"}],
                "resources": {"limits": {"memory": LIMIT}},
                "volumeMounts": [
                    {"name": "host-usr", "mountPath": "/usr", "readOnly": True},
                    {"name": "python", "mountPath": str(PREFIX), "readOnly": True},
                    {"name": "stock", "mountPath": "/opt/stock", "readOnly": True},
                    {"name": "job", "mountPath": "/opt/job", "readOnly": True},
                    {"name": "log", "mountPath": "/var/log/mgtest"},
                ],
            }],
            "volumes": [
                {"name": "host-usr", "hostPath": {"path": "/usr", "type": "Directory"}},
                {"name": "python", "hostPath": {"path": str(PREFIX), "type": "Directory"}},
                {"name": "stock", "hostPath": {"path": str(STOCK_DIR), "type": "Directory"}},
                {"name": "job", "hostPath": {"path": str(job), "type": "Directory"}},
                {"name": "log", "hostPath": {"path": str(logdir), "type": "Directory"}},
            ],
        },
    }


def the_job(tmp: Path) -> Path:
    job = tmp / "job"
    job.mkdir()
    (job / "train.json").write_text(json.dumps(SETTINGS))
    return job


def sidecar_summary(pod: Pod) -> Dict[str, Any]:
    for line in pod.logs("memguard-sidecar"):
        fields = line.get("fields", line)
        if "summary" in fields and "summary" in str(fields.get("message", "")):
            return json.loads(fields["summary"])
    raise AssertionError(f"no summary in the sidecar's log: {pod.logs('memguard-sidecar')[-5:]}")


def unlimited_weights(tmp: Path, job: Path) -> Path:
    """The same script and settings on the host, without memguard and without a limit."""
    ref = tmp / "reference"
    ref.mkdir()
    settings = dict(SETTINGS, output_dir=str(ref / "out"), log_file=str(ref / "log.jsonl"),
                    weights_file=str(ref / "weights.npz"))
    (ref / "train.json").write_text(json.dumps(settings))
    env = {k: v for k, v in os.environ.items() if not k.startswith("MEMGUARD_") and k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, str(STOCK_DIR / "stock_hf_trainer.py"), str(ref / "train.json")],
                         env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return ref / "weights.npz"


def steps(log: Path) -> List[Dict[str, Any]]:
    return [e for e in read_jsonl(log) if e["event"] == "step"]


def test_a_stock_trainer_configured_from_a_json_file_is_planned_at_train_start(runtime) -> None:
    import numpy as np

    with tempfile.TemporaryDirectory(prefix="mg-trainstart-") as t:
        tmp = Path(t)
        tmp.chmod(0o755)
        job = the_job(tmp)

        # Unguarded, the limit kills it.
        alone_log = tmp / "alone"
        alone_log.mkdir(mode=0o777)
        (tmp / "alone-pod").mkdir()
        with Pod(job_pod("mgtest-trainstart-alone", job, alone_log, False), tmp / "alone-pod") as pod:
            wait_for("the unguarded trainer to end",
                     lambda: pod.state("train").get("Status") in ("exited", "stopped"), timeout=600)
            alone_state = pod.state("train")
            alone_kills = kernel_oom_kills(pod.container_id("train"))
            alone_logs = podman("logs", pod.container("train"), check=False).stderr[-2000:]
        assert alone_kills >= 1 and alone_state.get("ExitCode") == 137, (alone_kills, alone_state, alone_logs)

        # Guarded with only the label: admission cannot read the JSON file.
        logdir = tmp / "guarded"
        logdir.mkdir(mode=0o777)
        (tmp / "guarded-pod").mkdir()
        mutated = mutate(job_pod("mgtest-trainstart", job, logdir, True))
        error = mutated["metadata"]["annotations"]["memguard.io/error"]
        assert error.startswith("not planned at admission, guarded at run time"), error
        trainer = mutated["spec"]["containers"][0]
        assert trainer["command"][-1] == "/opt/job/train.json" and "args" not in trainer
        assert not any(e["name"] == "MEMGUARD_BATCH_SIZE" for e in trainer.get("env", []))
        manifest = for_podman(mutated, tmp / "guarded-pod")
        with Pod(manifest, tmp / "guarded-pod") as pod:
            scraped = wait_for(
                "the reported config on /metrics",
                lambda: (lambda m: m if m and "memguard_sidecar_train_start_planned" in m else None)(pod.metrics()),
                timeout=600,
            )
            wait_for("the guarded trainer to end",
                     lambda: pod.state("train").get("Status") in ("exited", "stopped"), timeout=900)
            state = pod.state("train")
            kills = kernel_oom_kills(pod.container_id("train"))
            wait_for("the sidecar's summary",
                     lambda: pod.state("memguard-sidecar").get("Status") in ("exited", "stopped"), timeout=60)
            summary = sidecar_summary(pod)
        # What `-s` shows: the facts this run rests on.
        print(json.dumps({"unguarded": {"exit": alone_state.get("ExitCode"), "oom_kills": alone_kills},
                          "guarded": {"exit": state.get("ExitCode"), "oom_kills": kills},
                          "train_start": summary.get("train_start")}))
        assert state.get("ExitCode") == 0 and kills == 0, (state, kills)
        assert metric(scraped, "memguard_sidecar_trainer_config", 'knob="batch-size"') == 16, scraped
        assert metric(scraped, "memguard_sidecar_trainer_config", 'knob="seq-length"') == 256
        assert metric(scraped, "memguard_sidecar_trainer_config", 'knob="vocab-size"') == 32000
        assert metric(scraped, "memguard_sidecar_train_start_planned") == 1
        plan = summary["train_start"]
        assert plan["planned"] and plan["batch_size"] < 16, plan
        assert plan["batch_size"] * plan["grad_accumulation"] == 16, plan
        assert summary["oom_events"] == 0, summary
        ran = steps(logdir / "log.jsonl")
        assert len(ran) == 2 and all(sum(s["micro"]) == 16 for s in ran), ran
        # The plan from the first step; later steps never above it (the sidecar may still
        # shrink under pressure: on a loaded machine the host's PSI does).
        assert set(ran[0]["micro"]) == {plan["batch_size"]}, (ran, plan)
        assert all(max(s["micro"]) <= plan["batch_size"] for s in ran), (ran, plan)
        done = [e for e in read_jsonl(logdir / "log.jsonl") if e["event"] == "done"]
        assert done and done[0]["samples"] == SETTINGS["samples"] and done[0]["attached"], done
        unlimited = unlimited_weights(tmp, job)
        x, y = np.load(logdir / "weights.npz"), np.load(unlimited)
        for k in x.files:
            np.testing.assert_allclose(x[k], y[k], rtol=1e-4, atol=1e-6, err_msg=k)

        # The next admission of the same job plans on what this run reported: the profile the
        # controller learns from the finished pod, under its launch key.
        explained = explain(finished(mutated, summary))
        key = explained["launch_key"]["name"]
        assert explained["next"]["profile"]["name"] == key, explained["next"]
        assert "planned on the trainer's report of mgtest-trainstart" in explained["next"]["planned_on"]
        profile = {"apiVersion": "training.memguard.io/v1alpha1", "kind": "MemoryProfile",
                   "metadata": {"name": key},
                   "spec": explained["next"]["profile"]["spec"],
                   "status": explained["next"]["profile"]["status"]}
        next_log = tmp / "next"
        next_log.mkdir(mode=0o777)
        (tmp / "next-pod").mkdir()
        planned = mutate(job_pod("mgtest-trainstart", job, next_log, True), profile)
        trainer = planned["spec"]["containers"][0]
        assert trainer["command"] == mutated["spec"]["containers"][0]["command"], trainer
        env = {e["name"]: e.get("value") for e in trainer.get("env", [])}
        assert int(env["MEMGUARD_BATCH_SIZE"]) == plan["batch_size"], (env, plan)
        assert int(env["MEMGUARD_GRAD_ACCUMULATION"]) == plan["grad_accumulation"], (env, plan)
        estimate = json.loads(planned["metadata"]["annotations"]["memguard.io/estimate"])
        assert set(estimate["sources"].values()) == {"profile:trainer-report"}, estimate
        planned["metadata"]["name"] = "mgtest-trainstart-next"
        with Pod(for_podman(planned, tmp / "next-pod"), tmp / "next-pod") as pod:
            wait_for("the planned trainer to end",
                     lambda: pod.state("train").get("Status") in ("exited", "stopped"), timeout=900)
            next_state = pod.state("train")
            next_kills = kernel_oom_kills(pod.container_id("train"))
        print(json.dumps({"next": {"exit": next_state.get("ExitCode"), "oom_kills": next_kills,
                                   "env_plan": [env["MEMGUARD_BATCH_SIZE"], env["MEMGUARD_GRAD_ACCUMULATION"]],
                                   "profile": key}}))
        assert next_state.get("ExitCode") == 0 and next_kills == 0, (next_state, next_kills)
        ran = steps(next_log / "log.jsonl")
        assert len(ran) == 2 and set(ran[0]["micro"]) == {plan["batch_size"]}, (ran, plan)
        assert all(sum(s["micro"]) == 16 for s in ran), ran
        x = np.load(next_log / "weights.npz")
        for k in x.files:
            np.testing.assert_allclose(x[k], y[k], rtol=1e-4, atol=1e-6, err_msg=k)


def finished(pod: Dict[str, Any], summary: Dict[str, Any]) -> Dict[str, Any]:
    """`pod` as the API server reports it once its run ended: the trainer completed, the
    sidecar's summary (from its log here) as its termination message."""
    pod = json.loads(json.dumps(pod))
    pod["metadata"]["uid"] = "uid-" + pod["metadata"]["name"]
    terminated = {"exitCode": 0, "reason": "Completed", "finishedAt": "2026-11-29T06:00:00Z"}
    pod["status"] = {"phase": "Succeeded", "containerStatuses": [
        {"name": "train", "image": "x", "imageID": "", "ready": False, "restartCount": 0,
         "state": {"terminated": terminated}},
        {"name": "memguard-sidecar", "image": "x", "imageID": "", "ready": False, "restartCount": 0,
         "state": {"terminated": dict(terminated, message=json.dumps(summary))}},
    ]}
    return pod
