"""The harness of the host-memory proofs of issue 39 (bench/host/test_host_proofs.py): local
random-init checkpoints, a real torchrun job in a fresh cgroup v1 memory group with a limit, and
`memguard mutate` on the job's pod manifest. Root only (cgroups, drop_caches)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
BIN = os.environ.get("MEMGUARD_BIN", str(ROOT / "target" / "debug" / "memguard"))
CGROUP_ROOT = Path("/sys/fs/cgroup/memory/memguard-host-proof")
MODELS_DIR = Path(os.environ.get("MEMGUARD_PROOF_MODELS", "/tmp/memguard-proof-models"))
GIB = 1 << 30

# Llama shapes (untied head, vocabulary 32000); the same as bench/host/measure.py's.
SHAPES: Dict[str, dict] = {
    "m150": dict(hidden_size=768, num_hidden_layers=12, intermediate_size=2048, num_attention_heads=12),
    "m400": dict(hidden_size=1024, num_hidden_layers=20, intermediate_size=2816, num_attention_heads=16),
}


def build_config(name: str, vocab: int, **shape) -> Path:
    """A Llama config alone (`config.json`): a model trained from scratch builds its weights."""
    from transformers import LlamaConfig

    path = MODELS_DIR / name
    LlamaConfig(vocab_size=vocab, tie_word_embeddings=False, **shape).save_pretrained(path)
    return path


def build_checkpoint(shape: str, dtype: str) -> Path:
    """A random-init Llama saved by `save_pretrained` as safetensors; built once and reused."""
    path = MODELS_DIR / f"{shape}-{dtype}"
    if (path / "memguard-proof.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if path.exists():
        shutil.rmtree(path)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32000, tie_word_embeddings=False, **SHAPES[shape]))
    model.to(getattr(torch, dtype)).save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    (path / "memguard-proof.json").write_text(json.dumps(dict(params=params, dtype=dtype)))
    return path


@dataclass
class Run:
    """What one job in its own memory cgroup did."""

    returncode: int
    oom_kills: int
    failcnt: int
    peak_bytes: int
    wall_s: float
    markers: List[str]
    anon_by_phase: Dict[str, int]
    output: str

    def ranks_marked(self, name: str) -> int:
        return sum(1 for m in self.markers if m.startswith(f"{name}-"))


class PhaseSampler(threading.Thread):
    """The group's highest anonymous memory (`rss` + `shmem` of memory.stat: what reclaim
    cannot drop, page cache can be) before every rank has loaded (`load`), after (`train`), and
    once a rank is about to save (`save`)."""

    def __init__(self, group: Path, markers: Path, ranks: int):
        super().__init__(daemon=True)
        self.group, self.markers, self.ranks = group, markers, ranks
        self.stop = threading.Event()
        self.anon_by_phase: Dict[str, int] = {"load": 0, "train": 0, "save": 0}

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                stat = dict(line.split() for line in (self.group / "memory.stat").read_text().splitlines())
                anon = int(stat["rss"]) + int(stat["shmem"])
                names = [p.name for p in self.markers.iterdir()]
                loaded = sum(1 for n in names if n.startswith("loaded-"))
                saving = any(n.startswith("saving-") for n in names)
                phase = "save" if saving else "train" if loaded >= self.ranks else "load"
                self.anon_by_phase[phase] = max(self.anon_by_phase[phase], anon)
            except (OSError, KeyError, ValueError):
                pass  # the group is being torn down
            self.stop.wait(0.05)


def require_root() -> None:
    """The proofs need fresh memory cgroups and drop_caches: without root they fail, saying so."""
    assert os.geteuid() == 0, "the host-memory proofs need root (cgroup v1 memory groups, drop_caches)"
    assert Path("/sys/fs/cgroup/memory/cgroup.procs").exists(), "no cgroup v1 memory controller at /sys/fs/cgroup/memory"
    assert Path(BIN).is_file(), f"no memguard binary at {BIN}: cargo build -p memguard, or set MEMGUARD_BIN"


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def warm_caches(paths: List[Path]) -> None:
    """Reads `paths` (files, or every file below a folder) and imports the training libraries,
    from this process's group: their pages are then in the page cache, charged here, not in a
    group started after."""
    for path in paths:
        for f in ([path] if path.is_file() else sorted(q for q in path.rglob("*") if q.is_file())):
            with open(f, "rb") as fh:
                while fh.read(1 << 24):
                    pass
    subprocess.run([sys.executable, "-c", "import torch, transformers, peft, accelerate"], check=True, timeout=300)


def run_in_cgroup(name: str, limit_bytes: int, argv: List[str], cwd: Path, ranks: int = 2, env: Optional[dict] = None, timeout: float = 300, warm: Optional[List[Path]] = None) -> Run:
    """Runs `argv` as every process of a fresh memory group limited to `limit_bytes`, as a
    container's processes under `limits.memory`: the shell joins the group, then execs.

    Cold by default: the checkpoint's and the libraries' pages are read, and charged, inside
    the group. `warm` (the checkpoint): those pages are read first, outside it. A run meant to
    be killed needs that: cold, the kernel (cgroup v1) can spend minutes reclaiming at the
    limit without killing, since each reclaim frees a few code pages that the next fault reads
    back (measured: 100 s at the limit, about 150 major faults a second, no kill; warm, the
    kill came in 6 to 7 s, 4 runs in 4)."""
    group = CGROUP_ROOT / name
    if group.exists():
        group.rmdir()
    group.mkdir(parents=True)
    (group / "memory.limit_in_bytes").write_text(f"{limit_bytes}\n")
    markers = Path(tempfile.mkdtemp(prefix=f"memguard-proof-{name}-"))
    full_env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
                    MEMGUARD_PROOF_MARKERS=str(markers), **(env or {}))
    if warm is None:
        # Cold, as a container that has just started.
        drop_caches()
    else:
        warm_caches(warm)
    launcher = ["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$@"', "launcher", *argv]
    sampler = PhaseSampler(group, markers, ranks)
    sampler.start()
    start = time.time()
    proc = subprocess.run(launcher, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    wall = time.time() - start
    sampler.stop.set()
    sampler.join()
    oom = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    run = Run(
        returncode=proc.returncode,
        oom_kills=int(oom.get("oom_kill", 0)),
        failcnt=int((group / "memory.failcnt").read_text()),
        peak_bytes=int((group / "memory.max_usage_in_bytes").read_text()),
        wall_s=round(wall, 1),
        markers=sorted(p.name for p in markers.iterdir()),
        anon_by_phase=sampler.anon_by_phase,
        output=proc.stdout[-20000:] + proc.stderr[-20000:],
    )
    shutil.rmtree(markers, ignore_errors=True)
    for _ in range(50):
        try:
            group.rmdir()
            break
        except OSError:
            time.sleep(0.1)
    return run


def pod_manifest(command: List[str], args: List[str], limit: str, annotations: Dict[str, str], gpus: int) -> str:
    notes = "".join(f"\n    {k}: {json.dumps(v)}" for k, v in annotations.items())
    return f"""apiVersion: v1
