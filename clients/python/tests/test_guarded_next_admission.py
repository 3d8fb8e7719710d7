"""The next admission of a job admission cannot read plans on its trainer's report (issue 37),
end to end on this machine: the real `memguard` CLI admits a stock HF script whose only argument
is a JSON file (Guarded: nothing planned); the same script runs with the injected client in a
real cgroup v1 limit, watched by the real `memguard-sidecar`, and reports its config at train
start; that run's summary, as the sidecar wrote it, is the pod's termination message, and
`memguard explain` (the profile controller's observe/update and the webhook's decision, offline)
learns it under the pod's launch key and admits the next pod of the job on it. That pod's
`MEMGUARD_*` env, given to a second run of the script, is applied by the client from step 1 with
the effective batch kept: the parameters equal an unguarded run's."""
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

from test_auto import clean_env, done, install, steps
from test_train_start_plan import (BATCH, CI, MIB, ROOT, SAMPLES, VOCAB, Sidecar,
                                   assert_same_parameters, in_cgroup, limit_2g, stock, unguarded)

__all__ = ["limit_2g"]  # the fixture, used by name

MEMGUARD = os.environ.get("MEMGUARD_BIN", str(ROOT / "target" / "debug" / "memguard"))

#: The job as a pod: the stock script reading every setting from a JSON file in a ConfigMap (the
#: transformers examples' convention), a 2 GiB limit, only the opt-in label.
POD: Dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "tiny-1", "namespace": "ml", "uid": "uid-tiny-1",
                 "labels": {"memguard.io/enabled": "true"}},
    "spec": {"restartPolicy": "Never",
             "containers": [{"name": "trainer", "image": "memguard-trainer:1",
                             "command": ["python", "/job/stock_hf_trainer.py", "/config/train.json"],
                             "resources": {"limits": {"memory": "2Gi"}},
                             "volumeMounts": [{"name": "config", "mountPath": "/config"}]}],
             "volumes": [{"name": "config", "configMap": {"name": "tiny-llama-json"}}]},
}


