"""Every launch of the real-shape corpus (tests/corpus/launch, issue 27), admitted by
`memguard mutate` and re-read by the frameworks' own parsers: transformers' `HfArgumentParser`
over the trainer's config (TRL's `SFTConfig`, `DPOConfig`, … with `ScriptArguments` and
`ModelConfig` for TRL's scripts and `trl` CLI; `TrainingArguments` for the others). The parser
must accept the rewritten args, read the planned batch, accumulation, checkpointing (and, where
the args carry them, sequence length and LoRA rank), and batch × accumulation must be what the
original args said. The Rust harness (webhook/tests/corpus.rs) checks the rest."""
import glob
import importlib
import json
import os
import shlex
import subprocess
import tempfile

import pytest
import yaml
from transformers import HfArgumentParser, TrainingArguments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("MEMGUARD_BIN", os.path.join(ROOT, "target", "debug", "memguard"))

# The TRL config each script or `trl` subcommand parses into (module, class), by name.
TRL_CONFIGS = {
    "sft": ("trl", "SFTConfig"),
    "dpo": ("trl", "DPOConfig"),
    "reward": ("trl", "RewardConfig"),
    "reward_modeling": ("trl", "RewardConfig"),
    "grpo": ("trl", "GRPOConfig"),
    "kto": ("trl.experimental.kto", "KTOConfig"),
    "orpo": ("trl.experimental.orpo", "ORPOConfig"),
    "cpo": ("trl.experimental.cpo", "CPOConfig"),
}
# Options of the `trl` CLI itself (it hands them to accelerate), not of the dataclasses.
TRL_CLI_OPTIONS = {"--num_processes", "--accelerate_config"}


def load(path):
    with open(path) as f:
        return yaml.safe_load(f)


def mutate(pod):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "pod.json")
        with open(path, "w") as f:
            json.dump(pod, f)
        out = subprocess.run([BIN, "mutate", "-o", "json", "-f", path], check=True,
                             capture_output=True, text=True)
    return json.loads(out.stdout)


def launch_words(pod):
    """The words after the trainer's program (`x.py`, or `trl <subcommand>`), and its name."""
    c = pod["spec"]["containers"][0]
    items = (c.get("command") or []) + (c.get("args") or [])
    if items[:2] == ["bash", "-c"]:
        # The shell drops a backslash-newline (a line continuation); shlex does not.
        words = shlex.split(items[2].replace("\\\n", ""), comments=True)
        # The launch is the last command of the `&&` list.
        while "&&" in words:
            words = words[words.index("&&") + 1:]
    else:
        words = items
    for i, w in enumerate(words):
        if w.endswith(".py"):
            return os.path.basename(w)[:-3], words[i + 1:]
        if w == "trl":
            return words[i + 1], words[i + 2:]
    raise AssertionError(f"no program in {words}")


def hf_entries():
    """The corpus entries whose launch is a command line with HF rules (a Python script or
    `trl`); the YAML-config and `tune run` shapes have their own parser tests."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "tests", "corpus", "launch", "*.yaml"))):
        entry = load(path)
        if entry.get("configMaps"):
            continue
        try:
            launch_words(entry["pod"])
        except AssertionError:
            continue
        out.append(path)
    return out


ENTRIES = hf_entries()


# The TRL trainers whose config memguard knows cuts sequences at `max_length` 1024 by default.
TRL_SEQ_DEFAULT = {"sft", "dpo", "reward", "kto", "cpo", "orpo"}


def trl_launch(pod, words):
    """A launch memguard knows as TRL's: the `trl` command, a `trl/scripts/` or TRL's
    `examples/scripts/` script, or `--use_peft`."""
    c = pod["spec"]["containers"][0]
    text = " ".join((c.get("command") or []) + (c.get("args") or []))
    return (any(w == "trl" or "trl/scripts/" in w or "examples/scripts/" in w
                for w in text.split())
            or "--use_peft" in words)


def parser_for(entry, program):
    """The dataclasses the launch's own script parses its args into, and whether the parser is
    the script's whole parser (so every arg must be accepted)."""
    if entry["source"]["repository"] == "huggingface/trl" and program in TRL_CONFIGS:
        module, name = TRL_CONFIGS[program]
        trl = importlib.import_module("trl")
        config = getattr(importlib.import_module(module), name)
        return HfArgumentParser((trl.ScriptArguments, config, trl.ModelConfig)), True
    # Other scripts add their own dataclasses: TrainingArguments reads the knobs.
    return HfArgumentParser(TrainingArguments), False


