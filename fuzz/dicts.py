#!/usr/bin/env python3
"""Writes fuzz/dict/<target>.dict, libFuzzer dictionaries: the string literals of the code each
target reaches (annotation names, policy and signal field names, units, enum values), so that the
fuzzer finds `memguard.io/lora-rank` or `safetyRatio` without guessing them byte by byte. Built
without a sanitizer, libFuzzer cannot see `memcmp`, so it would not learn these words by itself.
Deterministic: re-running on unchanged sources writes the same files."""
import glob
import os
import re

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The sources whose literals each target needs (test modules included: their inputs are
# realistic too). Extra words: syntax the sources do not spell as one literal.
TARGETS = {
    "annotations": (["api/src/annotations.rs", "api/src/pod.rs", "estimator/src/*.rs",
                     "estimator/src/**/*.rs"], ["=", "\n", "memguard.io/"]),
    "admission_review": (["api/src/*.rs", "webhook/src/review.rs", "webhook/src/mutate.rs",
                          "webhook/src/mutate/*.rs", "webhook/src/patch.rs", "webhook/src/patch/*.rs",
                          "webhook/src/budget.rs", "webhook/src/budget/*.rs",
                          "webhook/src/placement.rs", "webhook/src/placement/*.rs",
                          "webhook/src/dra.rs", "webhook/src/dra/*.rs",
                          "estimator/src/units.rs", "estimator/src/catalog.rs"],
                         ['"apiVersion"', '"kind"', '"request"', '"object"', '"uid"',
                          '"metadata"', '"annotations"', '"spec"', '"containers"',
                          '"resources"', '"limits"', '"requests"', '"env"', '"name"',
                          '"value"', '"volumes"', '"volumeMounts"', '"initContainers"',
                          '"nvidia.com/gpu"', '"memory"', '"cpu"', "null", "true", "false"]),
    "quantities": (["api/src/quantity.rs", "api/src/pod.rs", "estimator/src/units.rs",
                    "sidecar/src/config.rs"],
                   ["Ki", "Mi", "Gi", "Ti", "Pi", "Ei", "k", "M", "G", "T", "P", "E", "m",
                    "e", "E+", "e-", "ms", "s", "h", "d", "KiB", "MiB", "GiB", "B", "."]),
    "policy": (["api/src/policy.rs", "api/src/crd.rs", "api/src/annotations.rs",
                "api/src/models.rs", "api/src/models/*.rs", "api/src/hf_config.rs",
                "webhook/src/config.rs", "estimator/src/config.rs"],
               ["apiVersion: ", "kind: MemguardPolicy", "spec:", "metadata:", ": ", "\n  ",
                "- ", "{", "}", "[", "]", "null", "true", "false", "~", "&a", "*a", "<<: "]),
    "cgroup_files": (["sidecar/src/sample/*.rs"],
                     ["some ", "full ", "avg10=", "avg60=", "avg300=", "total=", "VmRSS:",
                      " kB", "0::/", ":memory:/", "max", "\n", "..", "/"]),
    "launch": (["api/src/launch/*.rs"],
               ["sh -c\n", " ", "\n", "'", '"', "\\", "&&", "||", ";", "|", "$", "--", "=",
                "python", "torchrun", "accelerate\nlaunch", "deepspeed", "-m"]),
    "signal_report": (["api/src/signal.rs", "api/src/summary.rs", "sidecar/src/engine.rs",
                       "sidecar/src/server.rs"],
                      ['"seq"', '"version"', "null", "true", "false", "18446744073709551615",
                       "-1", "1e308"]),
}

# Numbers at the edges of the integer types, for every target: the mutation smoke run found a
# width overflow in annotations with 9223372036854775807 that libFuzzer, with no word for it,
# had not reached in 27 minutes.
EDGE_NUMBERS = ["0", "-1", "255", "256", "65536", "2147483648", "4294967296",
                "9223372036854775807", "18446744073709551615", "18446744073709551616",
                "1e308", "-0.0", "NaN", "inf"]

LITERAL = re.compile(r'"((?:[^"\\\n]|\\.){1,48})"')
# Struct fields: serde spells them as written or in camelCase (`rename_all`).
FIELD = re.compile(r"\bpub (?:\(crate\) )?([a-z][a-z0-9_]*):")


def camel(name):
    head, *rest = name.split("_")
    return head + "".join(w.capitalize() for w in rest)


def literals(patterns):
    words = set()
    for pattern in patterns:
        for path in glob.glob(os.path.join(root, pattern), recursive=True):
            with open(path, encoding="utf-8") as f:
                text = f.read()
            for m in FIELD.finditer(text):
                words |= {m.group(1), camel(m.group(1))}
            for m in LITERAL.finditer(text):
                word = m.group(1)
                # Words and paths, not messages: a message's text is never parsed.
                if " " in word or "{" in word or "\\" in word:
                    continue
                words.add(word)
    return words


def escape(word):
    return "".join(chr(b) if 32 <= b < 127 and chr(b) not in '"\\' else "\\x%02x" % b
                   for b in word.encode())


os.makedirs(os.path.join(root, "fuzz", "dict"), exist_ok=True)
for target, (patterns, extra) in TARGETS.items():
    words = literals(patterns) | set(extra) | set(EDGE_NUMBERS)
    path = os.path.join(root, "fuzz", "dict", target + ".dict")
    with open(path, "w", encoding="utf-8") as f:
        f.write("# Written by fuzz/dicts.py from the sources the target reaches; do not edit.\n")
        for word in sorted(words):
            f.write('"%s"\n' % escape(word))
    print(target, len(words))
