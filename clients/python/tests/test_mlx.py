"""memguard_client.mlx with real MLX (PyPI ``mlx[cpu]``): micro-batched gradients against the
full batch, the peak after a downgrade, the limits from the budget, the leak check, the report,
and an mlx_lm LoRA fine-tune that follows the signal. Nothing of MLX is mocked."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten, tree_map

from conftest import REPO, SRC, FakeSidecar, age, signal_dict, write_atomic
from memguard_client import Guard
from memguard_client import mlx as mg_mlx
from memguard_client.mlx import (
    CACHE_LIMIT_FRACTION,
    MEMORY_LIMIT_FRACTION,
    LeakDetector,
    MicroBatcher,
    set_limits_from_budget,
)

REPORT_FIXTURE = REPO / "api" / "fixtures" / "report-v1.json"


@pytest.fixture(autouse=True)
def restore_mlx_limits() -> Iterator[None]:
    """Each test leaves MLX's process-wide limits as it found them."""
    memory_limit = mx.get_memory_limit()
    cache_limit = mx.set_cache_limit(memory_limit)
    yield
    mx.set_memory_limit(memory_limit)
    mx.set_cache_limit(cache_limit)
    mx.clear_cache()


def fixed_guard(batch: int) -> Guard:
    return Guard(signal_file="", sidecar_url="", env={"MEMGUARD_BATCH_SIZE": str(batch)})


def assert_trees_close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    fa, fb = tree_flatten(a), tree_flatten(b)
    assert [k for k, _ in fa] == [k for k, _ in fb]
    assert fa, "no gradients to compare"
    for (k, x), (_, y) in zip(fa, fb):
        assert x.shape == y.shape and x.dtype == y.dtype, k
        assert mx.allclose(x, y, rtol=rtol, atol=atol).item(), (k, mx.abs(x - y).max().item())


# --- models -----------------------------------------------------------------------------------


class MLP(nn.Module):
    def __init__(self, d_in: int = 8, hidden: int = 32, d_out: int = 3) -> None:
        super().__init__()
        self.l1 = nn.Linear(d_in, hidden)
        self.l2 = nn.Linear(hidden, d_out)

    def __call__(self, x: mx.array) -> mx.array:
        return self.l2(nn.relu(self.l1(x)))


def mlp_loss(model: nn.Module, x: mx.array, y: mx.array) -> mx.array:
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


class Block(nn.Module):
    """A pre-norm transformer block (attention + MLP) and a linear read-out."""

    def __init__(self, dims: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.block = nn.TransformerEncoderLayer(dims, heads, mlp_dims=32, norm_first=True)
        self.out = nn.Linear(dims, 1)

    def __call__(self, x: mx.array) -> mx.array:
        mask = nn.MultiHeadAttention.create_additive_causal_mask(x.shape[1])
        return self.out(self.block(x, mask)).squeeze(-1)


def block_loss(model: nn.Module, x: mx.array, y: mx.array) -> mx.array:
    return nn.losses.mse_loss(model(x), y, reduction="mean")


def mlp_batch(rows: int) -> Tuple[mx.array, mx.array]:
    return mx.random.normal((rows, 8)), mx.random.randint(0, 3, (rows,))


def block_batch(rows: int) -> Tuple[mx.array, mx.array]:
    return mx.random.normal((rows, 6, 16)), mx.random.normal((rows, 6))


MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable[..., mx.array], Callable[[int], Any]]] = {
    "mlp": (MLP, mlp_loss, mlp_batch),
    "transformer-block": (Block, block_loss, block_batch),
}


# --- the gradient of a micro-batched batch is the full batch's ---------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("micro", [1, 3, 7, 16, 64])
def test_micro_batched_loss_and_gradient_equal_the_full_batch(name: str, micro: int) -> None:
    make, loss_fn, make_batch = MODELS[name]
    mx.random.seed(7)
    model = make()
    mx.eval(model.parameters())
    batch = make_batch(20)  # 3 and 7 do not divide 20: uneven last micro-batches
    full_loss, full_grads = nn.value_and_grad(model, loss_fn)(model, *batch)
    loss, grads = MicroBatcher(fixed_guard(micro), set_limits=False).value_and_grad(model, loss_fn, batch)
    assert loss.item() == pytest.approx(full_loss.item(), rel=1e-5)
    assert_trees_close(grads, full_grads)


