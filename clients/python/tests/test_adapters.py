"""Adapters with their frameworks absent, the re-chunking arithmetic, and the HF data path
through a Trainer-shaped object that follows the real Trainer's loop and loss scaling."""

from __future__ import annotations

import random
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from conftest import SRC, signal_dict, write_atomic
from memguard_client import Guard
from memguard_client.batching import batch_rows, split_batch


# --- importing without frameworks -------------------------------------------------------------


def test_package_and_adapters_import_without_any_framework() -> None:
    code = (
        "import sys\n"
        "for n in ('torch', 'transformers', 'mlx', 'mlx.core', 'mxnet'): sys.modules[n] = None\n"
        "import memguard_client, memguard_client.torch, memguard_client.mlx, memguard_client.hf\n"
        "from memguard_client.hf import MemguardCallback, _CallbackBase\n"
        "assert issubclass(MemguardCallback, _CallbackBase)\n"
        "assert memguard_client.torch.empty_cache() is False\n"
        "assert memguard_client.mlx.memory() is None\n"
        "g = memguard_client.Guard(env={})\n"
        "assert memguard_client.mlx.report_memory(g) is None\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(SRC)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_importing_the_client_imports_no_framework() -> None:
    code = (
        "import sys, memguard_client, memguard_client.torch, memguard_client.mlx\n"
        "print(sorted(n for n in ('torch', 'mlx', 'mxnet', 'numpy') if n in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env={"PYTHONPATH": str(SRC)}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_mxnet_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    from memguard_client.frameworks import mxnet_memory

    ctx = types.SimpleNamespace(num_gpus=lambda: 1, gpu_memory_info=lambda i: (300, 1000))
    monkeypatch.setitem(sys.modules, "mxnet", types.SimpleNamespace(context=ctx))
    assert mxnet_memory() == {"framework": "mxnet", "reserved_bytes": 700, "total_bytes": 1000}


def test_broken_framework_probe_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    from memguard_client.frameworks import framework_memory

    def boom() -> bool:
        raise RuntimeError("CUDA driver exploded")

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=boom)))
    for name in ("mlx.core", "mxnet"):
        monkeypatch.setitem(sys.modules, name, None)
    assert framework_memory() is None


# --- re-chunking arithmetic --------------------------------------------------------------------


