"""The webhook's rewrite of a stock Hugging Face launch, checked with the real parser (issue 27):
`memguard mutate` rewrites the trainer's flags, and transformers' own `HfArgumentParser` over
`TrainingArguments` must accept the rewritten args and read the planned values, with
batch × accumulation kept."""
import json
import os
import shlex
import subprocess
import tempfile

from transformers import HfArgumentParser, TrainingArguments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("MEMGUARD_BIN", os.path.join(ROOT, "target", "debug", "memguard"))

POD = """
apiVersion: v1
kind: Pod
metadata:
  name: sft
  namespace: ml
  labels: {{memguard.io/enabled: "true"}}
  annotations: {{memguard.io/model: llama-3-8b, memguard.io/method: lora, memguard.io/gpu-memory: 24GiB}}
spec:
  restartPolicy: Never
  containers:
    - name: trainer
      image: x
      command: {command}
      args: {args}
      resources: {{limits: {{nvidia.com/gpu: "1"}}}}
"""


def mutate(command, args):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "pod.yaml")
        with open(path, "w") as f:
            f.write(POD.format(command=json.dumps(command), args=json.dumps(args)))
        out = subprocess.run([BIN, "mutate", "-o", "json", "-f", path], check=True,
                             capture_output=True, text=True)
    return json.loads(out.stdout)


def parse(words):
    parser = HfArgumentParser(TrainingArguments)
    parsed = parser.parse_args_into_dataclasses(args=words, return_remaining_strings=True)
    return parsed[0], parsed[-1]


def check(pod, words, batch_before, accumulation_before):
    estimate = json.loads(pod["metadata"]["annotations"]["memguard.io/estimate"])
    planned = estimate["config"]
    training, rest = parse(words)
    assert training.per_device_train_batch_size == int(planned["batch-size"])
    assert training.gradient_accumulation_steps == int(planned["grad-accumulation"])
    assert training.gradient_checkpointing == (planned["grad-checkpointing"] == "true")
    assert (training.per_device_train_batch_size * training.gradient_accumulation_steps
            == batch_before * accumulation_before)
    assert int(planned["batch-size"]) < batch_before, "the fixture needs a downgrade"
    return training, rest


def after(words, program):
    return words[words.index(program) + 1:]


def test_array_args_reparse_with_hf_argument_parser():
    args = ["sft.py", "--per-device-train-batch-size", "8", "--gradient_accumulation_steps=2",
            "--output_dir", "/out", "--max_seq_length", "4096", "--logging_steps", "5"]
    pod = mutate(["accelerate", "launch", "--num_processes", "1"], args)
    words = after(pod["spec"]["containers"][0]["args"], "sft.py")
    _, rest = check(pod, words, 8, 2)
    assert rest[:2] == ["--max_seq_length", str(json.loads(
        pod["metadata"]["annotations"]["memguard.io/estimate"])["config"]["seq-length"])]


def test_bash_c_string_reparses_and_keeps_its_prefix():
    # A bespoke sft.py: memguard plans it only on what the launch says (issue 36), so the
    # launch says its accumulation and sequence.
    script = ("pip install -q trl && torchrun --nproc_per_node=1 sft.py "
              "--per_device_train_batch_size 8 --gradient_accumulation_steps 1 "
              "--max_seq_length 4096 --output_dir /out | tee /tmp/log")
    pod = mutate(["bash", "-c"], [script])
    rewritten = pod["spec"]["containers"][0]["args"][0]
    assert rewritten.startswith("pip install -q trl && torchrun --nproc_per_node=1 sft.py ")
    assert rewritten.endswith(" | tee /tmp/log")
    words = shlex.split(rewritten.split("|")[0])
    check(pod, after(words, "sft.py"), 8, 1)
