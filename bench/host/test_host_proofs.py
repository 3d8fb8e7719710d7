"""Issue 39's done-when, proved on real jobs in real memory cgroups (root; cgroup v1 at
/sys/fs/cgroup/memory):

* a 2-rank torchrun job OOM-killed while its ranks load the weights is admitted by `memguard
  mutate` with a memory figure at which it loads and then trains;
* a job killed while it saves its checkpoint survives the save as admitted.

Each job is the pod's own launch: the words `memguard mutate` admits are the words run, in a
fresh memory group limited to the pod's `limits.memory`, as a container's processes are. The
measured numbers are in docs/host-memory.md ("The proofs")."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proof  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "proof_train.py"
GIB = proof.GIB

# The checkpoint's shape, as the pod's annotations say it (m400: 322M parameters).
M400 = {
    "memguard.io/hidden-size": "1024",
    "memguard.io/num-layers": "20",
    "memguard.io/intermediate-size": "2816",
    "memguard.io/num-heads": "16",
    "memguard.io/vocab-size": "32000",
    "memguard.io/untied-head": "true",
}


def sigkilled_rank(run: proof.Run) -> bool:
    """torchrun's report of a rank that the kernel killed (`exitcode : -9`)."""
    return re.search(r"exitcode\s*:\s*-9\b", run.output) is not None


def admitted_limit(pod: dict) -> str:
    """The memory figure of admission's error (`set limits.memory ≥ 3Gi`)."""
    error = pod["metadata"]["annotations"]["memguard.io/error"]
    found = re.search(r"set limits\.memory ≥ (\d+(?:Gi|Mi))", error)
    assert found, error
    return found.group(1)


def test_a_job_killed_at_load_is_admitted_with_a_memory_figure_at_which_it_loads_and_trains(tmp_path):
    proof.require_root()
    # A bf16 checkpoint loaded in fp32 on 2 ranks: each rank converts it into its own fp32
    # copy (anonymous memory), which is what kills the pod at load. LoRA on the frozen base:
    # the training step itself adds little. A limit far under the load's need.
    checkpoint_bf16 = proof.build_checkpoint("m400", "bfloat16")
    command = ["torchrun", "--standalone", "--nproc_per_node", "2", str(SCRIPT)]
    args = ["--model_name_or_path", str(checkpoint_bf16), "--dtype", "float32", "--lora", "true",
            "--output_dir", str(tmp_path / "out"), "--per_device_train_batch_size", "1",
            "--gradient_accumulation_steps", "1", "--max_steps", "3", "--max_seq_length", "64",
            "--save_strategy", "no", "--dataloader_num_workers", "0", "--dataloader_pin_memory", "false",
            "--report_to", "none", "--use_cpu", "true"]
    limit = "2Gi"

    # Warm: killed by the kernel in seconds, not left reclaiming at the limit (proof.py).
    killed = proof.run_in_cgroup("load-killed", proof.quantity_bytes(limit), command + args, cwd=tmp_path,
                                 warm=[checkpoint_bf16])
    why = proof.describe(killed)
    assert killed.returncode != 0 and killed.oom_kills >= 1, why
    assert sigkilled_rank(killed), why
    # Killed inside from_pretrained: both ranks had started loading, neither had finished.
    assert killed.ranks_marked("loading") == 2 and killed.ranks_marked("loaded") == 0, why

    annotations = dict(M400, **{"memguard.io/method": "lora", "memguard.io/gpu-memory": "24GiB"})
    pod = proof.mutate(proof.pod_manifest(command, args, limit, annotations, gpus=2))
    host = proof.host_of(pod)
    assert host["fits"] is False and host["phase"] == "load", host
    assert host["ranks"] == 2 and host["sources"]["load-dtype"] == "args", host
    figure = admitted_limit(pod)
    assert proof.quantity_bytes(figure) > proof.quantity_bytes(limit)
    container = pod["spec"]["containers"][0]
    # Nothing the plan could rewrite brings it in: the launch is left as it is. The fp32 load
    # dtype is named as the user's choice, never rewritten (it is what trains).
    assert proof.words(container) == command + args
    error = pod["metadata"]["annotations"]["memguard.io/error"]
    assert "--dtype bfloat16" in error and "changes numerics" in error, error

    shutil.rmtree(tmp_path / "out", ignore_errors=True)
    admitted = proof.run_in_cgroup("load-admitted", proof.quantity_bytes(figure), proof.words(container), cwd=tmp_path)
    why = proof.describe(admitted)
    assert admitted.returncode == 0 and admitted.oom_kills == 0, why
    assert admitted.ranks_marked("loaded") == 2 and admitted.ranks_marked("trained") == 2, why
    print(f"\nload proof: killed at {limit} ({killed.wall_s} s, anon {killed.anon_by_phase['load'] / GIB:.3f} GiB); "
          f"admitted {figure}: estimate {host['bytes'] / GIB:.3f}-{host['most'] / GIB:.3f} GiB; "
          f"as admitted anon load {admitted.anon_by_phase['load'] / GIB:.3f} GiB, train {admitted.anon_by_phase['train'] / GIB:.3f} GiB, "
          f"peak {admitted.peak_bytes / GIB:.3f} GiB ({admitted.wall_s} s)")


