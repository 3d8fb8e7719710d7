"""Issue 39's done-when, proved on real jobs in real memory cgroups (root; cgroup v1 at
/sys/fs/cgroup/memory):

* a 2-rank torchrun job OOM-killed while its ranks load the weights is admitted by `memguard
  mutate` with a memory figure at which it loads and then trains;
* a job killed while it saves its checkpoint survives the save as admitted.

Each job is the pod's own launch: the words `memguard mutate` admits are the words run, in a
fresh memory group limited to the pod's `limits.memory`, as a container's processes are. The
measured numbers are in docs/host-memory.md ("The proofs")."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proof  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "proof_train.py"
GIB = proof.GIB

# The checkpoint's shape, as the pod's annotations say it (m150: 134M parameters).
M150 = {
    "memguard.io/hidden-size": "768",
    "memguard.io/num-layers": "12",
    "memguard.io/intermediate-size": "2048",
    "memguard.io/num-heads": "12",
    "memguard.io/vocab-size": "32000",
    "memguard.io/untied-head": "true",
}


@pytest.fixture(scope="module")
def checkpoint_bf16() -> Path:
    return proof.build_checkpoint("m150", "bfloat16")


def sigkilled_rank(run: proof.Run) -> bool:
    """torchrun's report of a rank that the kernel killed (`exitcode : -9`)."""
    return re.search(r"exitcode\s*:\s*-9\b", run.output) is not None


def admitted_limit(pod: dict) -> str:
    """The memory figure of admission's error (`set limits.memory ≥ 3Gi`)."""
    error = pod["metadata"]["annotations"]["memguard.io/error"]
    found = re.search(r"set limits\.memory ≥ (\d+(?:Gi|Mi))", error)
    assert found, error
    return found.group(1)


def test_a_job_killed_at_load_is_admitted_with_a_memory_figure_at_which_it_loads_and_trains(checkpoint_bf16, tmp_path):
    # A bf16 checkpoint loaded in fp32 on 2 ranks: each rank converts it into its own fp32
    # copy (anonymous memory), which is what kills the pod at load. LoRA on the frozen base:
    # the training step itself adds little.
    command = ["torchrun", "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
    args = ["--model_name_or_path", str(checkpoint_bf16), "--dtype", "float32", "--lora", "true",
            "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "1",
            "--gradient_accumulation_steps", "1", "--max_steps", "3", "--max_seq_length", "64",
            "--save_strategy", "no", "--dataloader_num_workers", "0", "--dataloader_pin_memory", "false",
            "--report_to", "none", "--use_cpu", "true"]
    limit = "1600Mi"

    killed = proof.run_in_cgroup("load-killed", proof.quantity_bytes(limit), command + args, cwd=tmp_path)
    why = proof.describe(killed)
    assert killed.returncode != 0 and killed.oom_kills >= 1, why
    assert sigkilled_rank(killed), why
    # Killed inside from_pretrained: both ranks had started loading, neither had finished.
    assert killed.ranks_marked("loading") == 2 and killed.ranks_marked("loaded") == 0, why

    annotations = dict(M150, **{"memguard.io/method": "lora", "memguard.io/gpu-memory": "24GiB"})
    pod = proof.mutate(proof.pod_manifest(command, args, limit, annotations, gpus=2))
    host = proof.host_of(pod)
    assert host["fits"] is False and host["phase"] == "load", host
    assert host["ranks"] == 2 and host["sources"]["load-dtype"] == "args", host
    figure = admitted_limit(pod)
    assert proof.quantity_bytes(figure) > proof.quantity_bytes(limit)
    container = pod["spec"]["containers"][0]
    # Nothing the plan could rewrite brings it in: the launch is left as it is.
    assert proof.words(container) == command + args

    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    admitted = proof.run_in_cgroup("load-admitted", proof.quantity_bytes(figure), proof.words(container), cwd=tmp_path)
    why = proof.describe(admitted)
    assert admitted.returncode == 0 and admitted.oom_kills == 0, why
    assert admitted.ranks_marked("loaded") == 2 and admitted.ranks_marked("trained") == 2, why
    print(f"\nload proof: killed at {limit} ({killed.wall_s} s, anon {killed.anon_by_phase['load'] / GIB:.3f} GiB); "
          f"admitted {figure}: estimate {host['bytes'] / GIB:.3f}-{host['most'] / GIB:.3f} GiB; "
          f"as admitted anon load {admitted.anon_by_phase['load'] / GIB:.3f} GiB, train {admitted.anon_by_phase['train'] / GIB:.3f} GiB, "
          f"peak {admitted.peak_bytes / GIB:.3f} GiB ({admitted.wall_s} s)")
