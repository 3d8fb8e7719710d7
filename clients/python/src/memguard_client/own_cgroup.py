"""The trainer container's own memory cgroup, read for a sidecar that cannot read it.

The sidecar reads the trainer's cgroup through ``/proc/<pid>/root``, which the kernel opens only
for a reader with the trainer's uid *and* gid. A trainer image that maps the trainer's uid to
its own group, in a pod with no ``runAsGroup``, leaves the sidecar on the summed RSS: no cgroup
limit, no OOM kill counted (issue 37, item 6). So the client reads its own cgroup and sends the
figures with its reports as ``container_memory``; the sidecar uses them only where its own
reading has no cgroup.

The client sends them always, at a low rate, rather than on the sidecar's request: the
signal carries no such request, a report the sidecar does not need costs it nothing, and the
figures are already there when the sidecar finds it cannot read the cgroup. A read is a handful
of small cgroupfs files (tens of microseconds); it happens at most once every
``every`` seconds, except that a moved ``oom_kill`` counter (one file) is sent at once: the kill
of a worker process is reported by the process that survived it.

Nothing here raises: a cgroup that cannot be found or read gives ``None`` and a field that
cannot be read is left out (unknown), never sent as 0.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

#: v1 limits at or above this are the kernel's "unlimited" (the page-counter maximum).
V1_UNLIMITED = 1 << 62
#: What the report says for "no limit" (memguard_api::container_memory::UNLIMITED).
UNLIMITED = "max"
#: Seconds between two full reads.
DEFAULT_EVERY = 1.0


def _read(path: str) -> Optional[str]:
    try:
        with open(path, "r") as f:
            return f.read()
    except OSError:
        return None


def _number(text: Optional[str]) -> Optional[int]:
    if text is None:
        return None
    try:
        n = int(text.strip())
    except ValueError:
        return None
    return n if n >= 0 else None


def _keyed(text: Optional[str], key: str) -> Optional[int]:
    """The value of ``key`` in a flat-keyed file (memory.stat, memory.events, oom_control)."""
    if text is None:
        return None
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == key:
            return _number(parts[1])
    return None


def _limit(text: Optional[str], version: int) -> Optional[Any]:
    if text is None:
        return None
    if text.strip() == UNLIMITED:
        return UNLIMITED
    n = _number(text)
    if n is None or n == 0:
        return None
    return UNLIMITED if version == 1 and n >= V1_UNLIMITED else n


def cgroup_path(proc_cgroup: str, version: int) -> Optional[str]:
    """The memory cgroup path in ``/proc/self/cgroup`` text: the ``memory`` controller's line
    (v1) or the ``0::`` line (v2)."""
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if version == 1 and "memory" in controllers.split(","):
            return path
        if version == 2 and hid == "0" and controllers == "":
            return path
    return None


def _mounts(mountinfo: str) -> List[Tuple[int, str, str]]:
    """(version, root, mount point) of each memory-capable cgroup mount in mountinfo text."""
    out = []
    for line in mountinfo.splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, point = _unescape(fields[3]), _unescape(fields[4])
        fstype, options = tail[0], tail[2].split(",")
        if fstype == "cgroup" and "memory" in options:
            out.append((1, root, point))
        elif fstype == "cgroup2":
            out.append((2, root, point))
    return out


def _unescape(field: str) -> str:
    """mountinfo's octal escapes (``\\040`` for a space)."""
    if "\\" not in field:
        return field
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 4 <= len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def locate(proc_cgroup: str, mountinfo: str) -> Optional[Tuple[str, int]]:
    """The directory of this process's memory cgroup as mounted here, and its version (1 or 2):
    the cgroup path made relative to the root of the mount that shows it (a container's mount
    shows its own cgroup at ``/sys/fs/cgroup``). v1's memory controller wins on a hybrid host,
    as it is the one that limits memory there. ``None``: not visible here."""
    mounts = _mounts(mountinfo)
    for version in (1, 2):
        path = cgroup_path(proc_cgroup, version)
        if path is None or ".." in path.split("/"):
            continue
        for v, root, point in mounts:
            if v != version:
                continue
            root = root.rstrip("/")
            if path != root and not path.startswith(root + "/"):
                continue
            rel = path[len(root) :].lstrip("/")
            d = os.path.join(point, rel) if rel else point
            probe = "memory.usage_in_bytes" if version == 1 else "memory.current"
            if os.path.exists(os.path.join(d, probe)):
                return d, version
    return None


