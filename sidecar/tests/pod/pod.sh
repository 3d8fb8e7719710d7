#!/bin/sh
# A pod without a container runtime. Run as PID 1 of a new PID namespace with its own /proc
# (`unshare --pid --fork --mount-proc`), as root. Like a pod with shareProcessNamespace: a pause
# process (PID 1), a trainer and a sidecar, each in its own cgroup and its own mount namespace,
# each with the uid, gid and capabilities it would get in Kubernetes.
#
# LAYOUT decides what each container sees at /sys/fs/cgroup:
#   v1    containerd's cgroup v1 mounts: a tmpfs with the container's own memory cgroup
#         bind-mounted read-only at /sys/fs/cgroup/memory (mountinfo root = that cgroup);
#   host  the host's whole hierarchies, as a privileged or hostPath container sees them;
#   v2    a cgroup namespace rooted at the container's own cgroup, cgroup2 mounted read-only at
#         /sys/fs/cgroup (what runc does on a cgroup v2 host).
#
# Environment: LAYOUT, POD_V1 (the pod's v1 memory cgroup), POD_V2 (its v2 cgroup, for v2),
# POD_TMP (a directory every uid can read), TRAINER_ID / SIDECAR_ID / PAUSE_ID as
# "uid:gid:bounding-set", TRAINER_CMD (a shell command), SIDECAR_BIN; the sidecar's arguments
# follow on the command line. Only the sidecar writes to stderr.
set -eu

case ${1:-} in
--enter)
	# A new process in the pod: join the container's cgroups, then its own namespaces.
	name=$2 id=$3
	shift 3
	echo $$ >"$POD_V1/$name/cgroup.procs"
	nsflags=--mount
	if [ "$LAYOUT" = v2 ]; then
		echo $$ >"$POD_V2/$name/cgroup.procs"
		nsflags="--mount --cgroup"
	fi
	exec unshare $nsflags --propagation private /bin/sh "$0" --mounts "$name" "$id" "$@"
	;;
--mounts)
	# In the container's mount namespace: its /sys/fs/cgroup, then its identity.
	name=$2 id=$3
	shift 3
	uid=${id%%:*} rest=${id#*:}
	gid=${rest%%:*} caps=${rest#*:}
	case $LAYOUT in
	v1)
		stage=$POD_TMP/mnt-$name
		mkdir -p "$stage"
		mount -t tmpfs -o mode=755 tmpfs "$stage"
		mkdir "$stage/memory"
		mount --bind "$POD_V1/$name" "$stage/memory"
		mount -o remount,bind,ro "$stage/memory"
		mount --move "$stage" /sys/fs/cgroup
		;;
	v2) mount -t cgroup2 -o ro cgroup2 /sys/fs/cgroup ;;
	host) ;;
	*)
		echo "unknown LAYOUT $LAYOUT" >&2
		exit 2
		;;
	esac
	exec setpriv --reuid "$uid" --regid "$gid" --clear-groups --inh-caps=-all \
		--bounding-set="$caps" --no-new-privs "$@"
	;;
esac

/bin/sh "$0" --enter trainer "$TRAINER_ID" /bin/sh -c "$TRAINER_CMD" >"$POD_TMP/trainer.out" 2>&1 &
trainer=$!
# A kubelet starts the pause container first, and each container's process already has its final
# uid and capabilities. Here both are reached through a few execs (unshare, setpriv), so the
# sidecar starts once PID 1 is the pause process and the trainer's PID is past setpriv
# (NoNewPrivs set, no longer setpriv itself); otherwise it could meet them half-way, as root.
(
	tries=0
	until [ "$(cat /proc/1/comm 2>/dev/null)" = pause ] &&
		grep -q '^NoNewPrivs:[[:space:]]*1' /proc/$trainer/status 2>/dev/null &&
		[ "$(cat /proc/$trainer/comm 2>/dev/null)" != setpriv ]; do
		tries=$((tries + 1))
		if [ $tries -gt 1200 ]; then
			echo "pod.sh: pause or trainer did not start within 60 s" >&2
			exit 1
		fi
		sleep 0.05
	done
	exec /bin/sh "$0" --enter sidecar "$SIDECAR_ID" "$SIDECAR_BIN" "$@"
) &
exec /bin/sh "$0" --enter pause "$PAUSE_ID" "$POD_TMP/pause" infinity >/dev/null 2>&1