def test_without_the_rows_over_b_weights_the_gradient_would_be_wrong() -> None:
    # The allclose above can fail: an unweighted sum of 4 micro-batch gradients is 4× too big.
    mx.random.seed(1)
    model = MLP()
    batch = mlp_batch(20)
    _, full = nn.value_and_grad(model, mlp_loss)(model, *batch)
    vg = nn.value_and_grad(model, mlp_loss)
    parts = [vg(model, *(a[i : i + 5] for a in batch))[1] for i in range(0, 20, 5)]
    summed = parts[0]
    for p in parts[1:]:
        summed = tree_map(lambda a, b: a + b, summed, p)
    with pytest.raises(AssertionError):
        assert_trees_close(summed, full)


def test_one_micro_batch_when_the_batch_fits_and_bad_batches_are_clear_errors() -> None:
    mx.random.seed(2)
    model = MLP()
    batch = mlp_batch(6)
    loss, grads = MicroBatcher(fixed_guard(6), set_limits=False).value_and_grad(model, mlp_loss, batch)
    ref_loss, ref = nn.value_and_grad(model, mlp_loss)(model, *batch)
    assert loss.item() == ref_loss.item()
    assert_trees_close(grads, ref, rtol=0, atol=0)
    batcher = MicroBatcher(fixed_guard(2), set_limits=False)
    with pytest.raises(ValueError, match="disagree on the number of rows"):
        batcher.value_and_grad(model, mlp_loss, (batch[0], batch[1][:5]))
    with pytest.raises(ValueError, match="no first axis"):
        batcher.value_and_grad(model, mlp_loss, (batch[0], mx.array(1.0)))


# --- after a downgrade the peak per step falls --------------------------------------------------


class Wide(nn.Module):
    """Activations dominate: 256 rows × 4096 hidden float32 is 4 MiB per activation, against
    1 MiB of parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(64, 4096)
        self.l2 = nn.Linear(4096, 1)

    def __call__(self, x: mx.array) -> mx.array:
        return self.l2(nn.relu(self.l1(x))).squeeze(-1)


def wide_loss(model: nn.Module, x: mx.array, y: mx.array) -> mx.array:
    return nn.losses.mse_loss(model(x), y, reduction="mean")


def test_after_a_downgrade_the_peak_active_memory_per_step_falls(signal_path: Path) -> None:
    write_atomic(signal_path, signal_dict(1, batch=256, accum=1))
    age(signal_path)
    guard = Guard(signal_file=str(signal_path), sidecar_url="", env={})
    batcher = MicroBatcher(guard, set_limits=False)
    mx.random.seed(3)
    model = Wide()
    opt = optim.SGD(learning_rate=1e-3)
    x, y = mx.random.normal((256, 64)), mx.random.normal((256,))
    mx.eval(model.parameters(), x, y)
    peaks: List[int] = []
    batches: List[int] = []
    cache_after_downgrade = None
    for step in range(6):
        if step == 3:
            write_atomic(signal_path, signal_dict(2, batch=32, accum=8, level="downgrade"))
            age(signal_path)
        mx.reset_peak_memory()
        if batcher.refresh() and step == 3:
            cache_after_downgrade = mx.get_cache_memory()
        loss, grads = batcher.value_and_grad(model, wide_loss, (x, y))
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        peaks.append(mx.get_peak_memory())
        batches.append(batcher.micro_batch_size)
    assert batches == [256] * 3 + [32] * 3
    assert batcher.cache_releases == 1 and cache_after_downgrade == 0, "clear_cache after a downgrade"
    before, after = min(peaks[:3]), max(peaks[3:])
    # Parameters, gradients and the batch (about 3 MiB) stay; the activations of 256 rows
    # (4 MiB each, and their gradients) shrink eightfold.
    assert after < 0.5 * before, (peaks, before, after)
    print(f"\npeak per step, MiB: {[round(p / 2**20, 1) for p in peaks]}")


# --- after a downgrade the process's own peak falls (freed buffers back to the kernel) -----------

# A length curriculum in a fresh process: 4 steps of 32 rows at growing lengths, a downgrade to
# 16 rows, 4 more steps. Prints each step's micro-batch sizes and the process's peak resident
# memory during the step (VmHWM, reset through /proc/self/clear_refs): what a cgroup charges.
CURRICULUM_CHILD = r"""
import json, os, sys, time
import mlx.core as mx, mlx.nn as nn
from memguard_client import Guard
from memguard_client.mlx import MicroBatcher

