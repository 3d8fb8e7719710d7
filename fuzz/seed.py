#!/usr/bin/env python3
"""Seeds fuzz/corpus/<target>/ from the repository's fixtures (and, for the cgroup target, from
this machine's real cgroup, PSI and /proc files). Idempotent: a seed is named by the hash of its
content, as libFuzzer names the inputs it adds, so re-running adds nothing twice."""
import glob
import hashlib
import json
import os
import sys

import yaml

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
corpus = os.path.join(root, "fuzz", "corpus")


def add(target, data):
    if isinstance(data, str):
        data = data.encode()
    d = os.path.join(corpus, target)
    os.makedirs(d, exist_ok=True)
    path = os.path.join(d, hashlib.sha1(data).hexdigest())
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(data)


def review(pod, operation="CREATE"):
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": "", "version": "v1", "kind": "Pod"},
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "name": pod.get("metadata", {}).get("name", "p"),
            "namespace": "ml",
            "operation": operation,
            "userInfo": {"username": "alice"},
            "object": pod,
            "dryRun": False,
        },
    }


pods = []
for path in sorted(glob.glob(os.path.join(root, "webhook/tests/fixtures/pods/*.yaml"))):
    with open(path) as f:
        pods.append(yaml.safe_load(f))

for pod in pods:
    ann = pod.get("metadata", {}).get("annotations") or {}
    if ann:
        add("annotations", "".join(f"{k}={v}\n" for k, v in ann.items()))
    add("admission_review", json.dumps(review(pod)))
    add("admission_review", json.dumps(review(pod), indent=1))
add("admission_review", json.dumps(review(pods[0], "UPDATE")))
add("admission_review", json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}))
add("annotations", "model=llama-3-8b\nmethod=qlora\nlora-rank=64\nbatch-size=0\n")
add("annotations", "model-params=7B\nhidden-size=4096\nnum-layers=32\nnum-heads=32\nvocab-size=32000\n")
add("annotations", "model=mixtral-8x7b\nparallelism=fsdp\nworld-size=8\ngpu-memory=80Gi\nsafety-ratio=0.85\n")
add("annotations", "model=llama-3-8b\noptimizer=adamw-8bit\ngrad-checkpointing=true\nflash-attention=false\n")

for q in ["64Gi", "500M", "1e9", "128974848", "2", "100m", "1.5Ti", "24GiB", "7B", "125M", "100ms",
          "2s", "1m", "30", "true", "off", "0.5", "9223372036854775807", "1E3", "+5"]:
    add("quantities", q)

for path in [os.path.join(root, "webhook/tests/fixtures/policy.yaml")] + sorted(
        glob.glob(os.path.join(root, "charts/memguard/ci/*.yaml"))):
    with open(path) as f:
        text = f.read()
    if path.endswith("policy.yaml"):
        add("policy", text)
        spec = yaml.safe_load(text)
        add("policy", json.dumps(spec))
        add("policy", yaml.safe_dump({"apiVersion": "training.memguard.io/v1alpha1", "kind": "MemguardPolicy",
                                      "metadata": {"name": "default"}, "spec": spec}))
# A policy that adds models (spec.models, each a config.json), and pods naming them.
with open(os.path.join(root, "webhook/tests/fixtures/policy-models.yaml")) as f:
    add("policy", f.read())
add("annotations", "model=acme-coder-7b\nmethod=lora\n")
add("annotations", "model=Qwen/Qwen2.5-Coder-7B-Instruct-GPTQ-Int4\nmethod=qlora\nmodel-bits=8\n")
add("policy", "safetyRatio: 0.8\nthresholds:\n  warn: 0.7\n  downgrade: 0.8\n  critical: 0.9\n")
add("policy", "kind: ConfigMap\napiVersion: v1\n")

files = ["/proc/self/status", "/proc/self/cgroup", "/proc/pressure/memory", "/proc/pressure/io",
         "/proc/pressure/cpu", "/proc/1/cgroup"]
files += [f"/sys/fs/cgroup/memory/memory.{n}" for n in
          ["usage_in_bytes", "limit_in_bytes", "max_usage_in_bytes", "stat", "oom_control", "failcnt"]]
files += [f"/sys/fs/cgroup/unified/{n}" for n in ["cgroup.controllers", "memory.pressure"]]
for path in files:
    try:
        with open(path, "rb") as f:
            add("cgroup_files", f.read())
    except OSError as e:
        print(f"seed: skipping {path}: {e}", file=sys.stderr)
for text in ["max\n", "9223372036854771712\n", "0::/kubepods/burstable/pod1/abc\n",
             "12:memory:/kubepods/pod1/abc\n11:cpu,cpuacct:/x\n0::/\n",
             "anon 1\nfile 2\ninactive_file 4096\n", "low 0\nhigh 3\nmax 1\noom 0\noom_kill 0\n",
             "some avg10=1.50 avg60=0.20 avg300=0.01 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"]:
    add("cgroup_files", text)

with open(os.path.join(root, "api/fixtures/signal-v1.json")) as f:
    sig = f.read()
add("signal_report", sig)
for r in [{"framework": "torch", "allocated_bytes": 1 << 30, "reserved_bytes": 2 << 30, "peak_bytes": 3 << 30,
           "total_bytes": 24 << 30, "step": 10, "batch_size": 8},
          {"framework": "mlx", "peak_bytes": 1}, {}, {"allocated": 1}]:
    add("signal_report", json.dumps(r))

# The command-line reader: launch lines as a container writes them (one item per line), and
# shell strings after `sh -c`.
for cmd in [
    "python\n-u\ntrain.py\n--per_device_train_batch_size\n8\n--gradient_accumulation_steps=2",
    "torchrun\n--nproc_per_node=8\nsft.py\n--per-device-train-batch-size\n4\n--bf16\n--no_gradient_checkpointing",
    "accelerate\nlaunch\n--config_file\nc.yaml\n-m\naxolotl.cli.train\ncfg.yml",
    "deepspeed\n--num_gpus\n8\ntrain.py\n--deepspeed\nds.json\n--max_seq_length\n4096",
    "sh -c\npip install -q trl && cd /app; NCCL_DEBUG=INFO torchrun --nproc_per_node=8 sft.py \\\n --per_device_train_batch_size 8 --lr='1e-4' \"x y\" 2>&1 | tee log",
    "sh -c\npython -c 'import x' && python $S --a \"$B\"",
    # Inference servers (argparse rules).
    "vllm\nserve\nQwen/Qwen2.5-7B\n--max_model_len=8192\n-tp\n2\n--enforce-eager\n--gpu-memory-utilization\n0.9",
    "sh -c\npython dl.py && exec python3 -m sglang.launch_server --model-path \"m\" \"--context-length=4096\" --port 30000",
]:
    add("launch", cmd)
