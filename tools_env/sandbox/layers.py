# The isolation layers, shared by the two programs that start a run: launcher.py (the cold path:
# a fresh interpreter per run) and zygote.py (the warm path: a fork of a waiting interpreter).
# A program fragment, not a module of the package: prepare.py reads this file and puts it in front
# of either program's text, which is then run with `-c`. Privileged, single-threaded, stdlib only.
# (Comments, not a docstring: in the zygote this text is the `__main__` module the code runs in.)
# The program sets these globals before enter_layers(): spec (from _launch_spec), status (the
# status fd: "layers {json}" or "error <what>" lines), wd, probe, libc (load_libc()), done (layer
# -> entered) and exit_fd (warm only, else None: where the process that stays outside the run
# reports the code's wait status).
import ctypes, json, os, re, resource, signal, sys

NEWNS, NEWUSER, NEWPID, NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
KEEP = NOSUID | NODEV | NOEXEC | 1024 | 2048 | (1 << 21)  # + noatime, nodiratime, relatime
STRICTATIME = 1 << 24
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
MNT_DETACH = 2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}.get(os.uname().machine)
PSEUDO = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs",
          "pstore", "bpf", "fusectl", "configfs", "binfmt_misc", "autofs", "efivarfs", "rpc_pipefs", "nsfs"}
to_outside = None  # pid 1's pipe to the process outside the pid namespace
init_closes = (0, 1, 2)  # what pid 1 closes once it has forked the code's process
new_root = None  # with the allowlist: where the run's root is built before pivot_root makes it "/"
lent_netns = None  # warm: the fd of the empty network namespace the zygote lent this run, if any

def load_libc():
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    return lib

def say(line):
    os.write(status, (line + "\n").encode())

def check(ret):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

def fail(code=125):
    """Exit with `code`; a process that still holds the exit fd reports it there first."""
    if exit_fd is not None:
        os.write(exit_fd, str(code << 8).encode())
    os._exit(code)

def mount(src, dst, fstype, flags, data=None):
    b = lambda s: None if s is None else s.encode()
    check(libc.mount(b(src), b(dst), b(fstype), flags, b(data)))

def remount(path, add, drop=0):
    keep = os.statvfs(path).f_flag & KEEP & ~drop
    try:
        mount(None, path, None, REMOUNT | BIND | add | keep)
    except PermissionError:  # inside a user namespace an inherited strictatime mount must stay so
        mount(None, path, None, REMOUNT | BIND | add | keep | STRICTATIME)

def mountpoints():
    """(mount point, fs type) of every mount, from /proc/self/mountinfo (read without io objects
    and regexes where no name is escaped: in a forked process each page written is a fault)."""
    fd = os.open("/proc/self/mountinfo", os.O_RDONLY)
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    os.close(fd)
    for line in b"".join(chunks).decode("utf-8", "surrogateescape").splitlines():
        f = line.split()
        path = f[4] if "\\" not in f[4] else re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), f[4])
        yield path, f[f.index("-") + 1]

def end_like(st):
    """Exit the way a child with wait status `st` did."""
    if os.WIFSIGNALED(st):
        sig = os.WTERMSIG(st)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 1)

def enter_userns(born=False):
    if born:  # created by the zygote's clone3, not mapped yet: map the zygote's ids
        uid, gid = spec["outside_ids"]
    else:
        uid, gid = os.getuid(), os.getgid()
        check(libc.unshare(NEWUSER))
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)

def enter_netns():
    """The run's network namespace: the one the zygote lent it (entered, its fd closed), else a new one."""
    global lent_netns
    if lent_netns is None:
        check(libc.unshare(NEWNET))
        return
    check(libc.setns(lent_netns, NEWNET))
    os.close(lent_netns)
    lent_netns = None

def stay_outside(init):
    """Fork. This process stays outside and waits: it ends the way the code did (cold), or reports
    the code's wait status on the exit fd (warm). The child returns; with `init` it is a pid
    namespace's pid 1 and keeps `to_outside` to report the status of the code it will fork."""
    global to_outside, exit_fd
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        st = os.waitpid(pid, 0)[1]
        got = os.read(r, 32)
        st = int(got) if got else st
        if exit_fd is not None:
            os.write(exit_fd, str(st).encode())
            os._exit(0)
        end_like(st)
    os.close(r)
    if exit_fd is not None:
        os.close(exit_fd)
        exit_fd = None
    if init:
        to_outside = w
    else:
        os.close(w)
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))