# A Llama trained from scratch (its config alone): 221M parameters, a small vocabulary, so that
# the state an FSDP full save gathers, not the training step's transients, is the host peak.
S220_SHAPE = dict(hidden_size=1024, num_hidden_layers=16, intermediate_size=2816, num_attention_heads=16)
S220 = {
    "memguard.io/hidden-size": "1024",
    "memguard.io/num-layers": "16",
    "memguard.io/intermediate-size": "2816",
    "memguard.io/num-heads": "16",
    "memguard.io/vocab-size": "8000",
    "memguard.io/untied-head": "true",
}
FSDP_SAVE_SCRIPT = Path(__file__).resolve().parent / "proof_fsdp_save.py"


def test_a_job_killed_at_its_full_fsdp_save_survives_it_as_admitted(tmp_path):
    proof.require_root()
    # 2 ranks, FSDP2 over gloo, AdamW; at its last step it saves a full state dict, gathered on
    # rank 0's host with the optimizer's state (FULL_STATE_DICT, --save_only_model false).
    config = proof.build_config("s220", 8000, **S220_SHAPE)
    out = tmp_path / "out"
    command = ["torchrun", "--standalone", "--nproc_per_node", "2", str(FSDP_SAVE_SCRIPT)]
    args = ["--model_name_or_path", str(config), "--output_dir", str(out),
            "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
            "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2", "--max_seq_length", "64",
            "--fsdp", "full_shard", "--fsdp_config", json.dumps({"state_dict_type": "FULL_STATE_DICT"}),
            "--save_only_model", "false", "--dataloader_num_workers", "0", "--dataloader_pin_memory", "false",
            "--report_to", "none", "--use_cpu", "true"]
    limit = "6600Mi"

    killed = proof.run_in_cgroup("save-killed", proof.quantity_bytes(limit), command + args, cwd=tmp_path)
    why = proof.describe(killed)
    assert killed.returncode != 0 and killed.oom_kills >= 1, why
    assert sigkilled_rank(killed), why
    # Killed saving: both ranks had stepped and begun the save, neither finished it.
    assert killed.ranks_marked("stepped") == 2 and killed.ranks_marked("saving") == 2, why
    assert killed.ranks_marked("saved") == 0, why

    annotations = dict(S220, **{"memguard.io/method": "full", "memguard.io/gpu-memory": "80GiB"})
    pod = proof.mutate(proof.pod_manifest(command, args, limit, annotations, gpus=2))
    assert "memguard.io/error" not in pod["metadata"]["annotations"]
    host = proof.host_of(pod)
    # The state dict type read from --fsdp_config; the cheapest rewrite that fits: model only.
    assert host["rewritten"]["save"]["from"] == "false" and host["rewritten"]["save"]["to"] == "true", host
    assert host["fits"] is True and host["phase"] == "save", host
    container = pod["spec"]["containers"][0]
    admitted_words = proof.words(container)
    assert admitted_words[admitted_words.index("--save_only_model") + 1] == "true"
    # Admitted again (a controller re-creating the pod), it keeps the same plan.
    again = proof.mutate(proof.yaml_of(pod))
    assert proof.words(again["spec"]["containers"][0]) == admitted_words
    assert proof.host_of(again)["rewritten"] == host["rewritten"]

    shutil.rmtree(out, ignore_errors=True)
    admitted = proof.run_in_cgroup("save-admitted", proof.quantity_bytes(limit), admitted_words, cwd=tmp_path)
    why = proof.describe(admitted)
    assert admitted.returncode == 0 and admitted.oom_kills == 0, why
    assert admitted.ranks_marked("saved") == 2 and admitted.ranks_marked("trained") == 2, why
    checkpoint = out / "checkpoint-2" / "checkpoint.pt"
    assert checkpoint.is_file(), why
    # The model's fp32 weights, nothing of the optimizer: 221M parameters x 4 bytes.
    assert 0.85e9 < checkpoint.stat().st_size < 0.95e9, checkpoint.stat().st_size
    print(f"\nsave proof: killed at {limit} ({killed.wall_s} s, anon at save {killed.anon_by_phase['save'] / GIB:.3f} GiB); "
          f"admitted --save_only_model true: estimate {host['bytes'] / GIB:.3f}-{host['most'] / GIB:.3f} GiB; "
          f"as admitted anon train {admitted.anon_by_phase['train'] / GIB:.3f} GiB, save {admitted.anon_by_phase['save'] / GIB:.3f} GiB, "
          f"peak {admitted.peak_bytes / GIB:.3f} GiB ({admitted.wall_s} s); checkpoint {checkpoint.stat().st_size / GIB:.3f} GiB")