signal_path, return_freed = sys.argv[1], sys.argv[2] == "1"

def write_signal(seq, batch, level):
    body = {"version": 1, "seq": seq, "level": level, "batch_size": batch,
            "grad_accumulation": 32 // batch, "grad_checkpointing": False, "reason": "test",
            "timestamp": "2026-11-22T22:00:00.000Z"}
    with open(signal_path + ".tmp", "w") as f:
        json.dump(body, f)
    os.replace(signal_path + ".tmp", signal_path)
    t = time.time() - 5
    os.utime(signal_path, (t, t))

def peak_rss_mib():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) // 1024 for l in f if l.startswith("VmHWM:"))

class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.l1, self.l2 = nn.Linear(8, 256), nn.Linear(256, 1)
    def __call__(self, x):
        return self.l2(nn.relu(self.l1(x)).mean(axis=1)).squeeze(-1)

def loss_fn(model, x, y):
    return ((model(x) - y) ** 2).mean()

write_signal(1, 32, "ok")
batcher = MicroBatcher(Guard(signal_file=signal_path, sidecar_url="", env={}),
                       env={"MEMGUARD_BUDGET_BYTES": str(160 << 20)}, return_freed_memory=return_freed)
model = Pooled()
mx.eval(model.parameters())
steps = []
for step, length in enumerate((600, 750, 900, 1050, 1100, 1150, 1200, 1250)):
    if step == 4:
        write_signal(2, 16, "downgrade")
    x, y = mx.random.normal((32, length, 8)), mx.random.normal((32,))
    mx.eval(x, y)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    batcher.refresh()
    loss, grads = batcher.value_and_grad(model, loss_fn, (x, y))
    mx.eval(loss, grads)
    steps.append({"micro": batcher.last_micro, "peak_rss_mib": peak_rss_mib()})
    del x, y, loss, grads
