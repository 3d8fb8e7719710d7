"""Runs pods written by `memguard mutate` in a real container runtime: `podman kube play`.

The harness adapts the pod to what podman 4.3 does differently from a kubelet, never the
webhook's output otherwise (docs/podman.md lists each difference):

- annotation values longer than 63 characters are refused: `memguard.io/estimate` and the like
  are dropped;
- a downward-API `resourceFieldRef` naming another container resolves to the sidecar's own
  limit: `MEMGUARD_TRAINER_MEMORY_LIMIT` gets the trainer's limit as a literal;
- an `emptyDir` is a root-owned 0755 volume, where the kubelet's is 0777: it becomes a hostPath
  to a 0777 directory, so a non-root sidecar can write its signal file;
- native sidecars (init containers with `restartPolicy: Always`) are not supported: pods are
  mutated with `--sidecar-mode classic`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[2]
IMAGE = os.environ.get("MEMGUARD_IMAGE", "localhost/memguard:dev")
TRAINER_BASE = "localhost/memguard-test-trainer:base"
CI = os.environ.get("CI") == "true"
MIB = 1 << 20

os.environ.setdefault("CONTAINERS_CONF", str(ROOT / "scripts" / "containers.conf"))


def run(*cmd: str, check: bool = True, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def podman(*args: str, check: bool = True, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess:
    return run("podman", *args, check=check, timeout=timeout, **kw)


def missing_runtime() -> Optional[str]:
    """Why pods cannot run here, or None."""
    for tool in ("podman", "buildah", "runc"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/install-deps.sh installs it)"
    if os.geteuid() != 0:
        return "not root (rootful podman and the kernel log are needed)"
    if not Path("/sys/fs/cgroup/memory/memory.limit_in_bytes").exists():
        return "no cgroup v1 memory controller"
    return None


def image_exists(name: str) -> bool:
    return podman("image", "exists", name, check=False).returncode == 0


def ensure_image() -> None:
    """The memguard image, built once (scripts/build-image.sh) and reused."""
    if not image_exists(IMAGE):
        run("bash", str(ROOT / "scripts" / "build-image.sh"), IMAGE, timeout=1800)


def ensure_trainer_base() -> None:
    """A trainer image that holds nothing but the directories the host's /usr is mounted into
    (hostPath: python3 and the client come from the host, so the image stays empty) and an
    /etc/passwd listing root only, as many GPU images do: a non-root uid runs with gid 0."""
    if image_exists(TRAINER_BASE):
        return
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = Path(tmp)
        for d in ("usr", "etc", "tmp", "opt", "var/log", "var/run", "proc", "sys", "dev"):
            (rootfs / d).mkdir(parents=True, exist_ok=True)
        (rootfs / "tmp").chmod(0o1777)
        for link in ("bin", "lib", "lib64", "sbin"):
            (rootfs / link).symlink_to(f"usr/{link}")
        (rootfs / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
        (rootfs / "etc/group").write_text("root:x:0:\n")
        ctr = run("buildah", "from", "scratch").stdout.strip()
        try:
            run("buildah", "copy", ctr, str(rootfs), "/")
            run("buildah", "config", "--env", "PATH=/usr/local/bin:/usr/bin:/bin", ctr)
            run("buildah", "commit", "-q", ctr, TRAINER_BASE)
        finally:
            run("buildah", "rm", ctr, check=False)


#: The trainer image whose /etc/passwd maps the trainer's uid 65532 to its own group 65532.
TRAINER_OWN_GROUP = "localhost/memguard-test-trainer:own-group"


def ensure_trainer_own_group() -> None:
    """TRAINER_BASE with an /etc/passwd that lists uid 65532 with its own group 65532, as many
    images list their non-root user: a pod with `runAsUser: 65532` and no `runAsGroup` runs the
    trainer as 65532:65532, while the webhook, which cannot see the image, gives the sidecar
    65532:0 (issue 37, item 6). One layer over TRAINER_BASE: seconds."""
    ensure_trainer_base()
    if image_exists(TRAINER_OWN_GROUP):
        return
    with tempfile.TemporaryDirectory() as tmp:
        etc = Path(tmp) / "etc"
        etc.mkdir()
        (etc / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\ntrainer:x:65532:65532::/tmp:/bin/sh\n")
        (etc / "group").write_text("root:x:0:\ntrainer:x:65532:\n")
        ctr = run("buildah", "from", "--pull-never", TRAINER_BASE).stdout.strip()
        try:
            run("buildah", "copy", ctr, str(etc), "/etc")
            run("buildah", "commit", "-q", ctr, TRAINER_OWN_GROUP)
        finally:
            run("buildah", "rm", ctr, check=False)


def memguard_bin() -> str:
    return os.environ.get("MEMGUARD_BIN", str(ROOT / "target" / "debug" / "memguard"))


def mutate(pod: Dict[str, Any], profile: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """`memguard mutate` with the image as the policy's sidecar image, classic mode; with
    `profile` (a `MemoryProfile`), as admission reads it from the cluster."""
    with tempfile.TemporaryDirectory(prefix="mg-profile-") as t:
        extra: List[str] = []
        if profile is not None:
            path = Path(t) / "profile.json"
            path.write_text(json.dumps(profile))
            extra = ["--profile", str(path)]
        out = run(
            memguard_bin(), "mutate", "-f", "-", "-o", "json",
            "--sidecar-image", IMAGE, "--sidecar-mode", "classic", *extra,
            input=json.dumps(pod),
        )
    return json.loads(out.stdout)


def explain(pod: Dict[str, Any]) -> Dict[str, Any]:
    """`memguard explain -o json` of `pod` with its status: what the profile controller learns
    from it, and the next admission of its job."""
    out = run(memguard_bin(), "explain", "-f", "-", "-o", "json", input=json.dumps(pod))
    return json.loads(out.stdout)


def for_podman(pod: Dict[str, Any], volume_dir: Path) -> Dict[str, Any]:
    """The differences podman 4.3 needs absorbed (module docstring), and nothing else."""
    pod = json.loads(json.dumps(pod))
    meta = pod["metadata"]
    meta["annotations"] = {k: v for k, v in meta.get("annotations", {}).items() if len(v) <= 63}
    spec = pod["spec"]
    trainer = spec["containers"][0]
    limit = trainer["resources"]["limits"]["memory"]
    for c in spec["containers"]:
        for e in c.get("env", []):
            ref = e.get("valueFrom", {}).get("resourceFieldRef")
            if ref and ref.get("containerName") not in (None, c["name"]):
                e.pop("valueFrom")
                e["value"] = str(quantity_bytes(limit))
    for v in spec.get("volumes", []):
        if "emptyDir" in v:
            d = volume_dir / v["name"]
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o777)
            v.pop("emptyDir")
            v["hostPath"] = {"path": str(d), "type": "Directory"}
    return pod


def quantity_bytes(q: str) -> int:
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi)?", q)
    assert m, q
    return int(m.group(1)) * {None: 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}[m.group(2)]


class Pod:
    """A pod played with `podman kube play`; removed (`podman pod rm -f`) on exit."""

    def __init__(self, manifest: Dict[str, Any], workdir: Path) -> None:
        self.manifest = manifest
        self.name = manifest["metadata"]["name"]
        self.workdir = workdir

    def __enter__(self) -> "Pod":
        podman("pod", "rm", "-f", self.name, check=False)
        path = self.workdir / "pod.json"
        path.write_text(json.dumps(self.manifest))
        # In the pod's own directory: conmon inherits it and drops an `oom` file there when the
        # kernel OOM-kills a container.
        podman("kube", "play", str(path), cwd=self.workdir)
        return self

    def __exit__(self, *exc: object) -> None:
        podman("pod", "rm", "-f", "-t", "0", self.name, check=False)

    def container(self, name: str) -> str:
        return f"{self.name}-{name}"

    def state(self, name: str) -> Dict[str, Any]:
        out = podman("inspect", self.container(name), "--format", "{{json .State}}", check=False)
        return json.loads(out.stdout) if out.returncode == 0 else {}

    def restarts(self, name: str) -> int:
        out = podman("inspect", self.container(name), "--format", "{{.RestartCount}}", check=False)
        return int(out.stdout.strip() or 0)

    def container_id(self, name: str) -> str:
        return podman("inspect", self.container(name), "--format", "{{.Id}}").stdout.strip()

    def logs(self, name: str) -> List[Dict[str, Any]]:
        out = podman("logs", self.container(name), check=False)
        lines = []
        for line in (out.stdout + out.stderr).splitlines():
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
        return lines

    def ip(self) -> str:
        infra = podman("pod", "inspect", self.name, "--format", "{{.InfraContainerID}}").stdout.strip()
        nets = podman("inspect", infra, "--format", "{{json .NetworkSettings.Networks}}").stdout
        return next(n["IPAddress"] for n in json.loads(nets).values() if n.get("IPAddress"))

    def metrics(self, port: int = 9092) -> Optional[str]:
        return http_get(f"http://{self.ip()}:{port}/metrics")


#: No proxy from the environment: the pod's address is on a local bridge.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float = 2) -> Optional[str]:
    try:
        with _OPENER.open(url, timeout=timeout) as r:
            return r.read().decode()
    except (OSError, StopIteration):
        return None


def metric(text: str, name: str, labels: str = "") -> Optional[float]:
    """The value of `name{labels…}` in Prometheus text (labels: a substring of the label set)."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if labels in line:
                return float(line.rsplit(" ", 1)[1])
    return None


def kernel_oom_kills(container_id: str) -> int:
    """OOM kills the kernel logged in the container's memory cgroup (its own record)."""
    out = run("dmesg").stdout
    return sum(1 for line in out.splitlines() if "oom-kill:" in line and container_id in line)


def wait_for(what: str, cond, timeout: float, every: float = 0.2, seen=None):
    """`cond()` once it is truthy; else fails after `timeout`, with `seen()` (what the test can
    tell of the state it waited on) in the message, so a failure in CI says why."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = cond()
        if got:
            return got
        time.sleep(every)
    state = f"; seen: {seen()}" if seen is not None else ""
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}{state}")


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