@pytest.mark.parametrize("rows", list(range(1, 20)))
def test_split_covers_every_row_once_with_weights_summing_to_one(rows: int) -> None:
    batch = {"x": [[float(i)] for i in range(rows)], "y": list(range(rows)), "num_items": 7}
    for micro in range(1, 25):
        parts = split_batch(batch, micro)
        assert sum(p.weight for p in parts) == pytest.approx(1.0)
        assert [y for p in parts for y in p.data["y"]] == list(range(rows))
        assert all(p.rows <= micro for p in parts)
        assert all(p.data["num_items"] == 7 for p in parts)  # non-batch values pass through
        assert len(parts) == -(-rows // micro)


def test_batch_shapes() -> None:
    class T:
        def __init__(self, rows: int) -> None:
            self.shape = (rows, 3)
            self.rows = list(range(rows))

        def __getitem__(self, s: slice) -> "T":
            t = T(0)
            t.rows = self.rows[s]
            t.shape = (len(t.rows), 3)
            return t

    assert batch_rows(T(6)) == 6
    parts = split_batch((T(6), T(6)), 4)  # (inputs, labels) tuple of tensors
    assert [p.data[0].rows for p in parts] == [[0, 1, 2, 3], [4, 5]]
    assert isinstance(parts[0].data, tuple)
    assert batch_rows([{"a": 1}, {"a": 2}]) == 2  # a list of samples
    assert batch_rows(3.5) is None
    only = split_batch(3.5, 2)
    assert len(only) == 1 and only[0].data == 3.5 and only[0].weight == 1.0


def _mean_grad(w: List[float], xs: List[List[float]], ys: List[float]) -> List[float]:
    # d/dw of mean((w·x - y)^2 / 2)
    g = [0.0] * len(w)
    for x, y in zip(xs, ys):
        err = sum(wi * xi for wi, xi in zip(w, x)) - y
        for j, xj in enumerate(x):
            g[j] += err * xj / len(xs)
    return g


@pytest.mark.parametrize("rows, micro", [(32, 16), (32, 5), (7, 3), (12, 1), (9, 9)])
def test_weighted_micro_batch_gradients_equal_the_full_batch_gradient(rows: int, micro: int) -> None:
    rng = random.Random(rows * 100 + micro)
    w = [rng.uniform(-1, 1) for _ in range(4)]
    xs = [[rng.uniform(-1, 1) for _ in range(4)] for _ in range(rows)]
    ys = [rng.uniform(-1, 1) for _ in range(rows)]
    full = _mean_grad(w, xs, ys)
    acc = [0.0] * 4
    for part in split_batch({"x": xs, "y": ys}, micro):
        g = _mean_grad(w, part.data["x"], part.data["y"])
        acc = [a + part.weight * gi for a, gi in zip(acc, g)]
    assert acc == pytest.approx(full, rel=1e-12, abs=1e-15)


def test_numpy_micro_batches_match_full_batch_gradient() -> None:
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(0)
    x, y, w = rng.normal(size=(48, 5)), rng.normal(size=48), rng.normal(size=5)

    def grad(xb: Any, yb: Any) -> Any:
        return xb.T @ (xb @ w - yb) / len(yb)

    acc = sum(p.weight * grad(p.data[0], p.data[1]) for p in split_batch((x, y), 7))
    np.testing.assert_allclose(acc, grad(x, y), rtol=1e-12)


# --- torch helper without torch -------------------------------------------------------------------


class FakeLoss:
    def __init__(self, value: float, log: List[float]) -> None:
        self.value, self.log = value, log

    def __mul__(self, k: float) -> "FakeLoss":
        return FakeLoss(self.value * k, self.log)

    def backward(self) -> None:
        self.log.append(self.value)

    def item(self) -> float:
        return self.value


class FakeDDP:
    def __init__(self) -> None:
        self.no_sync_entered = 0

    def no_sync(self) -> Any:
        model = self

        class Ctx:
            def __enter__(self) -> None:
                model.no_sync_entered += 1

            def __exit__(self, *a: Any) -> None:
                pass

        return Ctx()


def test_micro_batcher_follows_the_guard_and_scales_losses(signal_path: Path) -> None:
    from memguard_client.torch import MicroBatcher

    write_atomic(signal_path, signal_dict(0, batch=8, accum=1))
    batcher = MicroBatcher(Guard(signal_file=str(signal_path), env={}))
    assert batcher.refresh() and batcher.micro_batch_size == 8
    backwards: List[float] = []
    model = FakeDDP()
    batch = {"y": [1.0] * 8}
    total = batcher.backward(batch, lambda mb: FakeLoss(sum(mb["y"]) / len(mb["y"]), backwards), model=model)
    assert backwards == [1.0] and total == 1.0 and model.no_sync_entered == 0
    write_atomic(signal_path, signal_dict(1, batch=3, accum=3, level="downgrade"))
    assert batcher.refresh()
    backwards.clear()
    total = batcher.backward(batch, lambda mb: FakeLoss(sum(mb["y"]) / len(mb["y"]), backwards), model=model)
    assert backwards == pytest.approx([3 / 8, 3 / 8, 2 / 8])
    assert total == pytest.approx(1.0)
    assert model.no_sync_entered == 2  # all but the last micro-batch
    assert batcher.cache_releases == 0  # no torch: nothing to release


def test_empty_cache_after_downgrade_when_cuda_is_available(signal_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memguard_client.torch import MicroBatcher

    calls: List[int] = []
    cuda = types.SimpleNamespace(is_available=lambda: True, empty_cache=lambda: calls.append(1))
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
    write_atomic(signal_path, signal_dict(0, batch=8, accum=1))
    batcher = MicroBatcher(Guard(signal_file=str(signal_path), env={"MEMGUARD_BATCH_SIZE": "8"}))
    batcher.refresh()
    assert calls == []  # same size: no release
    write_atomic(signal_path, signal_dict(1, batch=4, accum=2))
    batcher.refresh()
    assert calls == [1] and batcher.cache_releases == 1


# --- the HF adapter on a Trainer-shaped object ---------------------------------------------------


class Model:
    """y ≈ w·x, gradients accumulate in .grad as autograd would."""

    def __init__(self) -> None:
        self.w = [0.5, -0.25, 0.1]
        self.grad = [0.0, 0.0, 0.0]
        self.rows_forwarded: List[int] = []
        self.is_gradient_checkpointing = False

    def gradient_checkpointing_enable(self) -> None:
        self.is_gradient_checkpointing = True


class Loss:
    """A differentiable scalar: value and d(value)/dw."""

    def __init__(self, value: float, dw: List[float]) -> None:
        self.value, self.dw = value, dw

    def __mul__(self, k: float) -> "Loss":
        return Loss(self.value * k, [d * k for d in self.dw])

    def __truediv__(self, k: float) -> "Loss":
        return self * (1.0 / k)

    def __add__(self, other: "Loss") -> "Loss":
        return Loss(self.value + other.value, [a + b for a, b in zip(self.dw, other.dw)])

    def detach(self) -> "Loss":
        return self


class FakeAccelerator:
    distributed_type = "DistributedType.NO"

    def __init__(self) -> None:
        self.no_sync_calls = 0

    def backward(self, loss: Loss, model: Model) -> None:
        model.grad = [g + d for g, d in zip(model.grad, loss.dw)]

    def no_sync(self, model: Any) -> Any:
        self.no_sync_calls += 1
        import contextlib

        return contextlib.nullcontext()


class MiniTrainer:
    """The shape of transformers.Trainer's inner loop (5.x): batches of `batch` rows from a
    loader built once, `accum` batches per optimizer step, `training_step` →
    `compute_loss` → divide by current_gradient_accumulation_steps unless the loss is already
    normalised by `num_items_in_batch` → `accelerator.backward`."""

    def __init__(self, data: List[Dict[str, Any]], batch: int, accum: int, lr: float, sum_loss: bool = False) -> None:
        self.model = Model()
        self.data, self.batch, self.accum, self.lr = data, batch, accum, lr
        self.accelerator = FakeAccelerator()
        self.callbacks: List[Any] = []
        self.model_accepts_loss_kwargs = sum_loss
        self.compute_loss_func = None
        self.current_gradient_accumulation_steps = accum
        self.samples_seen = 0
        self.args = types.SimpleNamespace(per_device_train_batch_size=batch, gradient_accumulation_steps=accum)

    def add_callback(self, cb: Any) -> None:
        self.callbacks.append(cb)

    def compute_loss(self, model: Model, inputs: Dict[str, Any], return_outputs: bool = False, num_items_in_batch: Optional[int] = None) -> Any:
        xs, ys = inputs["x"], inputs["y"]
        model.rows_forwarded.append(len(ys))
        value, dw = 0.0, [0.0] * 3
        for x, y in zip(xs, ys):
            err = sum(wi * xi for wi, xi in zip(model.w, x)) - y
            value += err * err / 2
            dw = [d + err * xi for d, xi in zip(dw, x)]
        n = num_items_in_batch if (self.model_accepts_loss_kwargs and num_items_in_batch) else len(ys)
        loss = Loss(value / n, [d / n for d in dw])
        return (loss, None) if return_outputs else loss

    def training_step(self, model: Model, inputs: Dict[str, Any], num_items_in_batch: Optional[int] = None) -> Loss:
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if not (self.model_accepts_loss_kwargs and num_items_in_batch is not None):
            loss = loss / self.current_gradient_accumulation_steps
        self.accelerator.backward(loss, model)
        return loss.detach()

    def train(self, on_step: Any = None) -> float:
        # The loader is built ONCE from the batch size, like Trainer.get_train_dataloader.
        loader = [self.data[i : i + self.batch] for i in range(0, len(self.data), self.batch)]
        total_loss = 0.0
        for cb in self.callbacks:
            cb.on_train_begin(self.args, None, None, model=self.model)
        for step_start in range(0, len(loader), self.accum):
            group = loader[step_start : step_start + self.accum]
            self.current_gradient_accumulation_steps = len(group)
            num_items = sum(len(b) for b in group)
            if on_step:
                on_step(step_start // self.accum)
            for cb in self.callbacks:
                cb.on_step_begin(self.args, None, None, model=self.model)
            for rows in group:
                inputs = {"x": [r[0] for r in rows], "y": [r[1] for r in rows]}
                self.samples_seen += len(rows)
                total_loss += self.training_step(self.model, inputs, num_items).value
            self.model.w = [w - self.lr * g for w, g in zip(self.model.w, self.model.grad)]
            self.model.grad = [0.0, 0.0, 0.0]
        return total_loss


def _dataset(n: int) -> List[Any]:
    rng = random.Random(42)
    out = []
    for _ in range(n):
        x = [rng.uniform(-1, 1) for _ in range(3)]
        out.append((x, 2 * x[0] - x[1] + 0.5 * x[2] + rng.gauss(0, 0.01)))
    return out


@pytest.mark.parametrize("sum_loss", [False, True], ids=["mean-loss", "num-items-loss"])
def test_hf_adapter_rechunks_batches_and_keeps_the_training_identical(signal_path: Path, sum_loss: bool) -> None:
    from memguard_client.hf import attach

    data = _dataset(96)
    reference = MiniTrainer(data, batch=8, accum=2, lr=0.3, sum_loss=sum_loss)
    ref_loss = reference.train()
    assert set(reference.model.rows_forwarded) == {8}

    write_atomic(signal_path, signal_dict(0, batch=8, accum=2))
    trainer = MiniTrainer(data, batch=8, accum=2, lr=0.3, sum_loss=sum_loss)
    cb = attach(trainer, Guard(signal_file=str(signal_path), env={}))
    assert trainer.callbacks == [cb] and cb.attached

    def sidecar(step: int) -> None:
        if step == 2:
            write_atomic(signal_path, signal_dict(1, batch=4, accum=4, level="downgrade"))
        if step == 4:
            write_atomic(signal_path, signal_dict(2, batch=3, accum=6, level="critical", grad_checkpointing=True))

    loss = trainer.train(on_step=sidecar)
    # What the Trainer does not notice: same steps, same samples, same weights, same loss.
    assert trainer.samples_seen == reference.samples_seen == 96
    assert trainer.model.w == pytest.approx(reference.model.w, rel=1e-12)
    assert loss == pytest.approx(ref_loss, rel=1e-12)
    # What memguard changed: the rows each forward pass sees, i.e. the activation memory.
    rows = trainer.model.rows_forwarded
    assert rows[:4] == [8, 8, 8, 8]  # steps 0-1 at the starting size
    assert rows[4:12] == [4, 4] * 4  # steps 2-3 at 4
    assert set(rows[12:]) == {3, 2} and max(rows[12:]) == 3
    assert sum(rows) == 96
    assert cb.downgrades == 2
    assert trainer.model.is_gradient_checkpointing
    assert trainer.accelerator.no_sync_calls > 0
    # The anchor's bug, for the record: args still says 8, and that is fine because it is not read.
    assert trainer.args.per_device_train_batch_size == 8


def test_hf_callback_without_attach_warns_and_changes_nothing(caplog: pytest.LogCaptureFixture) -> None:
    from memguard_client.hf import MemguardCallback

    cb = MemguardCallback(Guard(env={}))
    with caplog.at_level("WARNING"):
        cb.on_train_begin(None, None, None)
    assert "attach" in caplog.text


@pytest.mark.parametrize("loss_kwargs", [False, True], ids=["mean-loss", "num-items-loss"])
def test_real_transformers_trainer_rechunks(tmp_path: Path, loss_kwargs: bool) -> None:
    """A real tiny Trainer run with a downgrade after step 2; skipped where torch,
    transformers and accelerate are not installed."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from memguard_client.hf import attach

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)
            self.rows: List[int] = []

        def forward(self, x: Any, labels: Any = None, **kwargs: Any) -> Any:
            self.rows.append(x.shape[0])
            out = self.lin(x).squeeze(-1)
            n = kwargs.get("num_items_in_batch")
            if n is not None:
                loss = ((out - labels) ** 2).sum() / n  # normalised over the accumulated batch
            else:
                loss = torch.nn.functional.mse_loss(out, labels)
            return {"loss": loss, "logits": out}

    if not loss_kwargs:
        Tiny.forward.__signature__ = __import__("inspect").signature(  # type: ignore[attr-defined]
            lambda self, x, labels=None: None
        )
    data = [{"x": torch.tensor(x), "labels": torch.tensor(y)} for x, y in _dataset(64)]
    signal = tmp_path / "signal.json"

    class Sidecar(transformers.TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if state.global_step == 2:
                write_atomic(signal, signal_dict(1, batch=3, accum=6, level="downgrade"))

    def run(with_guard: bool) -> Any:
        torch.manual_seed(0)
        model = Tiny()
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / str(with_guard)), per_device_train_batch_size=8,
            gradient_accumulation_steps=2, num_train_epochs=1, learning_rate=0.1,
            report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
            dataloader_drop_last=False,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        assert trainer.model_accepts_loss_kwargs == loss_kwargs
        if with_guard:
            write_atomic(signal, signal_dict(0, batch=8, accum=2))
            cb = attach(trainer, Guard(signal_file=str(signal), env={}))
            trainer.add_callback(Sidecar())
        trainer.train()
        if with_guard:
            assert cb.downgrades == 1
        return model

    ref, guarded = run(False), run(True)
    assert set(ref.rows) == {8}
    # Steps 0 and 1 (2 batches of 8 each) at the starting size, then micro-batches of <= 3.
    assert guarded.rows[:4] == [8, 8, 8, 8] and max(guarded.rows[4:]) == 3
    assert sum(guarded.rows) == sum(ref.rows) == 64
    for a, b in zip(ref.parameters(), guarded.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_real_torch_micro_batcher_gradient_equals_full_batch(signal_path: Path) -> None:
    """Skipped where torch is not installed."""
    torch = pytest.importorskip("torch")
    from memguard_client.torch import MicroBatcher

    torch.manual_seed(0)
    x, y = torch.randn(16, 4), torch.randn(16)
    model = torch.nn.Linear(4, 1)

    def loss_fn(mb: Any) -> Any:
        return torch.nn.functional.mse_loss(model(mb[0]).squeeze(-1), mb[1])

    loss_fn((x, y)).backward()
    full = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    write_atomic(signal_path, signal_dict(3, batch=5, accum=4, level="critical"))
    batcher = MicroBatcher(Guard(signal_file=str(signal_path), env={"MEMGUARD_BATCH_SIZE": "16"}))
    assert batcher.refresh() and batcher.micro_batch_size == 5
    value = batcher.backward((x, y), loss_fn, model=model)
    assert value == pytest.approx(float(loss_fn((x, y)).detach()), rel=1e-6)
    for p, g in zip(model.parameters(), full):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-7)