def parse(parser, words):
    # `--use_cpu`: this machine has no GPU, and TRL's configs turn bf16 on by default, which
    # TrainingArguments refuses without one. It changes the device only, never a knob read here.
    return parser.parse_args_into_dataclasses(args=[*words, "--use_cpu"],
                                              return_remaining_strings=True)


def test_the_corpus_has_the_hf_launches():
    assert len(ENTRIES) >= 24, ENTRIES


@pytest.mark.parametrize("path", ENTRIES, ids=[os.path.basename(p)[:-5] for p in ENTRIES])
def test_rewritten_launch_reparses_to_the_plan(path):
    entry = load(path)
    out = mutate(entry["pod"])
    estimate = json.loads(out["metadata"]["annotations"]["memguard.io/estimate"])
    planned = estimate["config"]
    program, before = launch_words(entry["pod"])
    program_after, after = launch_words(out)
    assert program_after == program
    parser, whole = parser_for(entry, program)
    *was, rest_before = parse(parser, before)
    *now, rest = parse(parser, after)
    if whole:
        # memguard adds nothing the parser rejects. (A source may itself pass a flag the
        # installed release dropped: TRL's ALST example still says --max_seq_length.)
        unknown = [w for w in rest if w.startswith("--") and w not in rest_before
                   and w.split("=")[0] not in TRL_CLI_OPTIONS]
        assert not unknown, f"the parser does not take {unknown}"
    training = next(d for d in now if hasattr(d, "per_device_train_batch_size"))
    training_was = next(d for d in was if hasattr(d, "per_device_train_batch_size"))
    assert training.per_device_train_batch_size == int(planned["batch-size"])
    assert training.gradient_accumulation_steps == int(planned["grad-accumulation"])
    # TRL's example scripts whose config the installed TRL no longer ships (bco, prm) parse
    # with TrainingArguments here, whose checkpointing default is not theirs: checked only where
    # memguard wrote the flag.
    own_config = whole or not trl_launch(entry["pod"], before)
    if own_config or any(w.startswith("--gradient_checkpointing") for w in after):
        assert training.gradient_checkpointing == (planned["grad-checkpointing"] == "true")
    assert (training.per_device_train_batch_size * training.gradient_accumulation_steps
            == training_was.per_device_train_batch_size
            * training_was.gradient_accumulation_steps)
    read = entry["expect"].get("read") or {}
    # (Unless the parser took no sequence flag: then the trainer runs at its own default.)
    seq_flag_taken = not any(w in ("--max_seq_length", "--max_length") for w in rest_before)
    if "seq-length" in read and hasattr(training, "max_length") and seq_flag_taken:
        assert training.max_length == int(planned["seq-length"])
    # A sequence the args leave out runs at the config's default (TRL's: 1024): memguard plans
    # on it, or on a longer one where it does not know the trainer (the safe side).
    elif whole and getattr(training, "max_length", None) is not None:
        assert training.max_length <= int(planned["seq-length"])
        if "seq-length" not in read and trl_launch(entry["pod"], before) \
                and program in TRL_SEQ_DEFAULT:
            assert training.max_length == int(planned["seq-length"])
    model = next((d for d in now if hasattr(d, "lora_r")), None)
    if "lora-rank" in read and model is not None:
        assert model.lora_r == int(planned["lora-rank"])
    if not estimate.get("changed"):
        assert after == before, "fits as written: the args are unchanged"
