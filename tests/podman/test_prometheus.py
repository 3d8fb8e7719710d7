"""A real Prometheus (Debian's `prometheus`, on loopback) scrapes a running memguard pod's sidecar
and the webhook, run as a container from the image, with the chart's own alerting rules loaded.

- The webhook: `memguard-webhook` from the image, uid 65532, read-only root filesystem, no
  capabilities, serving TLS with a CA and a certificate made here by `openssl`. An
  AdmissionReview POSTed from the host comes back with the pod's mutation, and that patch is the
  pod that is played.
- The pod: the survival run (`SHAPE=grow`): the trainer's held memory grows toward its limit,
  the sidecar downgrades, the trainer applies it and finishes.
- The downgrade alert (`MemguardTrainerRepeatedDowngrades`, rendered with a 20 s window, a 2 s
  `for` and a threshold of 1) goes pending, fires, and resolves once the run is over, read from
  `/api/v1/alerts` and `/api/v1/rules`.
- Every PromQL expression of the chart's Grafana dashboard returns data over the run, except the
  GPU panels (no GPU here; docs/podman.md).

Test intervals, not the defaults: scrape and rule evaluation every 1 s.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from harness import (
    CI,
    IMAGE,
    ROOT,
    Pod,
    ensure_image,
    ensure_trainer_base,
    for_podman,
    missing_runtime,
    podman,
    read_jsonl,
    run,
    wait_for,
)
from test_pods import trainer_pod

HELM = Path(os.environ.get("MEMGUARD_TOOLS", Path.home() / ".cache/memguard-tools")) / "bin/helm"
WEBHOOK = "mgtest-webhook"
NAMESPACE = "mgtest"
POD = "mgtest-survival"
#: Panels that can only have data on a node with an NVIDIA GPU (NVML).
GPU_ONLY = ("memguard_sidecar_gpu_memory_used_bytes", "memguard_sidecar_gpu_memory_total_bytes")
#: Grafana's `$__rate_interval` for a 1 s scrape: 4 × the scrape interval.
RATE_INTERVAL = "4s"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def missing() -> str | None:
    why = missing_runtime()
    if why:
        return why
    for tool in ("prometheus", "openssl"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/install-deps.sh installs it)"
    if not HELM.exists():
        return f"no helm at {HELM} (scripts/install-helm.sh installs it)"
    return None


@pytest.fixture(scope="module")
def tmp() -> Iterator[Path]:
    why = missing()
    if why:
        if CI:
            pytest.fail(f"the Prometheus pod test cannot run under CI=true: {why}")
        pytest.skip(why)
    ensure_image()
    ensure_trainer_base()
    with tempfile.TemporaryDirectory(prefix="mg-prom-") as t:
        path = Path(t)
        path.chmod(0o755)
        yield path


def rules_file(tmp: Path) -> Path:
    """The chart's PrometheusRule, rendered by helm, as a plain rules file."""
    out = run(
        str(HELM), "template", "mg", str(ROOT / "charts/memguard"), "-n", "memguard",
        "--show-only", "templates/prometheusrule.yaml",
        "--set", "monitoring.serviceMonitor.enabled=true",
        "--set", "monitoring.prometheusRule.enabled=true",
        "--set", f"monitoring.prometheusRule.webhookJob={WEBHOOK}",
        "--set", "monitoring.prometheusRule.downgradesPerHour=1",
        "--set", "monitoring.prometheusRule.downgradesWindow=20s",
        "--set", "monitoring.prometheusRule.downgradesFor=2s",
    ).stdout
    import yaml  # PyYAML: Debian's python3-yaml

    rule = yaml.safe_load(out)
    assert rule["kind"] == "PrometheusRule", rule
    path = tmp / "rules.yaml"
    path.write_text(json.dumps({"groups": rule["spec"]["groups"]}))
    run("promtool", "check", "rules", str(path))
    return path


def certificates(tmp: Path) -> Path:
    """A CA and a serving certificate for 127.0.0.1/localhost, made now."""
    d = tmp / "tls"
    d.mkdir()
    run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", str(d / "ca.key"), "-out", str(d / "ca.crt"), "-days", "2", "-subj", "/CN=mgtest-ca")
    run("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
        "-keyout", str(d / "tls.key"), "-out", str(d / "tls.csr"), "-subj", "/CN=localhost")
    ext = d / "ext.cnf"
    ext.write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    run("openssl", "x509", "-req", "-in", str(d / "tls.csr"), "-CA", str(d / "ca.crt"),
        "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-out", str(d / "tls.crt"), "-days", "2",
        "-extfile", str(ext))
    for f in ("tls.crt", "tls.key", "ca.crt"):
        (d / f).chmod(0o644)  # read by uid 65532 in the container
    d.chmod(0o755)
    return d


