"""Custom torch loops report what they can (issue 37, item 2: "Custom loops that cannot be
re-chunked report what they can"): real 2-rank loops under torchrun (gloo, CPU) with the
injected client, watched by the real `memguard-sidecar` binary over loopback; `/metrics` shows
what they reported, and nothing they could not read."""
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, Iterator

import pytest

from test_auto import clean_env, install
from test_train_start_plan import MIB, Sidecar, in_cgroup, need_root_v1, v1_cgroup

WORKER = Path(__file__).resolve().parent / "loop_worker.py"
#: `memguard_api::signal::OPTIMIZER_CODES`: adamw 0, sgd 2.
ADAMW, SGD = 0, 2


@pytest.fixture
def cgroup() -> Iterator[Path]:
    need_root_v1()
    yield from v1_cgroup("loop", 8192 * MIB)


def reported(tmp: Path, cgroup: Path, mode: str) -> Dict[str, float]:
    """Runs the loop on 2 ranks; the config the sidecar exports, knob → value."""
    sidecar = Sidecar(tmp, cgroup, train_start=None)
    try:
        client = install(tmp / "client")
        env = clean_env(PYTHONPATH=f"{client}:{WORKER.parent}", MEMGUARD_SIDECAR_URL=sidecar.url)
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(WORKER), mode]
        out = subprocess.run(in_cgroup(cgroup, run), env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        text = sidecar.metrics()
    finally:
        sidecar.stop()
    found = re.findall(r'memguard_sidecar_trainer_config\{knob="([a-z0-9-]+)"\} (\S+)\n', text)
    return {k: float(v) for k, v in found}


def test_a_plain_loop_reports_its_world_its_ranks_and_its_optimizer(tmp_path: Path, cgroup: Path) -> None:
    config = reported(tmp_path, cgroup, "plain")
    params = 16 * 32 + 32 + 32 * 1 + 1
    assert config == {
        "world-size": 2, "local-ranks": 2, "trainable-params": params, "optimizer": ADAMW,
    }, "only what the loop's objects say: no model shape, no micro-batch, no sequence"


def test_a_loop_through_the_micro_batcher_reports_its_model_but_not_one_batch_as_its_sequence(
    tmp_path: Path, cgroup: Path
) -> None:
    pytest.importorskip("transformers")
    config = reported(tmp_path, cgroup, "batcher")
    for knob, value in {
        "world-size": 2, "local-ranks": 2, "hidden-size": 64, "num-layers": 2, "num-heads": 4,
        "num-kv-heads": 2, "intermediate-size": 128, "vocab-size": 512,
    }.items():
        assert config.get(knob) == value, (knob, config)
    # Its first batch (48 tokens) says nothing of the batches after it.
    assert "seq-length" not in config, config
    assert config["params"] == config["trainable-params"] > 0
    # The optimizer step hook knows less, and must not replace the batcher's report.
    assert "optimizer" not in config
    assert "batch-size" not in config and "grad-accumulation" not in config, "the loop's own"


def test_an_optimizer_says_its_parameters_once_and_its_kind_only_when_known() -> None:
    torch = pytest.importorskip("torch")
    from memguard_client.train_config import loop_config, optimizer_config

    shared = torch.nn.Linear(3, 2)  # 8 parameters
    other = torch.nn.Linear(2, 1)  # 3, in a second group
    sgd = torch.optim.SGD([{"params": shared.parameters()}, {"params": other.parameters()}], lr=0.1)
    assert optimizer_config(sgd) == {"trainable-params": 11.0, "optimizer": SGD}
    momentum = torch.optim.SGD(shared.parameters(), lr=0.1, momentum=0.9)
    assert optimizer_config(momentum) == {"trainable-params": 8.0, "optimizer": 3.0}
    mixed = torch.optim.SGD([{"params": shared.parameters(), "momentum": 0.9},
                             {"params": other.parameters(), "momentum": 0.0}], lr=0.1)
    assert optimizer_config(mixed) == {"trainable-params": 11.0}, "neither kind: not reported"
    assert optimizer_config(torch.optim.RMSprop(other.parameters())) == {"trainable-params": 3.0}
    assert optimizer_config(object()) == {}, "not an optimizer: nothing"
    # No process group in this process: no world size, and no guess at the ranks here.
    assert loop_config() == {}


def test_a_process_that_imported_the_hf_trainer_leaves_the_config_to_it(tmp_path: Path) -> None:
    """The sidecar plans once, on the first config: an optimizer step before a Trainer trains
    must not spend that on a config with no micro-batch."""
    pytest.importorskip("transformers")
    from conftest import FakeSidecar
    from test_auto import python

    sidecar = FakeSidecar()
    try:
        client = install(tmp_path / "client")
        script = (
            "import time, torch, transformers.trainer\n"
            "m = torch.nn.Linear(4, 1); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
            "m(torch.randn(2, 4)).sum().backward(); opt.step(); time.sleep(2)\n"
            "print('done')\n"
        )
        env = clean_env(PYTHONPATH=str(client), MEMGUARD_SIDECAR_URL=sidecar.url)
        out = python(script, env, tmp_path)
        assert out.returncode == 0 and out.stdout == "done\n", out.stderr
        assert [r.get("step") for r in sidecar.reports] == [0], "the step, and no config"
    finally:
        sidecar.close()