kind: Pod
metadata:
  name: proof
  namespace: ml
  labels: {{memguard.io/enabled: "true"}}
  annotations:{notes}
spec:
  restartPolicy: Never
  containers:
    - name: trainer
      image: trainer
      command: {json.dumps(command)}
      args: {json.dumps(args)}
      resources: {{limits: {{nvidia.com/gpu: "{gpus}", memory: {limit}}}}}
"""


def yaml_of(pod: dict) -> str:
    """A pod as a manifest `memguard mutate` reads (JSON is YAML)."""
    return json.dumps(pod)


def mutate(manifest: str) -> dict:
    """The pod as `memguard mutate` admits it."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d, "pod.yaml")
        path.write_text(manifest)
        out = subprocess.run([BIN, "mutate", "-o", "json", "-f", str(path)], check=True, capture_output=True, text=True)
    return json.loads(out.stdout)


def host_of(pod: dict) -> dict:
    return json.loads(pod["metadata"]["annotations"]["memguard.io/estimate"])["host"]


def quantity_bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(float(quantity[: -len(suffix)]) * factor)
    return int(quantity)


def torchrun(ranks: int, script: str) -> List[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", script]


def words(container: dict) -> List[str]:
    return list(container.get("command", [])) + list(container.get("args", []))


def describe(run: Run) -> str:
    return (f"rc {run.returncode}, oom_kill {run.oom_kills}, failcnt {run.failcnt}, peak {run.peak_bytes / GIB:.3f} GiB, "
            f"{run.wall_s} s, markers {run.markers}, anon GiB {({k: round(v / GIB, 3) for k, v in run.anon_by_phase.items()})}\n{run.output}")