class Webhook:
    """`memguard-webhook` from the image: uid 65532, read-only root, no capabilities."""

    def __init__(self, tls: Path) -> None:
        self.tls = tls
        self.https = free_port()
        self.metrics = free_port()

    def __enter__(self) -> "Webhook":
        podman("rm", "-f", "-t", "0", WEBHOOK, check=False)
        podman(
            "run", "-d", "--name", WEBHOOK, "--read-only", "--user", "65532:65532",
            "--cap-drop", "all", "--security-opt", "no-new-privileges",
            "-v", f"{self.tls}:/tls:ro",
            "-p", f"127.0.0.1:{self.https}:8443", "-p", f"127.0.0.1:{self.metrics}:9090",
            "--entrypoint", "memguard-webhook", IMAGE,
            "--tls-cert-file", "/tls/tls.crt", "--tls-key-file", "/tls/tls.key", "--no-kube",
            "--sidecar-image", IMAGE, "--sidecar-mode", "classic",
        )
        return self

    def __exit__(self, *exc: object) -> None:
        podman("rm", "-f", "-t", "0", WEBHOOK, check=False)

    def review(self, pod: Dict[str, Any]) -> Dict[str, Any]:
        body = {
            "apiVersion": "admission.k8s.io/v1",
            "kind": "AdmissionReview",
            "request": {
                "uid": "0b1c2d3e-mgtest",
                "kind": {"group": "", "version": "v1", "kind": "Pod"},
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "namespace": NAMESPACE,
                "operation": "CREATE",
                "userInfo": {"username": "system:serviceaccount:mgtest:trainer"},
                "object": pod,
            },
        }
        ctx = ssl.create_default_context(cafile=str(self.tls / "ca.crt"))
        req = urllib.request.Request(
            f"https://localhost:{self.https}/mutate",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ctx))
        with opener.open(req, timeout=10) as r:
            return json.loads(r.read())


