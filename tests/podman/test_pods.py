"""memguard's pod, as `memguard mutate` writes it, run by a real container runtime (podman +
runc, cgroup v1), with the memguard image as its sidecar. The sidecar's figures are checked
against the kernel's own: the trainer's cgroup limit, and the OOM kills the kernel logged for the
trainer's container (dmesg names the memory cgroup of each kill).

Run: `python3 -m pytest -q tests/podman` as root (scripts/test.sh does, after building the image
once). Without podman, root or cgroup v1 it skips, except under CI=true, where it fails.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, Iterator, Optional

import pytest

from harness import (
    CI,
    IMAGE,
    MIB,
    ROOT,
    TRAINER_BASE,
    TRAINER_OWN_GROUP,
    Pod,
    ensure_image,
    ensure_trainer_base,
    ensure_trainer_own_group,
    for_podman,
    kernel_oom_kills,
    metric,
    missing_runtime,
    mutate,
    podman,
    read_jsonl,
    wait_for,
)

#: 1 GiB: the estimator's CPU baseline (a torch process, about 424 MiB) under its 0.95 upper
#: bound must fit the budget at batch 8, so that the webhook admits the pod as written.
LIMIT = "1Gi"
#: Per sample: at the webhook's batch 8 a step holds 1280 MiB (over the limit, at once); after
#: one sticky downgrade, batch 4 holds 640 MiB.
PER_SAMPLE_MIB = 160


@pytest.fixture(scope="session")
def runtime() -> Iterator[None]:
    why = missing_runtime()
    if why:
        if CI:
            pytest.fail(f"podman pod tests cannot run under CI=true: {why}")
        pytest.skip(why)
    ensure_image()
    ensure_trainer_base()
    yield
    podman("rmi", "-f", TRAINER_BASE, check=False)


def trainer_pod(name: str, security: Optional[Dict[str, Any]], env: Dict[str, str], logdir: Path) -> Dict[str, Any]:
    """A pod a user would write: memguard opted in, a tiny model, batch 8, a 1Gi limit,
    `restartPolicy: OnFailure`; python3 and the client from the host (hostPath)."""
    container: Dict[str, Any] = {
        "name": "train",
        "image": TRAINER_BASE,
        "command": ["/usr/bin/python3", "/opt/memguard-test/trainer.py"],
        "env": [
            {"name": "PYTHONPATH", "value": "/opt/memguard-client"},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
            {"name": "LOG", "value": "/var/log/mgtest/trainer.jsonl"},
            {"name": "PER_SAMPLE_MIB", "value": str(PER_SAMPLE_MIB)},
        ]
        + [{"name": k, "value": v} for k, v in env.items()],
        "resources": {"limits": {"memory": LIMIT}},
        "volumeMounts": [
            {"name": "host-usr", "mountPath": "/usr", "readOnly": True},
            {"name": "client", "mountPath": "/opt/memguard-client", "readOnly": True},
            {"name": "test", "mountPath": "/opt/memguard-test", "readOnly": True},
            {"name": "log", "mountPath": "/var/log/mgtest"},
        ],
    }
    if security:
        container["securityContext"] = security
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {"memguard.io/enabled": "true"},
            "annotations": {
                "memguard.io/hidden-size": "16",
                "memguard.io/num-layers": "2",
                "memguard.io/num-heads": "2",
                "memguard.io/vocab-size": "100",
                "memguard.io/precision": "fp32",
                "memguard.io/batch-size": "8",
                "memguard.io/seq-length": "16",
            },
        },
        "spec": {
            "restartPolicy": "OnFailure",
            "containers": [container],
            "volumes": [
                {"name": "host-usr", "hostPath": {"path": "/usr", "type": "Directory"}},
                {"name": "client", "hostPath": {"path": str(ROOT / "clients/python/src"), "type": "Directory"}},
                {"name": "test", "hostPath": {"path": str(ROOT / "tests/podman"), "type": "Directory"}},
                {"name": "log", "hostPath": {"path": str(logdir), "type": "Directory"}},
            ],
        },
    }


def sidecar_summary(pod: Pod) -> Dict[str, Any]:
    for line in pod.logs("memguard-sidecar"):
        fields = line.get("fields", line)
        if "summary" in fields and "summary" in str(fields.get("message", "")):
            return json.loads(fields["summary"])
    raise AssertionError(f"no summary in the sidecar's log: {pod.logs('memguard-sidecar')[-5:]}")


def log_events(pod: Pod, message: str):
    out = []
    for line in pod.logs("memguard-sidecar"):
        fields = line.get("fields", line)
        if fields.get("message") == message:
            out.append(fields)
    return out


def run_guarded(name: str, security: Optional[Dict[str, Any]], kills: int, tmp: Path):
    """Plays the mutated pod until the trainer finishes; returns what was seen."""
    logdir = tmp / "log"
    logdir.mkdir(mode=0o777)
    logdir.chmod(0o777)
    env = {"SHAPE": "spike", "KILLS": str(kills), "STEPS": "6", "STEP_SECONDS": "0.2"}
    mutated = mutate(trainer_pod(name, security, env, logdir))
    sidecar = next(c for c in mutated["spec"]["containers"] if c["name"] == "memguard-sidecar")
    pod_manifest = for_podman(mutated, tmp)
    trainer_log = logdir / "trainer.jsonl"
    with Pod(pod_manifest, tmp) as pod:
        scraped = wait_for(
            "the sidecar to read the trainer's cgroup",
            lambda: (m := pod.metrics()) and metric(m, "memguard_sidecar_limit_bytes") is not None and m,
            timeout=60,
        )
        wait_for(
            "the trainer to finish",
            lambda: any(e["event"] == "done" for e in read_jsonl(trainer_log)),
            timeout=120,
        )
        wait_for("the sidecar to exit", lambda: pod.state("memguard-sidecar").get("Status") == "exited", timeout=30)
        trainer_id = pod.container_id("train")
        seen = {
            "sidecar_container": sidecar,
            "scraped": scraped,
            "summary": sidecar_summary(pod),
            "found": log_events(pod, "found the trainer; reading its own cgroup"),
            "fallback": log_events(pod, "found the trainer but not its cgroup; falling back to summed RSS (give the sidecar the trainer's uid/gid, see docs/sidecar.md)"),
            "trainer": read_jsonl(trainer_log),
            "kernel_kills": kernel_oom_kills(trainer_id),
            "trainer_state": pod.state("train"),
            "sidecar_state": pod.state("memguard-sidecar"),
            "restarts": pod.restarts("train"),
            "sidecar_log": [
                {k: v for k, v in e.items() if k in ("message", "pid", "reason", "why", "exit_reason")}
                for e in pod.logs("memguard-sidecar")
            ],
        }
    return seen


UID_CASES = {
    # The trainer as root: the sidecar is root with the trainer's (default) capabilities.
    "root": {"runAsUser": 0},
    # The sidecar's own uid, no runAsGroup: the trainer's image does not list 65532, so it runs
    # with gid 0; the webhook gives the sidecar 65532:0 (it used to get its image's 65532:65532
    # and lose the cgroup).
    "uid-65532": {"runAsUser": 65532, "runAsNonRoot": True},
    # Another non-root uid with its group.
    "uid-1000": {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True},
}


@pytest.mark.parametrize("case", list(UID_CASES))
def test_an_oom_killed_trainer_is_counted_and_restarts_smaller_under_the_same_sidecar(runtime, case):
    with tempfile.TemporaryDirectory(prefix=f"mg-pod-{case}-") as t:
        tmp = Path(t)
        tmp.chmod(0o755)
        seen = run_guarded(f"mgtest-{case}", UID_CASES[case], kills=1, tmp=tmp)
    starts = [e for e in seen["trainer"] if e["event"] == "start"]
    sc = seen["sidecar_container"]["securityContext"]
    # The webhook's identity for the sidecar: the trainer's uid, and always a group.
    assert sc["runAsUser"] == UID_CASES[case]["runAsUser"]
    assert "runAsGroup" in sc
    assert {(e["uid"], e["gid"]) for e in starts} == {(sc["runAsUser"], sc["runAsGroup"])}, (
        "the trainer runs with the identity the sidecar was given",
        starts,
        sc,
    )
    # The kernel killed the first start, once; podman restarted it in place.
    assert seen["kernel_kills"] == 1, seen["kernel_kills"]
    assert len(starts) == 2 and seen["restarts"] == 1, (starts, seen["restarts"])
    # The sidecar read the trainer's own cgroup (not the RSS fallback, not its own 32Mi limit).
    assert seen["fallback"] == [], seen["fallback"]
    scraped = seen["scraped"]
    assert metric(scraped, "memguard_sidecar_source_info", 'kind="cgroup-v1"') == 1, scraped
    assert metric(scraped, "memguard_sidecar_source_info", 'view="trainer-mount"') == 1
    assert metric(scraped, "memguard_sidecar_limit_bytes") == 1024 * MIB
    # It found the trainer at each start, never the infra process (PID 1) or itself.
    trainer_pids = {e["pid"] for e in starts}
    found_pids = [int(f["pid"]) for f in seen["found"]]
    assert len(found_pids) == 2 and set(found_pids) <= trainer_pids, (found_pids, trainer_pids)
    # It counted the kill, stayed for the restart, and the restart started at the sticky batch.
    summary = seen["summary"]
    assert summary["oom_events"] == seen["kernel_kills"], summary
    assert summary["limit_bytes"] == 1024 * MIB, summary
    assert summary["exit_reason"] == "trainer-exited", summary
    # The restart began at the sticky batch (one rung below what was in force at the kill: the
    # sidecar may have downgraded during the spike's climb already), the effective batch kept.
    sticky = summary["sticky_batch_size"]
    assert starts[0]["batch"] == 8 and sticky is not None and sticky < 8, (starts, summary)
    assert starts[1]["batch"] == sticky, (starts, summary)
    assert starts[1]["batch"] * starts[1]["accumulation"] == 8, "the effective batch is kept"
    done = [e for e in seen["trainer"] if e["event"] == "done"]
    assert done and done[0]["batch"] <= sticky
    assert seen["trainer_state"].get("ExitCode") == 0


def test_every_kill_of_a_trainer_killed_again_and_again_is_counted(runtime):
    """Five kills in a row, each with the cgroup removed at once by runc: each is counted (the
    sidecar keeps the cgroup directory open and wakes on the trainer's pidfd)."""
    kills = 5
    with tempfile.TemporaryDirectory(prefix="mg-pod-kills-") as t:
        tmp = Path(t)
        tmp.chmod(0o755)
        seen = run_guarded("mgtest-kills", {"runAsUser": 1000, "runAsGroup": 1000}, kills=kills, tmp=tmp)
    starts = [e for e in seen["trainer"] if e["event"] == "start"]
    assert seen["kernel_kills"] == kills and len(starts) == kills + 1, (seen["kernel_kills"], starts)
    assert seen["summary"]["oom_events"] == kills, (seen["summary"], seen["sidecar_log"], starts)
    # Each kill stepped at least one rung further down: 8 → 4 → 2 → 1 → checkpointing.
    assert starts[-1]["batch"] == 1 and seen["summary"]["sticky_batch_size"] == 1, starts[-1]


def test_under_restart_policy_never_the_sidecar_leaves_with_the_killed_trainer(runtime):
    """`restartPolicy: Never`: no restart can come, so the sidecar (told the pod's policy by the
    webhook) exits as soon as it has counted the kill, not after `--restart-wait` (330 s)."""
    with tempfile.TemporaryDirectory(prefix="mg-pod-never-") as t:
        tmp = Path(t)
        tmp.chmod(0o755)
        logdir = tmp / "log"
        logdir.mkdir(mode=0o777)
        logdir.chmod(0o777)
        pod = trainer_pod("mgtest-never", {"runAsUser": 1000, "runAsGroup": 1000},
                          {"SHAPE": "spike", "KILLS": "1", "STEPS": "6", "STEP_SECONDS": "0.2"}, logdir)
        pod["spec"]["restartPolicy"] = "Never"
        mutated = mutate(pod)
        sidecar = next(c for c in mutated["spec"]["containers"] if c["name"] == "memguard-sidecar")
        assert {"name": "MEMGUARD_SIDECAR_POD_RESTART_POLICY", "value": "Never"} in sidecar["env"]
        with Pod(for_podman(mutated, tmp), tmp) as p:
            wait_for("the trainer's death", lambda: p.state("train").get("Status") == "exited", timeout=60)
            killed_at = time.monotonic()
            wait_for("the sidecar to exit", lambda: p.state("memguard-sidecar").get("Status") == "exited", timeout=20)
            left_after = time.monotonic() - killed_at
            summary = sidecar_summary(p)
            kernel = kernel_oom_kills(p.container_id("train"))
            trainer = p.state("train")
    assert trainer.get("ExitCode") == 137 and kernel == 1, (trainer, kernel)
    assert summary["oom_events"] == 1 and summary["exit_reason"] == "trainer-exited", summary
    print(f"restartPolicy Never: the sidecar left {left_after:.1f} s after the trainer's kill")
    assert left_after < 20, left_after


@pytest.mark.parametrize("report_at_start", ["1", "0"])
def test_a_trainer_whose_group_differs_from_the_sidecars_has_its_limit_and_kill_from_its_client(runtime, report_at_start):
    """Issue 37, item 6: the trainer's image maps uid 65532 to group 65532 and the pod sets no
    `runAsGroup`, so the trainer runs as 65532:65532 and the sidecar (65532:0: the webhook cannot
    see the image) cannot open `/proc/<pid>/root`. The trainer's client reports its own cgroup:
    the sidecar's limit is the cgroup's (the downward-API limit is taken away here, so it can
    come from nowhere else), and the OOM kill of a worker process, seen by the trainer that
    survived it, is counted, as the kernel logged it. Also when the first report the sidecar
    gets is the one after the kill (`report_at_start` 0): the report carries the counter at the
    client's start, and the kill is counted from it, not taken as the baseline."""
    ensure_trainer_own_group()
    with tempfile.TemporaryDirectory(prefix="mg-pod-own-group-") as t:
        tmp = Path(t)
        tmp.chmod(0o755)
        logdir = tmp / "log"
        logdir.mkdir(mode=0o777)
        logdir.chmod(0o777)
        env = {"SHAPE": "worker", "STEPS": "4", "STEP_SECONDS": "0.3", "REPORT_AT_START": report_at_start}
        pod = trainer_pod("mgtest-own-group", {"runAsUser": 65532, "runAsNonRoot": True}, env, logdir)
        pod["spec"]["containers"][0]["image"] = TRAINER_OWN_GROUP
        # The client under test is this checkout's (hostPath), not the copy the image embeds.
        pod["metadata"]["annotations"]["memguard.io/inject-client"] = "false"
        mutated = mutate(pod)
        sidecar = next(c for c in mutated["spec"]["containers"] if c["name"] == "memguard-sidecar")
        manifest = for_podman(mutated, tmp)
        side = next(c for c in manifest["spec"]["containers"] if c["name"] == "memguard-sidecar")
        side["env"] = [e for e in side["env"] if e["name"] != "MEMGUARD_TRAINER_MEMORY_LIMIT"]
        trainer_log = logdir / "trainer.jsonl"
        try:
            with Pod(manifest, tmp) as p:
                scraped = wait_for(
                    "the sidecar to take the client's report of the trainer's cgroup, after a kill",
                    lambda: (m := p.metrics())
                    and metric(m, "memguard_sidecar_source_info", 'view="client-report"') == 1
                    and (metric(m, "memguard_sidecar_oom_kills_total") or 0) >= 1
                    and m,
                    timeout=90,
                    seen=lambda: {
                        "metrics": [line for line in (p.metrics() or "").splitlines()
                                    if line.startswith(("memguard_sidecar_source_info", "memguard_sidecar_oom", "memguard_sidecar_limit"))],
                        "trainer": read_jsonl(trainer_log),
                        "trainer_state": p.state("train"),
                        "sidecar_log": p.logs("memguard-sidecar")[-30:],
                    },
                )
                wait_for("the trainer to finish", lambda: any(e["event"] in ("done", "failed") for e in read_jsonl(trainer_log)), timeout=90)
                wait_for("the sidecar to exit", lambda: p.state("memguard-sidecar").get("Status") == "exited", timeout=30)
                summary = sidecar_summary(p)
                kernel = kernel_oom_kills(p.container_id("train"))
                fallback = log_events(p, "found the trainer but not its cgroup; falling back to summed RSS (give the sidecar the trainer's uid/gid, see docs/sidecar.md)")
                trainer_state = p.state("train")
            events = read_jsonl(trainer_log)
        finally:
            podman("rmi", "-f", TRAINER_OWN_GROUP, check=False)
    starts = [e for e in events if e["event"] == "start"]
    killed = [e for e in events if e["event"] == "worker-killed"]
    sc = sidecar["securityContext"]
    print(f"group mismatch: kernel kills {kernel}, sidecar summary {json.dumps(summary)}")
    # The mismatch: the trainer took its image's group, the sidecar the webhook's 0.
    assert (sc["runAsUser"], sc["runAsGroup"]) == (65532, 0), sc
    assert {(e["uid"], e["gid"]) for e in starts} == {(65532, 65532)}, starts
    assert fallback, "the sidecar could not read the trainer's cgroup itself"
    # The kernel killed a worker at the 1 GiB limit; the trainer survived and reported it.
    assert kernel >= 1 and len(killed) == kernel, (kernel, killed)
    assert killed[0]["batch"] == 8, killed
    assert summary["oom_events"] == kernel, summary
    assert summary["limit_bytes"] == 1024 * MIB, summary
    assert summary["memory_source"] == "cgroup-v1 via client-report", summary
    assert metric(scraped, "memguard_sidecar_limit_bytes") == 1024 * MIB, scraped
    assert metric(scraped, "memguard_sidecar_source_info", 'kind="cgroup-v1"') == 1
    # The kill's sticky downgrade reached the trainer: it finished below the killed batch.
    steps = [e for e in events if e["event"] == "step"]
    assert steps and all(e["batch"] < 8 for e in steps), steps
    assert summary["sticky_batch_size"] is not None and summary["sticky_batch_size"] < 8, summary
    assert trainer_state.get("ExitCode") == 0, trainer_state
