#!/usr/bin/env python3
"""What the sidecar sees while the save proof's job steps (issue 39, item 2): can deferring a
save under pressure save a job whose save alone does not fit?

The save proof's killed job (bench/host/test_host_proofs.py: 2 ranks of FSDP2 over gloo, a full
state dict with the optimizer gathered on rank 0, `limits.memory: 6600Mi`) runs in a fresh cgroup
v1 memory group with that limit, and the real `memguard-sidecar` binary watches the group
(`--cgroup`) with its default thresholds. The sidecar's signal file is read every 50 ms; each
reading is tagged with the job's phase from its markers (load until both ranks have loaded,
step once both have stepped, save once a rank begins saving). Prints one JSON line: the levels
seen in each phase, the group's working set over its limit at the last step reading, and how the
job ended. A level at `warn` or above through every step means the client's deferral would put
a due save off to its cap (50 steps) and then save anyway: it only delays the kill. Root only.

    sudo python3 bench/host/save_pressure.py [--out bench/host/results/save_pressure.jsonl]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import proof  # noqa: E402

SIDECAR = os.environ.get("MEMGUARD_SIDECAR_BIN", str(proof.ROOT / "target" / "debug" / "memguard-sidecar"))
S220_SHAPE = dict(hidden_size=1024, num_hidden_layers=16, intermediate_size=2816, num_attention_heads=16)
LIMIT = "6600Mi"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="append the JSON line here")
    args = parser.parse_args()
    proof.require_root()
    assert Path(SIDECAR).is_file(), f"no sidecar binary at {SIDECAR}: cargo build -p memguard-sidecar"
    config = proof.build_config("s220", 8000, **S220_SHAPE)
    work = Path(tempfile.mkdtemp(prefix="memguard-save-pressure-"))
    markers = work / "markers"
    markers.mkdir()
    command = ["torchrun", "--standalone", "--nproc_per_node", "2", str(HERE / "proof_fsdp_save.py"),
               "--model_name_or_path", str(config), "--output_dir", str(work / "out"),
               "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
               "--max_steps", "2", "--save_strategy", "steps", "--save_steps", "2", "--max_seq_length", "64",
               "--fsdp", "full_shard", "--fsdp_config", json.dumps({"state_dict_type": "FULL_STATE_DICT"}),
               "--save_only_model", "false", "--dataloader_num_workers", "0", "--dataloader_pin_memory", "false",
               "--report_to", "none", "--use_cpu", "true"]
    group = proof.CGROUP_ROOT / "save-pressure"
    if group.exists():
        group.rmdir()
    group.mkdir(parents=True)
    limit = proof.quantity_bytes(LIMIT)
    (group / "memory.limit_in_bytes").write_text(f"{limit}\n")
    signal = work / "signal.json"
    sidecar = subprocess.Popen(
        [SIDECAR, "--cgroup", str(group), "--signal-file", str(signal), "--termination-log", str(work / "summary"),
         "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0", "--interval", "50ms",
         "--log-format", "text", "--exit-when-empty", "false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    levels = {"load": set(), "step": set(), "save": set()}
    last_step_ratio = [0.0]
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            try:
                level = json.loads(signal.read_text()).get("level")
                names = [p.name for p in markers.iterdir()]
                stepped = sum(1 for n in names if n.startswith("stepped-"))
                saving = any(n.startswith("saving-") for n in names)
                phase = "save" if saving else "step" if stepped >= 2 else "load"
                levels[phase].add(level)
                if phase == "step":
                    stat = dict(line.split() for line in (group / "memory.stat").read_text().splitlines())
                    usage = int((group / "memory.usage_in_bytes").read_text())
                    last_step_ratio[0] = (usage - int(stat["total_inactive_file"])) / limit
            except (OSError, ValueError, KeyError):
                pass
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    proof.drop_caches()
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", MEMGUARD_PROOF_MARKERS=str(markers))
    start = time.time()
    job = subprocess.run(["sh", "-c", f'echo $$ > "{group}/cgroup.procs" && exec "$@"', "job", *command],
                         cwd=work, env=env, capture_output=True, text=True, timeout=600)
    stop.set()
    watcher.join()
    sidecar.terminate()
    sidecar.wait(timeout=30)
    oom = dict(line.split() for line in (group / "memory.oom_control").read_text().splitlines())
    result = dict(
        case="save-pressure-s220-r2-full_with_optimizer", limit=LIMIT, returncode=job.returncode,
        oom_kills=int(oom.get("oom_kill", 0)), wall_s=round(time.time() - start, 1),
        markers=sorted(p.name for p in markers.iterdir()),
        levels={k: sorted(v) for k, v in levels.items()},
        working_set_over_limit_at_step=round(last_step_ratio[0], 3),
    )
    print(json.dumps(result), flush=True)
    if args.out:
        with args.out.open("a") as f:
            f.write(json.dumps(result) + "\n")
    for _ in range(50):
        try:
            group.rmdir()
            break
        except OSError:
            time.sleep(0.1)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