def read_figures(directory: str, version: int) -> Dict[str, Any]:
    """The ``container_memory`` object of a report, from a cgroup directory. Fields that could
    not be read are left out."""
    j = lambda name: os.path.join(directory, name)  # noqa: E731
    fig: Dict[str, Any] = {"cgroup_version": version}
    try:
        fig["cgroup_inode"] = os.stat(directory).st_ino
    except OSError:
        pass
    if version == 1:
        usage = _number(_read(j("memory.usage_in_bytes")))
        inactive = _keyed(_read(j("memory.stat")), "total_inactive_file")
        fig["max"] = _limit(_read(j("memory.limit_in_bytes")), 1)
        fig["peak_bytes"] = _number(_read(j("memory.max_usage_in_bytes")))
        fig["oom_kill"] = _keyed(_read(j("memory.oom_control")), "oom_kill")
    else:
        usage = _number(_read(j("memory.current")))
        inactive = _keyed(_read(j("memory.stat")), "inactive_file")
        fig["max"] = _limit(_read(j("memory.max")), 2)
        fig["high"] = _limit(_read(j("memory.high")), 2)
        fig["peak_bytes"] = _number(_read(j("memory.peak")))
        fig["oom_kill"] = _keyed(_read(j("memory.events")), "oom_kill")
    fig["usage_bytes"] = usage
    # Read after the usage, the cache may have grown past it: never more than the usage.
    if inactive is not None and usage is not None:
        inactive = min(inactive, usage)
    fig["inactive_file_bytes"] = inactive
    return {k: v for k, v in fig.items() if v is not None}


def _oom_kill(directory: str, version: int) -> Optional[int]:
    name = "memory.oom_control" if version == 1 else "memory.events"
    return _keyed(_read(os.path.join(directory, name)), "oom_kill")


class OwnCgroup:
    """This container's memory cgroup, found once, read at most every ``every`` seconds.

    Args:
        proc_self: the process's procfs directory (tests pass a child's ``/proc/<pid>``).
        every: seconds between two full reads.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self,
        proc_self: str = "/proc/self",
        every: float = DEFAULT_EVERY,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._proc_self = proc_self
        self._every = float(every)
        self._clock = clock
        self._located = False
        self._where: Optional[Tuple[str, int]] = None
        self._last_read: Optional[float] = None
        self._last_kills: Optional[int] = None
        self._kills_at_start: Optional[int] = None

    def stop(self) -> None:
        """Never read again (a sidecar that refuses the figures)."""
        self._located = True
        self._where = None

    def where(self) -> Optional[Tuple[str, int]]:
        """The cgroup directory and version, found on first use (``None``: not visible)."""
        if not self._located:
            self._located = True
            cg = _read(os.path.join(self._proc_self, "cgroup"))
            mi = _read(os.path.join(self._proc_self, "mountinfo"))
            if cg is not None and mi is not None:
                self._where = locate(cg, mi)
        return self._where

    def start(self) -> None:
        """Reads the OOM-kill counter as it is when the client starts: each report carries it
        (``oom_kill_at_start``), so a kill before the first report the sidecar got (one sent
        before it listened, or while it still looked for the cgroup itself) is counted, and
        one before this start is not. One small file; the first read does it otherwise."""
        where = self.where()
        if where is not None and self._kills_at_start is None:
            self._kills_at_start = _oom_kill(*where)

    def read(self) -> Optional[Dict[str, Any]]:
        """The figures now, whatever the rate."""
        where = self.where()
        if where is None:
            return None
        fig = read_figures(*where)
        self._last_read = self._clock()
        self._last_kills = fig.get("oom_kill", self._last_kills)
        if self._kills_at_start is None:
            self._kills_at_start = self._last_kills
        if self._kills_at_start is not None and "oom_kill" in fig:
            fig["oom_kill_at_start"] = min(self._kills_at_start, fig["oom_kill"])
        return fig

    def due(self) -> Optional[Dict[str, Any]]:
        """The figures when a report should carry them: ``every`` seconds after the last read,
        or at once when the OOM-kill counter moved. ``None`` otherwise."""
        where = self.where()
        if where is None:
            return None
        now = self._clock()
        if self._last_read is None or now - self._last_read >= self._every:
            return self.read()
        kills = _oom_kill(*where)
        if kills is not None and kills != self._last_kills:
            return self.read()
        return None