def apply_patch(doc: Any, patch: List[Dict[str, Any]]) -> Any:
    """RFC 6902 `add`, `replace`, `remove` (what the webhook writes)."""
    doc = json.loads(json.dumps(doc))
    for op in patch:
        *parents, last = [urllib.parse.unquote(t).replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
        node = doc
        for t in parents:
            node = node[int(t)] if isinstance(node, list) else node[t]
        if isinstance(node, list):
            i = len(node) if last == "-" else int(last)
            if op["op"] == "add":
                node.insert(i, op["value"])
            elif op["op"] == "replace":
                node[i] = op["value"]
            else:
                del node[i]
        elif op["op"] in ("add", "replace"):
            node[last] = op["value"]
        else:
            del node[last]
    return doc


class Prometheus:
    """Debian's prometheus on loopback, scraping every second; killed on exit."""

    def __init__(self, tmp: Path, rules: Path, webhook_metrics: int) -> None:
        self.port = free_port()
        self.tmp = tmp
        self.targets = tmp / "sidecars.json"
        self.targets.write_text("[]")
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(rules)],
            "scrape_configs": [
                {
                    "job_name": WEBHOOK,
                    "static_configs": [{"targets": [f"127.0.0.1:{webhook_metrics}"],
                                        "labels": {"namespace": "memguard", "pod": WEBHOOK}}],
                },
                {
                    "job_name": "memguard-sidecar",
                    "file_sd_configs": [{"files": [str(self.targets)], "refresh_interval": "1s"}],
                },
            ],
        }
        (tmp / "prometheus.yml").write_text(json.dumps(config))

    def __enter__(self) -> "Prometheus":
        self.log = open(self.tmp / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={self.tmp / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        wait_for("prometheus to be ready", lambda: self.get("/-/ready", raw=True), timeout=30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()

    def get(self, path: str, raw: bool = False, **params: Any) -> Any:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        try:
            with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=5) as r:
                body = r.read().decode()
        except OSError:
            return None
        return body if raw else json.loads(body)["data"]

    def scrape(self, address: str, labels: Dict[str, str]) -> None:
        self.targets.write_text(json.dumps([{"targets": [address], "labels": labels}]))

    def alert_state(self, name: str) -> str:
        alerts = self.get("/api/v1/alerts") or {"alerts": []}
        states = {a["state"] for a in alerts["alerts"] if a["labels"]["alertname"] == name}
        return "firing" if "firing" in states else "pending" if "pending" in states else "inactive"

    def rule_state(self, name: str) -> str:
        groups = (self.get("/api/v1/rules") or {"groups": []})["groups"]
        return next(r["state"] for g in groups for r in g["rules"] if r.get("name") == name)


def dashboard_expressions() -> List[str]:
    dash = json.loads((ROOT / "charts/memguard/files/dashboard.json").read_text())

    def panels(p):
        for x in p.get("panels", []):
            yield x
            yield from panels(x)

    return [t["expr"] for p in panels(dash) for t in p.get("targets", []) if t.get("expr")]


def dashboard_variables() -> List[Tuple[str, str]]:
    """The (series selector, label) of each `label_values(…)` variable of the dashboard."""
    dash = json.loads((ROOT / "charts/memguard/files/dashboard.json").read_text())
    out = []
    for v in dash["templating"]["list"]:
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q or "")
        if m:
            out.append((m.group(1), m.group(2)))
    assert out, "the dashboard's namespace and pod variables"
    return out


def test_prometheus_fires_the_downgrade_alert_from_a_real_pod_and_the_dashboard_has_data(tmp):
    rules = rules_file(tmp)
    logdir = tmp / "log"
    logdir.mkdir(mode=0o777)
    logdir.chmod(0o777)
    # Grows 24 MiB a step to 720 MiB held; a step at the webhook's batch 8 holds 8 × 32 MiB
    # more, over the downgrade threshold (0.85 of 1 GiB) late in the run; at batch 4 it fits.
    env = {"SHAPE": "grow", "GROW_MIB": "24", "PER_SAMPLE_MIB": "32", "STEPS": "30", "STEP_SECONDS": "0.5"}
    pod = trainer_pod(POD, {"runAsUser": 1000, "runAsGroup": 1000}, env, logdir)
    pod["spec"]["restartPolicy"] = "Never"
    with Webhook(certificates(tmp)) as webhook, Prometheus(tmp, rules, webhook.metrics) as prom:
        review = wait_for("the webhook to answer over TLS", lambda: _try(webhook.review, pod), timeout=30)
        response = review["response"]
        assert response["allowed"] and response["uid"] == "0b1c2d3e-mgtest", response
        patch = json.loads(base64.b64decode(response["patch"]))
        mutated = apply_patch(pod, patch)
        sidecar = next(c for c in mutated["spec"]["containers"] if c["name"] == "memguard-sidecar")
        assert sidecar["image"] == IMAGE
        assert {"name": "MEMGUARD_SIDECAR_POD_RESTART_POLICY", "value": "Never"} in sidecar["env"]
        wait_for("the webhook's target to be up", lambda: _up(prom, WEBHOOK), timeout=30)
        started = time.time()
        seen = set()
        with Pod(for_podman(mutated, tmp), tmp) as p:
            prom.scrape(f"{p.ip()}:9092", {"namespace": NAMESPACE, "pod": POD})
            trainer_log = logdir / "trainer.jsonl"

            last_review = [0.0]

            def run_over() -> bool:
                seen.add(prom.alert_state("MemguardTrainerRepeatedDowngrades"))
                # Admission traffic during the run, one review a second, for the webhook's
                # rate and latency panels (a rate needs two scrapes with a change between).
                if time.monotonic() - last_review[0] >= 1:
                    last_review[0] = time.monotonic()
                    assert webhook.review(pod)["response"]["allowed"]
                return any(e["event"] == "done" for e in read_jsonl(trainer_log)) or p.state("train").get("Status") == "exited"

            wait_for("the trainer to finish", run_over, timeout=120, every=0.25)
            wait_for("the downgrade alert to fire",
                     lambda: seen.add(s := prom.alert_state("MemguardTrainerRepeatedDowngrades")) or s == "firing",
                     timeout=30, every=0.25)
            ended = time.time()
            trainer = read_jsonl(trainer_log)
            dashboard = {e: prom.get("/api/v1/query_range", query=_grafana(e), start=started, end=ended, step=1)
                         for e in dashboard_expressions()}
            variables = {
                f"label_values({sel}, {label})": prom.get(
                    f"/api/v1/label/{label}/values", **{"match[]": _grafana(sel), "start": started, "end": ended})
                for sel, label in dashboard_variables()
            }
            webhook_down = prom.rule_state("MemguardWebhookDown")
            wait_for("the sidecar to exit", lambda: p.state("memguard-sidecar").get("Status") == "exited", timeout=30)
        resolved = wait_for("the downgrade alert to resolve",
                            lambda: prom.rule_state("MemguardTrainerRepeatedDowngrades") == "inactive",
                            timeout=60, every=0.5)
    steps = [e for e in trainer if e["event"] == "step"]
    assert steps and steps[0]["batch"] == 8 and steps[-1]["batch"] < 8, "the sidecar downgraded the run"
    assert any(e["event"] == "done" for e in trainer), "the guarded run survived"
    assert {"pending", "firing"} <= seen, seen
    assert resolved
    assert webhook_down == "inactive", "the webhook is scraped healthy"
    empty = [e for e, data in dashboard.items() if not _has_data(data) and not any(g in e for g in GPU_ONLY)]
    assert not empty, f"dashboard expressions with no data: {empty}"
    no_values = {q: got for q, got in variables.items() if got not in ([NAMESPACE], [POD])}
    assert not no_values, f"dashboard variables without the pod's namespace/pod: {no_values}"


def _try(f, *a):
    """None while the server is not up yet; an HTTP error is an answer and fails the test."""
    try:
        return f(*a)
    except urllib.error.HTTPError as e:
        raise AssertionError(f"HTTP {e.code}: {e.read()[:500]!r}") from e
    except OSError:
        return None


def _up(prom: Prometheus, job: str) -> bool:
    r = prom.get("/api/v1/query", query=f'up{{job="{job}"}} == 1')
    return bool(r and r["result"])


def _grafana(expr: str) -> str:
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$namespace", ".*").replace("$pod", ".*")


def _has_data(data: Any) -> bool:
    return bool(data) and any(
        v[1] not in ("NaN", "+Inf", "-Inf") for series in data["result"] for v in series["values"]
    )
