"""Run untrusted, model-written Python in a throw-away, resource-limited process.

    result = await run_python("print(1 + 1)", workdir, SandboxLimits(wall_time_s=5))
    assert result.stdout == "2\\n" and result.exit_code == 0

A run, step by step. It takes one of two paths to the same sandbox: *warm* (the default) forks it
from a waiting sandbox interpreter, *cold* (`warm=False`, and the fallback) starts two fresh ones.
  1. cold: a *launcher* (`python -I -S -c <layers.py + launcher.py>`, the service's own
     interpreter) starts in a new session with a minimal environment (no inherited secrets) and is
     put in the run's cgroup; then the code is written to its stdin. It enters the user and
     network namespaces and forks the pid namespace's pid 1, waiting outside to exit the way the
     code did.
     warm: the *zygote* (`<sandbox python> -I -B -u -c <layers.py + zygote.py>`, started once per
     service process and kept privileged, see warm.py) gets the run's spec and fds (code memfd,
     stdout, stderr, status, exit) on its socket and clone3()s pid 1 straight into the run's
     cgroup and new user/network/pid namespaces (as root: a network namespace from its pool,
     entered first); pid 1 takes a new session and reports the
     code's exit status on the exit pipe itself (the code's process takes the run's stdio and
     environment after the layers).
  2. From here on both paths run the same code (layers.py): pid 1 forks the process that enters
     the mount namespace, mounts its /proc, sets no_new_privs and the rlimits, drops to a fresh
     uid and runs the bootstrap: cold by exec'ing the sandbox interpreter `python -I -B -u -c
     <bootstrap.py>` with stdin on /dev/null, warm in place (the zygote's ctypes is dropped from
     sys.modules first). pid 1 reaps orphans until the code's process ends.
  3. The bootstrap installs an audit hook, then runs the code as `__main__` with the workdir as
     cwd, HOME, TMPDIR and `sys.path[0]`, and ends the process the way the interpreter's exit
     does (non-daemon threads, atexit, flushing, clearing `__main__` and the modules the code
     imported, gc), except for the teardown of the interpreter's own modules; then `_exit`.
  4. stdout+stderr stream into one buffer capped at `max_output_bytes`. The run ends when the
     code exits, the wall clock runs out or the cap is passed; then every process of the run is
     killed: `cgroup.kill`, the process group, and, when there is no cgroup to prove the run left
     nothing (a group that could be removed is empty), a /proc scan for the run's uid (root) or
     the run's marker variable (not root), repeated until none is left.

Layers, by their `sandbox_capabilities()` names, with what each stops and what it does not:
  uid_drop          root only. A fresh uid/gid per run, no supplementary groups, workdir chowned
                    to it. Stops writes to anything not world-writable, signals/ptrace to other
                    processes, and makes RLIMIT_NPROC count exactly this run (root ignores it).
                    Does not stop reads of world-readable files (fs_allowlist hides them).
  user_namespace    not root, where unprivileged user namespaces are allowed: what makes the two
                    namespaces below possible without root; RLIMIT_NPROC then counts per run.
  network_namespace an empty network namespace of the run's own (loopback down): no TCP/UDP
                    anywhere, host loopback included, and no abstract unix socket of another run.
                    Unix sockets on the filesystem are not covered by it. Warm runs as root are
                    lent one from the zygote's pool (one run at a time; again only once every
                    process of the last run has exited, see zygote.py); elsewhere each run makes
                    its own.
  pid_namespace     the code runs as pid 2 under a small init (pid 1, forked by the launcher or
                    cloned by the zygote) that reaps orphans and exits when the code's process
                    does, and the kernel then kills everything left in the namespace, setsid or
                    not. Other processes cannot be
                    seen, signalled or ptraced, even by the same uid (which matters when not root).
  mount_namespace   a private mount tree. With fs_allowlist (below) it is the run's own root;
                    without, the host's tree, every mount re-mounted read-only and nosuid, with a
                    private tmpfs on /dev/shm (at most 64 MB, for POSIX semaphores) and an empty
                    read-only one over /run (host unix sockets). Either way the workdir is the only
                    writable place (nosuid, nodev, noexec) besides /dev/shm: it stops writes to /tmp
                    and any other world-writable place, and running binaries or loading .so files
                    written by the code. Checked after set-up: a writable mount left is an error.
  fs_allowlist      with the mount namespace: the run's root is a fresh tmpfs (pivot_root, the host's
                    tree detached) holding only what allowlist.py lists: /usr and the sandbox
                    interpreter's own folders read-only, a few copied /etc files, /dev/null, zero,
                    full, random, urandom, a private /dev/shm, its /proc, an empty read-only /tmp and
                    the workdir at its own path. Task files, run folders, checkpoints, home folders,
                    the checkout, the service's files and other workdirs are not there at all. False
                    (no mount namespace: not root without user namespaces): the host's files are NOT
                    hidden; `python.require_fs_allowlist: true` makes the service refuse to start.
  private_proc      a fresh /proc for the pid namespace (hidepid=2 where allowed): only the run's
                    processes, so no command line or environment of the service or other runs.
  no_new_privs      PR_SET_NO_NEW_PRIVS: setuid binaries (su, mount, ...) gain nothing.
  cgroup            a per-run cgroup v2 group (pure v2, or the hybrid layout's "unified" mount): an
                    exact process list and an atomic kill; it also sets pids.max / memory.max
                    where those controllers are delegated to us.
  rlimits           always: CPU seconds per process (SIGXCPU, SIGKILL a second later), address
                    space (virtual, not resident: many threads or big reservations hit it early),
                    file size, open files, no core files, processes/threads.
  audit_hook        always (Python >= 3.8), installed before the code runs and not removable from
                    Python: refuses writes (open for writing, remove, rename, mkdir, link, chmod,
                    sqlite3.connect, ...) outside the workdir, socket connect/bind/sendto/sendmsg
                    and name lookups (when network=False; unix sockets inside the workdir are
                    allowed), imports of ctypes/cffi and every ctypes event, and swapping the
                    __code__/__defaults__ of the hook's own functions. It is a tripwire for
                    Python-level calls, not a boundary: native code, C extensions (os.mkfifo,
                    dbm, ...) and any child program are not seen by it.
  audit_strict      when a kernel layer for network, filesystem or other processes is missing,
                    the hook also refuses starting programs (subprocess, os.exec*, posix_spawn,
                    os.system), gc.get_objects/get_referrers/get_referents and opening
                    /proc/<pid>/ of other processes, so the code cannot simply run another
                    interpreter without the hook. A deliberate attacker still gets past it (e.g.
                    `_posixsubprocess.fork_exec` raises no audit event): on such a host the
                    sandbox stops accidents and naive code only.

Not root (CI, laptops): no uid drop. With unprivileged user namespaces the network, pid and
mount namespaces are used as above, and they carry the weight the uid carries for root: the code
still runs as the service's own uid, but it cannot see it, signal it or write outside the
workdir. Without user namespaces only the rlimits and the strict audit hook remain: RLIMIT_NPROC
is the user's current task count plus `max_processes` (shared with everything the user runs),
signals to the user's other processes are not stopped, and cleanup finds escaped processes by
the marker variable, so one that both calls setsid and re-execs with a clean environment
survives the run. Nothing here raises because a layer is missing; `sandbox_capabilities()` says
what is active.

Other things to know:
  * The sandbox interpreter must be runnable by the dropped uid: NEMO_SANDBOX_PYTHON if set, else
    this interpreter when every directory above it is world-searchable, else /usr/local/bin or
    /usr/bin python3 (on this image the venv lives under /root, so code gets Debian's python3 and
    its packages). scipy imports ctypes and therefore fails to import in the sandbox.
  * When root, each run takes ownership of the workdir tree (chown to its uid), so two runs must
    not share a workdir at the same time. A workdir below a directory others cannot search
    (mkdtemp's 0700) is reached through the mount namespace; without one that is a ValueError.
  * No seccomp filter: the kernel's syscall surface is the host's (ctypes is refused and the
    workdir is noexec, so new native code cannot be loaded, but installed binaries can run).
  * In the pid namespace the code's own pid is 2; its parent is the sandbox's init.
  * NEMO_SANDBOX_DISABLE=uid,userns,netns,pidns,mountns,allowlist,cgroup turns layers off (tests,
    debugging).
  * With fs_allowlist the workdir must not overlap a folder shown read-only (/usr, the interpreter's
    folders) nor lie in /proc, /dev or /etc (a ValueError); its parent folders appear empty.
  * layers.py, launcher.py, zygote.py and bootstrap.py are programs, not modules: prepare.py
    reads their text and it is passed as `-c` source and argv, so the sandbox uid never has to
    read a file in the repository (the checkout may live under a 0700 home).
  * Warm runs of one zygote share what a fresh interpreter draws at start: the string hash seed
    and the address layout. Nothing a run does reaches the zygote or the next run: each run is a
    fork of a zygote that never runs code. A run cannot see or signal the zygote (pid namespace,
    other uid); a zygote that dies is restarted at the next run, and the runs in flight die with
    it. The zygote exits when the service process is gone, however it died.
  * At exit the code's C stdio buffers are not flushed (the bootstrap ends with `_exit`).

Files: runner.py (run_python: one run from start to end), limits.py, plan.py and probe.py (what
this host allows, probed once), allowlist.py (what a run's own root holds), prepare.py (uid,
workdir, launch spec), output.py (capture and
SandboxResult), cleanup.py and cgroup.py (killing every process of a run), warm.py (the zygote
from the service's side: start, check, restart, one run's pipes); the programs: layers.py (the
isolation layers), launcher.py (cold), zygote.py (warm) and bootstrap.py (the code's first code).
"""

from tools_env.sandbox.limits import SandboxLimits
from tools_env.sandbox.output import SandboxResult
from tools_env.sandbox.probe import sandbox_capabilities
from tools_env.sandbox.runner import run_python, run_python_sync

__all__ = ["SandboxLimits", "SandboxResult", "run_python", "run_python_sync", "sandbox_capabilities"]