def memguard(tmp: Path, *args: str) -> str:
    if not Path(MEMGUARD).exists():
        if CI:
            pytest.fail(f"the memguard binary is missing: {MEMGUARD}")
        pytest.skip(f"build the CLI first (cargo build -p memguard): {MEMGUARD}")
    out = subprocess.run([MEMGUARD, *args], cwd=tmp, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def admit(tmp: Path, pod: Dict[str, Any], profile: Dict[str, Any] = None) -> Dict[str, Any]:
    (tmp / "pod.json").write_text(json.dumps(pod))
    args = ["mutate", "-o", "json", "-f", "pod.json"]
    if profile is not None:
        (tmp / "profile.json").write_text(json.dumps(profile))
        args += ["--profile", "profile.json"]
    return json.loads(memguard(tmp, *args))


def env_of(container: Dict[str, Any]) -> Dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


def sidecar_container(pod: Dict[str, Any]) -> Dict[str, Any]:
    spec = pod["spec"]
    return next(c for c in spec.get("initContainers", []) + spec["containers"]
                if c["name"] == "memguard-sidecar")


def finished(pod: Dict[str, Any], summary: Dict[str, Any]) -> Dict[str, Any]:
    """`pod` after its run, as the API server reports it: the sidecar's summary as its
    termination message."""
    pod = json.loads(json.dumps(pod))
    pod["status"] = {
        "phase": "Succeeded",
        "containerStatuses": [{"name": "trainer", "image": "x", "imageID": "", "ready": False,
                               "restartCount": 0, "state": {"terminated": {
                                   "exitCode": 0, "reason": "Completed",
                                   "finishedAt": "2026-11-29T06:00:00Z"}}}],
        "initContainerStatuses": [{"name": "memguard-sidecar", "image": "x", "imageID": "",
                                   "ready": False, "restartCount": 0, "state": {"terminated": {
                                       "exitCode": 0, "reason": "Completed",
                                       "finishedAt": "2026-11-29T06:00:01Z",
                                       "message": json.dumps(summary)}}}],
    }
    return pod


def run_stock(tmp: Path, cgroup: Path, sidecar: Sidecar, extra_env: Dict[str, str]) -> List[List[int]]:
    client = install(tmp / "client")
    log, weights = tmp / "log.jsonl", tmp / "weights.npz"
    env = clean_env(PYTHONPATH=str(client), MEMGUARD_SIDECAR_URL=sidecar.url, **extra_env)
    out = subprocess.run(in_cgroup(cgroup, [sys.executable, *stock(tmp, log, weights)]),
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert [d["attached"] for d in done(log)] == [True]
    return [e["micro"] for e in steps(log)]


def test_the_next_admission_of_a_guarded_job_plans_on_its_real_report(
    tmp_path: Path, limit_2g: Path
) -> None:
    # First admission: Guarded, nothing planned.
    first = admit(tmp_path, POD)
    error = first["metadata"]["annotations"]["memguard.io/error"]
    assert "guarded at run time" in error, error
    trainer_env = env_of(first["spec"]["containers"][0])
    assert "MEMGUARD_BATCH_SIZE" not in trainer_env, trainer_env
    train_start = env_of(sidecar_container(first))["MEMGUARD_SIDECAR_TRAIN_START"]

    # Its run: configured at 16 × 1, the sidecar plans it at train start with the settings the
    # webhook wrote.
    run1 = tmp_path / "run1"
    run1.mkdir()
    sidecar = Sidecar(run1, limit_2g, train_start=train_start)
    try:
        ran = run_stock(run1, limit_2g, sidecar, {})
    finally:
        summary = sidecar.stop()
    assert ran[0] == [4, 4, 4, 4], ran
    assert summary["trainer_config"]["vocab-size"] == VOCAB, summary
    assert summary["train_start"]["batch_size"] == 4, summary

    # The controller's observe/update and the webhook's decision, offline: `memguard explain`
    # of the finished pod learns the report under its launch key and admits the next pod.
    (tmp_path / "status.json").write_text(json.dumps(finished(first, summary)))
    explained = json.loads(memguard(tmp_path, "explain", "-f", "status.json", "-o", "json"))
    key = explained["launch_key"]["name"]
    assert key.startswith("launch-") and explained["next"]["profile"]["name"] == key, explained
    assert "planned on the trainer's report of tiny-1" in explained["next"]["planned_on"]
    assert explained["next"]["config"]["batchSize"] == 4, explained["next"]
    profile = {"apiVersion": "training.memguard.io/v1alpha1", "kind": "MemoryProfile",
               "metadata": {"name": key, "namespace": "ml"},
               "spec": explained["next"]["profile"]["spec"],
               "status": explained["next"]["profile"]["status"]}

    # The next pod of the job, admitted with that profile: planned on the report.
    second_pod = json.loads(json.dumps(POD))
    second_pod["metadata"].update(name="tiny-2", uid="uid-tiny-2")
    second = admit(tmp_path, second_pod, profile)
    estimate = json.loads(second["metadata"]["annotations"]["memguard.io/estimate"])
    assert set(estimate["sources"].values()) == {"profile:trainer-report"}, estimate["sources"]
    assert second["spec"]["containers"][0]["command"] == POD["spec"]["containers"][0]["command"]
    planned = env_of(second["spec"]["containers"][0])
    batch, accumulation = int(planned["MEMGUARD_BATCH_SIZE"]), int(planned["MEMGUARD_GRAD_ACCUMULATION"])
    assert (batch, accumulation) == (4, 4), planned
    assert abs(estimate["budget"] - 2048 * MIB * 0.9) < 1, estimate
    sidecar_env = env_of(sidecar_container(second))

    # The second run gets the admission's env (no train-start plan: only the env moves it) and
    # runs 4 × 4 from its first step, the effective batch kept.
    run2 = tmp_path / "run2"
    run2.mkdir()
    knobs = {k: v for k, v in planned.items()
             if k in ("MEMGUARD_BATCH_SIZE", "MEMGUARD_GRAD_ACCUMULATION", "MEMGUARD_GRAD_CHECKPOINTING")}
    started = {k: v for k, v in sidecar_env.items()
               if k in ("MEMGUARD_BATCH_SIZE", "MEMGUARD_GRAD_ACCUMULATION", "MEMGUARD_GRAD_CHECKPOINTING",
                        "MEMGUARD_SIDECAR_ADMITTED_CONFIG")}
    # The sidecar compares the report with the launch as configured (16 × 1): the env plan is
    # applied by re-chunking, so nothing differs.
    assert "batch-size=16" in started["MEMGUARD_SIDECAR_ADMITTED_CONFIG"], started
    sidecar = Sidecar(run2, limit_2g, train_start=None, env=started)
    try:
        ran = run_stock(run2, limit_2g, sidecar, knobs)
    finally:
        summary2 = sidecar.stop()
    assert ran[0] == [4, 4, 4, 4], ran
    assert all(sum(m) == BATCH and max(m) <= 4 for m in ran), ran
    assert len(ran) == SAMPLES // BATCH
    assert summary2["oom_events"] == 0, summary2
    assert summary2.get("config_mismatch", []) == [], summary2
    assert_same_parameters(run2 / "weights.npz", unguarded(tmp_path))
