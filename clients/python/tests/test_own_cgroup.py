"""The client's reader of its own container's memory cgroup (own_cgroup.py): located through
mountinfo as a container sees it, and read from a real cgroup v1 with a real OOM kill of a
worker process that the surviving process reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import SRC, FakeSidecar
from memguard_client import Guard
from memguard_client.own_cgroup import OwnCgroup, locate, read_figures

V1_ROOT = Path("/sys/fs/cgroup/memory")
CI = os.environ.get("CI") == "true"
MIB = 1 << 20


def test_a_v1_container_sees_its_own_cgroup_at_the_mount_point(tmp_path: Path) -> None:
    # runc's v1 container: /proc/self/cgroup names the host path, the memory hierarchy is
    # bind-mounted at the container's own cgroup (mountinfo's root field).
    point = tmp_path / "memory"
    point.mkdir()
    (point / "memory.usage_in_bytes").write_text("4096\n")
    cgroup = "12:pids:/libpod_parent/libpod-ab\n4:memory:/libpod_parent/libpod-ab\n1:name=systemd:/x\n"
    mountinfo = (
        "93 89 0:32 /libpod_parent/libpod-ab " + str(point)
        + " ro,nosuid,nodev,noexec,relatime - cgroup cgroup rw,memory\n"
        "94 89 0:33 /libpod_parent/libpod-ab /sys/fs/cgroup/pids ro - cgroup cgroup rw,pids\n"
    )
    assert locate(cgroup, mountinfo) == (str(point), 1)
    # The same cgroup seen from the host (the whole hierarchy mounted): path under the root.
    (point / "libpod_parent/libpod-ab").mkdir(parents=True)
    (point / "libpod_parent/libpod-ab/memory.usage_in_bytes").write_text("1\n")
    host = "30 25 0:32 / " + str(point) + " rw - cgroup cgroup rw,memory\n"
    assert locate(cgroup, host) == (str(point / "libpod_parent/libpod-ab"), 1)


def test_a_v2_container_in_its_cgroup_namespace_and_what_is_not_visible(tmp_path: Path) -> None:
    (tmp_path / "memory.current").write_text("1\n")
    mountinfo = f"700 690 0:29 / {tmp_path} ro,nosuid - cgroup2 cgroup2 rw\n"
    assert locate("0::/\n", mountinfo) == (str(tmp_path), 2)
    # Outside the namespace (`/../x`), or no memory files: not visible, never guessed.
    assert locate("0::/../sibling\n", mountinfo) is None
    assert locate("0::/\n", f"700 690 0:29 / {tmp_path / 'gone'} ro - cgroup2 cgroup2 rw\n") is None
    assert locate("garbage", "garbage") is None


def test_v2_figures_and_what_is_left_out(tmp_path: Path) -> None:
    for name, text in {
        "memory.current": "500\n",
        "memory.max": "max\n",
        "memory.high": "400\n",
        "memory.stat": "anon 300\ninactive_file 900\nactive_file 10\n",
        "memory.events": "low 0\nhigh 3\nmax 7\noom 2\noom_kill 2\noom_group_kill 0\n",
    }.items():
        (tmp_path / name).write_text(text)
    fig = read_figures(str(tmp_path), 2)
    assert fig == {
        "cgroup_version": 2,
        "cgroup_inode": os.stat(tmp_path).st_ino,
        "usage_bytes": 500,
        # Read after the usage, the cache grew past it: clamped, as the sidecar refuses more.
        "inactive_file_bytes": 500,
        "max": "max",
        "high": 400,
        "oom_kill": 2,
    }, "no memory.peak (kernel < 5.19): left out, not 0"


@pytest.fixture
def v1_cgroup():
    if os.geteuid() != 0 or not (V1_ROOT / "memory.limit_in_bytes").exists():
        why = "needs root and a cgroup v1 memory controller"
        if CI:
            pytest.fail(why)
        pytest.skip(why)
    path = V1_ROOT / f"memguard-own-cgroup-{os.getpid()}"
    path.mkdir()
    try:
        (path / "memory.limit_in_bytes").write_text(str(96 * MIB))
        # No swap to escape to: the worker is OOM-killed at the limit.
        swap = path / "memory.memsw.limit_in_bytes"
        if swap.exists():
            swap.write_text(str(96 * MIB))
        (path / "memory.swappiness").write_text("0")
        yield path
    finally:
        for pid in (path / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), 9)
            except OSError:
                pass
        for _ in range(50):
            try:
                path.rmdir()
                break
            except OSError:  # the killed processes leave it a moment later
                time.sleep(0.1)


#: Runs inside the cgroup: reads its figures, has a worker OOM-killed, reports what it sees.
TRAINER = textwrap.dedent(
    """
    import json, os, signal, sys, time
    from memguard_client.own_cgroup import OwnCgroup
    own = OwnCgroup(every=3600)
    own.start()
    before = own.due()
    assert own.due() is None, "within the interval and no kill: nothing to send"
    worker = os.fork()
    if worker == 0:
        chunks = [bytearray(8 << 20) for _ in range(64)]  # 512 MiB > the 96 MiB limit
        os._exit(0)
    _, status = os.waitpid(worker, 0)
    after = own.due()  # the counter moved: sent at once despite the interval
    print(json.dumps({"before": before, "after": after,
                      "worker_signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}))
    """
)


def test_a_surviving_process_reads_its_real_v1_cgroup_and_the_kill_of_its_worker(v1_cgroup: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(SRC))
    # The shell joins the cgroup, then becomes the trainer: it runs there from its first line.
    p = subprocess.run(
        ["/bin/sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(v1_cgroup), sys.executable, "-c", TRAINER],
        env=env, capture_output=True, text=True, timeout=60,
    )
    assert p.returncode == 0, p.stderr
    seen = json.loads(p.stdout)
    assert seen["worker_signal"] == 9, "the kernel OOM-killed the worker"
    before, after = seen["before"], seen["after"]
    inode = os.stat(v1_cgroup).st_ino
    for fig in (before, after):
        assert fig["cgroup_version"] == 1 and fig["cgroup_inode"] == inode, fig
        assert fig["max"] == 96 * MIB, fig
        assert 0 < fig["usage_bytes"] <= 96 * MIB, fig
    assert before["oom_kill"] == 0 and after["oom_kill"] == 1, (before, after)
    # The counter at the client's start rides along: a sidecar that gets only `after` still
    # counts its kill.
    assert before["oom_kill_at_start"] == after["oom_kill_at_start"] == 0, (before, after)
    # The kernel's own figures agree: its counter, and a peak at the limit.
    assert "oom_kill 1" in (v1_cgroup / "memory.oom_control").read_text()
    assert after["peak_bytes"] >= 90 * MIB, after


def test_the_guard_sends_its_cgroup_at_a_low_rate_beside_its_figures(sidecar: FakeSidecar) -> None:
    g = Guard(sidecar_url=sidecar.url, env={}, background=False)
    assert g.report(step=1) and g.report(step=2)
    assert sidecar.reports == [{"step": 1}, {"step": 2}]
    where = OwnCgroup().where()
    if where is None:
        assert sidecar.container_memory == [], "no cgroup visible: nothing sent"
        return
    # Once: the second report came within the interval, with no OOM kill between.
    assert len(sidecar.container_memory) == 1, sidecar.container_memory
    fig = sidecar.container_memory[0]
    assert fig["cgroup_version"] == where[1] and fig["usage_bytes"] > 0, fig


def test_a_sidecar_that_refuses_the_figures_still_gets_the_report_and_never_them_again(sidecar: FakeSidecar) -> None:
    if OwnCgroup().where() is None:
        pytest.fail("this test needs a visible memory cgroup (every Linux host and container has one)")
    sidecar.unknown_fields = {"container_memory"}
    g = Guard(sidecar_url=sidecar.url, env={}, background=False)
    assert g.report(step=1) is True, "sent again without the figures, and accepted"
    assert [set(b) for b in sidecar.refused] == [{"step", "container_memory"}]
    assert sidecar.reports == [{"step": 1}]
    time.sleep(0.01)
    g._own_cgroup._every = 0  # due at every report now, were it not stopped
    assert g.report(step=2) is True
    assert len(sidecar.refused) == 1 and sidecar.reports == [{"step": 1}, {"step": 2}]
