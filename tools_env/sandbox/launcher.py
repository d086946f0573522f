"""The launcher: run by the service's interpreter, privileged, single-threaded, stdlib only.

A program, not a module of the package: prepare.py reads this file and runs it as
`python -I -S -B -c <this source> <spec>`. argv[1] is the spec from _launch_spec; stdin carries
the code; the status fd gets "layers {json}" (probe) or "error <what>" lines.
"""
import ctypes, json, os, re, resource, signal, sys

NEWNS, NEWUSER, NEWPID, NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
KEEP = NOSUID | NODEV | NOEXEC | 1024 | 2048 | (1 << 21)  # + noatime, nodiratime, relatime
STRICTATIME = 1 << 24
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
PSEUDO = {"proc", "sysfs", "cgroup", "cgroup2", "devpts", "mqueue", "debugfs", "tracefs", "securityfs",
          "pstore", "bpf", "fusectl", "configfs", "binfmt_misc", "autofs", "efivarfs", "rpc_pipefs", "nsfs"}

def say(line):
    os.write(status, (line + "\n").encode())

def check(ret):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

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
    for line in open("/proc/self/mountinfo"):
        f = line.split()
        yield re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), f[4]), f[f.index("-") + 1]

def end_like(st):
    """Exit the way a child with wait status `st` did."""
    if os.WIFSIGNALED(st):
        sig = os.WTERMSIG(st)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(st) if os.WIFEXITED(st) else 1)

def enter_userns():
    uid, gid = os.getuid(), os.getgid()
    check(libc.unshare(NEWUSER))
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open("/proc/self/" + name, "w") as f:
            f.write(text)

def enter_pidns():
    """Fork the namespace's pid 1. This process stays outside, waits, and ends as the code did."""
    global to_outside
    check(libc.unshare(NEWPID))
    r, w = os.pipe()
    pid = os.fork()
    if pid:
        os.close(w)
        st = os.waitpid(pid, 0)[1]
        got = os.read(r, 32)
        end_like(int(got) if got else st)
    os.close(r)
    to_outside = w
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))

def become_init():
    """As pid 1: fork the process that runs the code, reap orphans until it ends, report its
    status outside and exit, which kills whatever is left in the namespace."""
    pid = os.fork()
    if pid == 0:
        os.close(to_outside)
        return
    os.close(0), os.close(1), os.close(2)
    while True:
        got, st = os.waitpid(-1, 0)
        if got == pid:
            os.write(to_outside, str(st).encode())
            os._exit(0)

def enter_mountns():
    check(libc.unshare(NEWNS))
    mount(None, "/", None, REC | PRIVATE)
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
    python = os.path.realpath(spec["python"])
    if os.path.isdir("/run") and not any(p.startswith("/run/") for p in (wd + "/", python)):
        mount("tmpfs", "/run", "tmpfs", RDONLY | NOSUID | NODEV | NOEXEC, "size=16k,mode=755")
    for path, fstype in list(mountpoints()):
        if path not in private and not path.startswith(wd + "/"):
            try:
                remount(path, RDONLY | NOSUID)
            except OSError:
                pass  # hidden under another mount, or pseudo: checked below
    remount(wd, NOSUID | NODEV | NOEXEC, drop=RDONLY)
    for path, fstype in mountpoints():
        if fstype not in PSEUDO and path not in private and not path.startswith(wd + "/"):
            try:
                writable = not os.statvfs(path).f_flag & RDONLY
            except OSError:
                continue  # hidden under another mount
            if writable:
                raise OSError(f"{path} is still writable")

def mount_proc():
    """A /proc of our own: the pid namespace's processes only (hidepid=2: only the uid's own)."""
    flags = NOSUID | NODEV | NOEXEC
    try:
        mount("proc", "/proc", "proc", flags, "hidepid=2")
    except OSError:
        mount("proc", "/proc", "proc", flags)

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
            os._exit(125)

if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.umask(0o022)
    spec = json.loads(sys.argv[1])
    status, wd, probe = spec["status_fd"], spec["workdir"], spec["probe"]
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    done = {}
    code = b"".join(iter(lambda: os.read(0, 1 << 20), b""))
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    code_fd = os.memfd_create("sandbox-code")
    os.write(code_fd, code)
    os.lseek(code_fd, 0, os.SEEK_SET)
    os.set_inheritable(code_fd, True)
    layer("userns", enter_userns, spec["userns"])
    layer("netns", lambda: check(libc.unshare(NEWNET)), spec["netns"])
    layer("pidns", enter_pidns, spec["pidns"])
    layer("mountns", enter_mountns, spec["mountns"])
    layer("proc", mount_proc, spec["proc"])
    if done.get("pidns"):
        become_init()
    layer("nnp", lambda: check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)), spec["nnp"])
    layer("rlimits", set_rlimits, True)
    layer("uid_drop", drop_uid, spec["uid"] is not None)
    layer("chdir", lambda: os.chdir(wd), True)
    if probe:
        say("layers " + json.dumps(done))
    py = spec["python"]
    try:
        boot = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'))"
        os.execve(py, [py, "-I", "-B", "-u", "-c", boot, spec["bootstrap"], wd, str(status), str(code_fd), spec["flags"]],
                  dict(os.environ))
    except OSError as e:
        say(f"error exec {py}: {e}")
        os._exit(125)