def enter_pidns(born=False):
    """Fork the namespace's pid 1; this process stays outside. Born as pid 1 (clone3, warm), it is
    pid 1 already and reports the code's status on the exit fd itself."""
    global to_outside, exit_fd
    if born:
        to_outside, exit_fd = exit_fd, None
        return
    check(libc.unshare(NEWPID))
    stay_outside(init=True)

def become_init():
    """As pid 1: fork the process that runs the code, reap orphans until it ends, report its
    status outside and exit, which kills whatever is left in the namespace."""
    pid = os.fork()
    if pid == 0:
        os.close(to_outside)
        return
    for fd in init_closes:
        try:
            os.close(fd)
        except OSError:
            pass
    while True:
        got, st = os.waitpid(-1, 0)
        if got == pid:
            os.write(to_outside, str(st).encode())
            os._exit(0)

def enter_mountns():
    """A mount namespace of our own: with spec["allow"], a fresh root is built (build_root) and
    entered later (enter_root); without, the host's tree is kept, read-only but the workdir."""
    check(libc.unshare(NEWNS))
    mount(None, "/", None, REC | PRIVATE)
    if spec["allow"]:
        build_root(spec["allow"])
        return
    closed = spec["closed_parent"]
    if closed:  # the uid cannot search `closed`: a tmpfs over it holds only the workdir, same path
        fd = os.open(wd, os.O_PATH | os.O_DIRECTORY)
        mount("tmpfs", closed, "tmpfs", NOSUID | NODEV | NOEXEC, "size=16k,mode=755")
        os.makedirs(wd)
        mount(f"/proc/self/fd/{fd}", wd, None, BIND | REC)
        os.close(fd)
    else:
        mount(wd, wd, None, BIND | REC)
    private = {wd}
    if os.path.isdir("/dev/shm"):
        mount("tmpfs", "/dev/shm", "tmpfs", NOSUID | NODEV | NOEXEC, f"size={spec['shm_mb']}m,mode=1777")
        private.add("/dev/shm")
    if os.path.isdir("/run") and spec["mask_run"]:
        mount("tmpfs", "/run", "tmpfs", RDONLY | NOSUID | NODEV | NOEXEC, "size=16k,mode=755")
    seal(private)

def seal(private):
    """Every mount but `private` (and what lies below the workdir) read-only and nosuid; the
    workdir nosuid, nodev, noexec; an error if a writable mount is left. The namespace is private
    (no propagation in) and only this process is in it, so the mounts listed once are all there are."""
    mounts = list(mountpoints())
    for path, fstype in mounts:
        if path not in private and not path.startswith(wd + "/"):
            try:
                remount(path, RDONLY | NOSUID)
            except OSError:
                pass  # hidden under another mount, or pseudo: checked below
    remount(wd, NOSUID | NODEV | NOEXEC, drop=RDONLY)
    for path, fstype in mounts:
        if fstype not in PSEUDO and path not in private and not path.startswith(wd + "/"):
            try:
                writable = not os.statvfs(path).f_flag & RDONLY
            except OSError:
                continue  # hidden under another mount
            if writable:
                raise OSError(f"{path} is still writable")

def mkdirs(path):
    """os.makedirs(path) in the root being built (a fresh tmpfs, this process's alone): mkdir, the
    missing parents first."""
    try:
        os.mkdir(path)
    except FileNotFoundError:
        mkdirs(path.rpartition("/")[0])
        os.mkdir(path)