print(json.dumps({"freed_memory_returned": batcher.freed_memory_returned, "steps": steps}))
"""


def curriculum(tmp_path: Path, return_freed: bool) -> Dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-c", CURRICULUM_CHILD, str(tmp_path / f"signal-{return_freed}.json"), str(int(return_freed))],
        env=env, capture_output=True, text=True, timeout=120, check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator and /proc: Linux only")
def test_after_a_downgrade_the_process_peak_falls_because_freed_buffers_go_back(tmp_path: Path) -> None:
    fixed, plain = curriculum(tmp_path, True), curriculum(tmp_path, False)
    assert fixed["freed_memory_returned"] is True and plain["freed_memory_returned"] is False
    for run in (fixed, plain):
        assert [s["micro"] for s in run["steps"]] == [[32]] * 4 + [[16, 16]] * 4
    def before_after(run: Dict[str, Any]) -> Tuple[int, int]:
        peaks = [s["peak_rss_mib"] for s in run["steps"]]
        return peaks[3], max(peaks[4:])
    before, after = before_after(fixed)
    # Half the rows per micro-batch: the activations (about 40 of the ~100 MiB) halve, the rest
    # (Python, MLX, the batch) stays.
    assert after < 0.85 * before, fixed
    # Without it glibc serves the smaller buffers from its heap (its mmap threshold rose to the
    # larger blocks freed before) and keeps them resident: the downgrade does not lower the peak.
    plain_before, plain_after = before_after(plain)
    assert plain_after > 0.95 * plain_before, plain
    print(f"\npeak RSS per step, MiB: returned {[s['peak_rss_mib'] for s in fixed['steps']]}, "
          f"plain glibc {[s['peak_rss_mib'] for s in plain['steps']]}")


def test_freed_memory_is_returned_only_under_a_budget_and_trim_is_harmless() -> None:
    from memguard_client import allocator

    assert MicroBatcher(fixed_guard(4), env={}).freed_memory_returned is False
    assert MicroBatcher(fixed_guard(4), env={"MEMGUARD_BUDGET_BYTES": str(1 << 30)},
                        return_freed_memory=False).freed_memory_returned is False
    allocator.trim()  # returns whether pages went back; either way nothing breaks
    with pytest.raises(ValueError):
        allocator.return_freed_memory(0)


# --- limits from the budget ----------------------------------------------------------------------


def test_limits_are_set_from_the_budget_in_the_env() -> None:
    budget = 3 << 30
    batcher = MicroBatcher(fixed_guard(4), env={"MEMGUARD_BUDGET_BYTES": str(budget)})
    assert batcher.limits is not None
    assert batcher.limits.memory_limit_bytes == int(budget * MEMORY_LIMIT_FRACTION)
    assert batcher.limits.cache_limit_bytes == int(budget * CACHE_LIMIT_FRACTION)
    assert mx.get_memory_limit() == int(budget * MEMORY_LIMIT_FRACTION)
    assert mx.set_cache_limit(0) == int(budget * CACHE_LIMIT_FRACTION)  # returns the previous
    # And, with glibc, freed buffers go back to the kernel (process-wide; harmless to the tests
    # after this one, which measure MLX's own figures or run in their own processes).
    assert batcher.freed_memory_returned is sys.platform.startswith("linux")


def test_the_cache_limit_really_bounds_the_mlx_cache() -> None:
    set_limits_from_budget({"MEMGUARD_BUDGET_BYTES": str(10 << 20)})  # cache limit 1 MiB
    a = mx.ones((1024, 1024))
    b = a * 2
    mx.eval(b)
    del a, b  # 8 MiB of buffers back to MLX
    assert mx.get_cache_memory() <= int((10 << 20) * CACHE_LIMIT_FRACTION)
    set_limits_from_budget({"MEMGUARD_BUDGET_BYTES": str(1 << 40)})
    a = mx.ones((1024, 1024))
    b = a * 2
    mx.eval(b)
    del a, b
    assert mx.get_cache_memory() >= 8 << 20, "with a large budget the same buffers are cached"


@pytest.mark.parametrize("raw", ["12GB", "-5", "0", "", "1e9"])
def test_a_malformed_budget_sets_no_limit_and_says_so(raw: str, caplog: pytest.LogCaptureFixture) -> None:
    before = mx.get_memory_limit()
    with caplog.at_level(logging.WARNING, logger="memguard_client"):
        assert set_limits_from_budget({"MEMGUARD_BUDGET_BYTES": raw}) is None
    assert mx.get_memory_limit() == before
    assert "MEMGUARD_BUDGET_BYTES" in caplog.text and repr(raw) in caplog.text


def test_no_budget_sets_nothing_and_bad_fractions_are_refused() -> None:
    before = mx.get_memory_limit()
    assert MicroBatcher(fixed_guard(4), env={}).limits is None
    assert mx.get_memory_limit() == before
    with pytest.raises(ValueError):
        set_limits_from_budget({}, memory_fraction=0.5, cache_fraction=0.6)


# --- leak detection -------------------------------------------------------------------------------


def run_loop(batcher: MicroBatcher, steps: int, leak_bytes_per_step: int) -> List[Dict[str, Any]]:
    """A real training loop (Adam on the MLP); a leaking one keeps an evaluated array per step."""
    mx.random.seed(4)
    model = MLP()
    opt = optim.Adam(learning_rate=1e-3)
    batch = mlp_batch(16)
    held: List[mx.array] = []
    bodies = []
    for step in range(steps):
        batcher.refresh()
        loss, grads = batcher.value_and_grad(model, mlp_loss, batch)
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state, loss)
        if leak_bytes_per_step:
            held.append(mx.zeros((leak_bytes_per_step // 4,), dtype=mx.float32))
            mx.eval(held[-1])
        body = batcher.end_step(step)
        if body is not None:
            bodies.append(body)
    return bodies


def test_a_leaking_loop_is_reported_and_a_steady_one_is_not(sidecar: FakeSidecar) -> None:
    guard = Guard(signal_file="", sidecar_url=sidecar.url, env={"MEMGUARD_BATCH_SIZE": "4"}, background=False)
    steady = MicroBatcher(guard, set_limits=False, report_every=2, leak_every=2)
    steady_bodies = run_loop(steady, 30, 0)
    assert len(steady_bodies) == 15 and all("leak_bytes_per_second" not in b for b in steady_bodies)
    assert steady.leaks.leak is None and len(steady.leaks.readings) == 5
    # Adam allocates its state at the first update: a plateau after one rise, not a leak. The
    # plateau is flat to a few bytes (scalars such as Adam's step count), far below tolerance.
    flat = [r[2] for r in steady.leaks.readings]
    assert max(flat) - min(flat) < 1024, flat

    leaking = MicroBatcher(guard, set_limits=False, report_every=2, leak_every=2)
    bodies = run_loop(leaking, 30, 1 << 20)  # 1 MiB a step, 2 MiB between checks
    leaks = [b for b in bodies if "leak_bytes_per_second" in b]
    assert leaks, "the leak was not reported"
    assert "leak_bytes_per_second" not in bodies[0], "not before the window is full"
    assert leaking.leaks.leak is not None
    assert leaking.leaks.leak.bytes_per_step == pytest.approx(1 << 20, rel=0.01)
    assert leaking.leaks.leak.growth_bytes == pytest.approx(8 << 20, rel=0.01)
    assert all(b["leak_bytes_per_second"] > 0 for b in leaks)
    # What the sidecar received: every report, the leak in the later ones.
    assert sidecar.reports == steady_bodies + bodies
    received = [r for r in sidecar.reports if "leak_bytes_per_second" in r]
    assert received == leaks
    fields = set(json.loads(REPORT_FIXTURE.read_text()))
    assert all(set(r) <= fields for r in sidecar.reports), "a field the sidecar's schema lacks"


def test_leak_detector_rule() -> None:
    mib = 1 << 20
    d = LeakDetector(window=5, tolerance_bytes=mib)
    for i, b in enumerate([100 * mib, 101 * mib, 102 * mib, 103 * mib]):
        assert d.observe(i * 10, b, now=float(i)) is None  # window not full
    leak = d.observe(40, 104 * mib, now=4.0)
    assert leak is not None and leak.bytes_per_second == pytest.approx(mib)
    assert leak.bytes_per_step == pytest.approx(mib / 10) and leak.since_step == 0
    assert d.observe(50, 104 * mib, now=5.0) is None, "a flat check ends it"
    # Within tolerance: noise.
    d = LeakDetector(window=3, tolerance_bytes=mib)
    assert [d.observe(i, 100 * mib + i * 1000, now=i) for i in range(3)][-1] is None
    # A rise then a plateau (optimizer state): not a leak, however large the rise.
    d = LeakDetector(window=3, tolerance_bytes=0)
    assert [d.observe(i, b, now=i) for i, b in enumerate([mib, 50 * mib, 50 * mib, 50 * mib])][-1] is None
    with pytest.raises(ValueError):
        LeakDetector(window=1)


# --- the figures, read for real -------------------------------------------------------------------


def test_report_figures_are_mlx_s_own(sidecar: FakeSidecar) -> None:
    mx.clear_cache()
    keep = mx.ones((1000, 1000))
    tmp = keep * 3
    mx.eval(keep, tmp)
    del tmp  # 4 MB into the cache
    guard = Guard(signal_file="", sidecar_url=sidecar.url, env={"MEMGUARD_BATCH_SIZE": "2"}, background=False)
    body = MicroBatcher(guard, set_limits=False).report(step=4)
    assert body is not None
    active, cache, peak = mx.get_active_memory(), mx.get_cache_memory(), mx.get_peak_memory()
    assert body == {
        "framework": "mlx",
        "allocated_bytes": active,
        "reserved_bytes": active + cache,
        "peak_bytes": peak,
        "step": 4,
        "batch_size": 2,
    }
    assert active >= 4_000_000 and cache >= 4_000_000
    assert sidecar.reports == [body]


def test_older_mx_metal_names_are_used_when_the_new_ones_are_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    # MLX before 0.25 had only mx.metal.get_*_memory; 0.32 still has them, deprecated.
    for name in ("get_active_memory", "get_peak_memory", "get_cache_memory"):
        monkeypatch.delattr(mx, name)
    keep = mx.ones((500, 500))
    mx.eval(keep)
    figures = mg_mlx.memory()
    assert figures is not None
    assert figures["allocated_bytes"] == mx.metal.get_active_memory() >= 1_000_000
    assert figures["reserved_bytes"] == figures["allocated_bytes"] + mx.metal.get_cache_memory()


# --- mlx_lm: a LoRA fine-tune with mlx_lm's own model and loss ------------------------------------

def tiny_lora_llama(seed: int) -> nn.Module:
    from mlx_lm.models import llama
    from mlx_lm.tuner.utils import linear_to_lora_layers

    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=64,
    )
    model = llama.Model(args)
    model.freeze()
    linear_to_lora_layers(model, 2, {"rank": 4, "scale": 10.0, "dropout": 0.0})
    # LoRA's B starts at zero (so A's gradient is zero): start from a random adapter instead,
    # so that every adapter weight has a gradient to compare.
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.02, model.trainable_parameters()))
    mx.eval(model.parameters())
    return model


def token_batch(step: int, rows: int = 12, length: int = 20) -> Tuple[mx.array, mx.array]:
    key = mx.random.key(100 + step)
    tokens = mx.random.randint(0, 64, (rows, length), key=key)
    # Different lengths per row: mlx_lm's loss is a mean over tokens, not rows.
    lengths = mx.array([[0, 4 + (3 * r + step) % (length - 4)] for r in range(rows)])
    return tokens, lengths


def test_mlx_lm_lora_gradient_micro_batched_equals_the_full_batch() -> None:
    from mlx_lm.tuner.trainer import default_loss

    model = tiny_lora_llama(0)
    batch = token_batch(0)
    (full_loss, full_toks), full = nn.value_and_grad(model, default_loss)(model, *batch)
    assert len(tree_flatten(full)) == 28, "the gradients are the adapters' only"
    for micro in (1, 5, 12):
        (loss, toks), grads = MicroBatcher(fixed_guard(micro), set_limits=False).value_and_grad(
            model, default_loss, batch
        )
        assert toks.item() == full_toks.item()
        assert loss.item() == pytest.approx(full_loss.item(), rel=1e-5)
        assert_trees_close(grads, full, rtol=1e-4, atol=1e-6)


def lora_run(signal_path: Path, downgrade_at: int, steps: int = 6) -> Tuple[List[float], Any, List[int]]:
    """The recipe of docs/python-client.md: mlx_lm's model, LoRA layers and default_loss,
    SGD (Adam's division by the root of tiny second moments would amplify rounding), one
    optimizer update per batch, the batch split by the signal."""
    from mlx_lm.tuner.trainer import default_loss

    write_atomic(signal_path, signal_dict(1, batch=12, accum=1))
    age(signal_path)
    model = tiny_lora_llama(1)
    optimizer = optim.SGD(learning_rate=0.5)
    batcher = MicroBatcher(Guard(signal_file=str(signal_path), sidecar_url="", env={}), set_limits=False)
    losses, sizes = [], []
    for step in range(steps):
        if step == downgrade_at:
            write_atomic(signal_path, signal_dict(2, batch=3, accum=4, level="downgrade"))
            age(signal_path)
        batcher.refresh()
        (loss, _), grads = batcher.value_and_grad(model, default_loss, token_batch(step))
        optimizer.update(model, grads)
        mx.eval(model.parameters(), optimizer.state, loss)
        losses.append(loss.item())
        sizes.append(batcher.micro_batch_size)
        batcher.end_step(step)
    return losses, model.trainable_parameters(), sizes


def test_mlx_lm_lora_fine_tune_follows_the_signal_and_trains_the_same(tmp_path: Path) -> None:
    ref_losses, ref_params, ref_sizes = lora_run(tmp_path / "a.json", downgrade_at=99)
    losses, params, sizes = lora_run(tmp_path / "b.json", downgrade_at=2)
    assert ref_sizes == [12] * 6 and sizes == [12, 12, 3, 3, 3, 3]
    assert losses == pytest.approx(ref_losses, rel=1e-4)
    assert losses[-1] < losses[0], "it trains"
    assert_trees_close(params, ref_params, rtol=1e-4, atol=1e-5)