def build_root(allow):
    """The run's root, built in a tmpfs mounted over the workdir (which is reached through an fd
    from then on): what allowlist.py lists, read-only, and the workdir at its own path."""
    global new_root
    fd = os.open(wd, os.O_PATH | os.O_DIRECTORY)
    r = new_root = wd
    mount("tmpfs", r, "tmpfs", NOSUID | NODEV, "size=1m,mode=755")
    for path in allow["ro"]:
        mkdirs(r + path)
        mount(path, r + path, None, BIND | REC)
    for path, target in allow["links"]:
        os.symlink(target, r + path)
    os.mkdir(r + "/etc")
    mount(allow["etc"], r + "/etc", None, BIND | REC)
    os.mkdir(r + "/dev")
    mount("tmpfs", r + "/dev", "tmpfs", NOSUID | NODEV | NOEXEC, "size=16k,mode=755")
    for dev in allow["devices"]:
        os.close(os.open(r + dev, os.O_CREAT | os.O_WRONLY, 0o644))
        mount(dev, r + dev, None, BIND)
    for name, target in (("fd", ""), ("stdin", "/0"), ("stdout", "/1"), ("stderr", "/2")):
        os.symlink("/proc/self/fd" + target, r + "/dev/" + name)
    os.mkdir(r + "/dev/shm")
    mount("tmpfs", r + "/dev/shm", "tmpfs", NOSUID | NODEV | NOEXEC, f"size={spec['shm_mb']}m,mode=1777")
    os.mkdir(r + "/proc")
    os.mkdir(r + "/tmp")
    mount("tmpfs", r + "/tmp", "tmpfs", NOSUID | NODEV | NOEXEC, "size=16k,mode=755")
    mkdirs(r + wd)
    mount(f"/proc/self/fd/{fd}", r + wd, None, BIND)  # not REC: the root being built is mounted on it
    os.close(fd)

def enter_root():
    """pivot_root into the built root, detach the host's tree, then seal: the run sees nothing else."""
    if SYS_PIVOT_ROOT is None:
        raise OSError(f"no pivot_root syscall number for {os.uname().machine}")
    os.chdir(new_root)
    check(libc.syscall(SYS_PIVOT_ROOT, b".", b"."))
    check(libc.umount2(b".", MNT_DETACH))
    os.chdir("/")
    seal({wd, "/dev/shm", "/proc", *spec["allow"]["devices"]})  # /proc as without the allowlist

def mount_proc():
    """A /proc of our own: the pid namespace's processes only (hidepid=2: only the uid's own). In a
    root being built it is mounted there, while the host's /proc is still in the namespace: inside
    a user namespace the kernel lets proc be mounted only where one is already fully visible."""
    flags, at = NOSUID | NODEV | NOEXEC, (new_root or "") + "/proc"
    try:
        mount("proc", at, "proc", flags, "hidepid=2")
    except OSError:
        mount("proc", at, "proc", flags)

def drop_uid():
    uid = spec["uid"]
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)

def set_rlimits():
    for name, (soft, hard) in spec["rlimits"].items():
        which = getattr(resource, name)
        cur = resource.getrlimit(which)[1]
        hard = hard if cur == resource.RLIM_INFINITY else min(hard, cur)
        resource.setrlimit(which, (min(soft, hard), hard))

def layer(name, fn, wanted):
    if not wanted:
        return
    try:
        fn()
        done[name] = True
    except Exception as e:
        done[name] = False
        if not probe:
            say(f"error {name}: {e}")
            fail()

def enter_layers(born=()):
    """Every layer the spec asks for, in order; returns in the process that is to run the code,
    as its uid, in the workdir. A layer that fails ends the run (exit 125), except in a probe.
    `born`: the namespaces this process was created in (clone3, warm), not to be unshared again.
    pid 1 forks the code's process before the mounts: it has nothing to do with them, and each
    page a forked Python process touches is a copy-on-write fault."""
    layer("userns", lambda: enter_userns("userns" in born), spec["userns"])
    layer("netns", lambda: "netns" in born or enter_netns(), spec["netns"])
    layer("pidns", lambda: enter_pidns("pidns" in born), spec["pidns"])
    if done.get("pidns"):
        become_init()
    elif exit_fd is not None:  # warm, no pid namespace: a process outside reports the code's status
        stay_outside(init=False)
    layer("mountns", enter_mountns, spec["mountns"])
    layer("proc", mount_proc, spec["proc"])
    layer("allowlist", enter_root, bool(spec["allow"]) and done.get("mountns") and done.get("proc"))
    layer("nnp", lambda: check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)), spec["nnp"])
    layer("rlimits", set_rlimits, True)
    layer("uid_drop", drop_uid, spec["uid"] is not None)
    layer("chdir", lambda: os.chdir(wd), True)
    if probe:
        say("layers " + json.dumps(done))
