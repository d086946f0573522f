# The zygote, the warm path (see warm.py): a sandbox interpreter that waits to be forked.
# A program, not a module of the package: warm.py puts layers.py in front of this text and starts it
# once per service process as `<sandbox python> -I -B -u -c <boot> <layers.py + this> <bootstrap.py>
# <config>`, privileged like the launcher. It has already paid for the interpreter's start and the
# imports of the layers and the bootstrap, and it never runs code itself: every run's child is a
# fork of the same untouched process.
# For each "run" message on its socket ("run <id> <namespaces>\n<job json>" and the run's fds: code
# memfd, stdout, stderr, status, exit, and the cgroup's directory if it has one) it forks a
# single-use child, which joins the run's cgroup and a new session, enters the layers exactly as
# the launcher does (its child, the code's process, then takes the run's stdio and environment)
# and runs the bootstrap where the launcher would exec it. "done <run>" SIGKILLs the child's
# process group and reaps the child.
# The zygote exits when its socket reaches EOF or its parent changes: the service is gone, however
# it died (SIGKILL included); its children die with it (PR_SET_PDEATHSIG).
# Network namespaces are lent, not made per run, where the zygote can own them (it runs as root in
# its user namespace, and a run's child is born in a pid namespace but not in a user namespace):
# making and tearing down a namespace per run costs more than the rest of the run's set-up. A
# namespace is lent to one run at a time, and comes back when that run's pid 1 is reaped, which the
# kernel allows only once every process of the pid namespace has exited: the run's sockets are all
# closed by then. The run cannot have changed the namespace (loopback stays down, nothing
# configured): its processes hold no capability over it, which the zygote's user namespace owns.
# Sockets a run left in flight in a cycle of unix sockets are freed by the kernel's collector,
# asynchronously, so a namespace is lent again oldest-returned first.
import errno, gc, select, socket
import atexit, linecache, tokenize  # imported by the bootstrap: already loaded in every child

SYS_CLONE3, CLONE_INTO_CGROUP = 435, 0x200000000  # clone3 has number 435 on every architecture
BORN = {"userns": NEWUSER, "netns": NEWNET, "pidns": NEWPID}  # namespaces a child is created in
POOL_MAX = 256  # network namespaces kept for lending; one returned beyond that is released
free_netns, netns_of = [], {}  # the pool, oldest-returned first; child pid -> the namespace it was lent

class CloneArgs(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in ("flags", "pidfd", "child_tid", "parent_tid", "exit_signal",
                                                      "stack", "stack_size", "tls", "set_tid", "set_tid_size", "cgroup")]

def clone_run(born, cgroup_fd):
    """os.fork(), with the child created in the namespaces `born` (user, network, pid) and in the
    cgroup `cgroup_fd`, by clone3 (Linux >= 5.7). The pid namespace's first process is then this
    child itself, so no process has to stay outside to wait, and it is born in the cgroup: moving it
    there afterwards waits for an RCU grace period. Returns (pid, the namespaces the child was
    created in, whether it is in the cgroup); where clone3 cannot do it, a plain os.fork(), (),
    False."""
    global clone3_ok
    if clone3_ok:
        flags = sum(BORN[name] for name in born) | (CLONE_INTO_CGROUP if cgroup_fd is not None else 0)
        clone_args.flags, clone_args.cgroup = flags, cgroup_fd or 0
        pid = clone3()
        if pid >= 0:
            return pid, born, cgroup_fd is not None
        if -pid in (errno.ENOSYS, errno.E2BIG, errno.EINVAL):  # an older kernel: stop trying
            clone3_ok = False
        sys.stderr.write(f"sandbox zygote: clone3: {os.strerror(-pid)}; forking instead\n")
    return os.fork(), (), False

clone_args = CloneArgs(exit_signal=int(signal.SIGCHLD))  # one, reused: fewer pages written per run

def clone3():
    """The clone3 syscall between PyOS_BeforeFork and _AfterFork, holding the GIL throughout (PyDLL),
    as os.fork() does; -errno on failure. Unlike glibc's fork() it leaves glibc's cached thread id
    stale in the child, which only forks (glibc's fork sets it right in its own children), waits,
    writes and exits."""
    before_fork()
    pid = pylibc.syscall(SYS_CLONE3, args_ref, args_size)
    if pid == 0:
        after_fork_child()
        return 0
    err = ctypes.get_errno()
    after_fork_parent()
    return pid if pid > 0 else -err

def lend_netns(born):
    """The fd of an empty network namespace for a run to be born in `born` (from the pool, else
    made), or None where the run makes its own: it is born in a user namespace (the zygote's would
    not be the namespace's owner there), or in no pid namespace (nothing would prove its processes
    gone when it comes back), or the zygote cannot make one."""
    global pool_ok
    if not (pool_ok and clone3_ok and "netns" in born and "pidns" in born and "userns" not in born):
        return None
    if free_netns:
        return free_netns.pop(0)
    if libc.unshare(NEWNET) != 0:
        pool_ok = False
        sys.stderr.write(f"sandbox zygote: unshare: {os.strerror(ctypes.get_errno())}; each run makes its own network namespace\n")
        return None
    fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    if libc.setns(home_netns, NEWNET) != 0:
        os._exit(1)  # stuck outside its own namespace: replaced at the next run
    return fd

def give_back_netns(pid):
    fd = netns_of.pop(pid, None)
    if fd is None:
        return
    if len(free_netns) < POOL_MAX:
        free_netns.append(fd)
    else:
        os.close(fd)

def serve(sock, parent):
    """Answer messages until one forks a run's child; return there the job, the namespaces
    the child was born in, whether it was born in the cgroup, its fds and the network namespace
    lent to it (an fd, or None)."""
    children, dying = {}, []
    while True:
        readable = select.select([sock], [], [], 0.2 if dying else 1.0)[0]
        if os.getppid() != parent:
            os._exit(0)
        for pid in [pid for pid in dying if reaped(pid)]:
            dying.remove(pid)
            give_back_netns(pid)  # every process of its pid namespace has exited
        if not readable:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 16, 8)
        if not msg:
            os._exit(0)
        kind, _, body = msg.partition(b" ")
        if kind == b"run":
            head, _, job = body.partition(b"\n")
            run, _, born = head.decode().partition(" ")
            job = json.loads(job)  # here, not in the child: the zygote's pages for it are then its own
            cgroup_fd = fds.pop() if len(fds) > 5 else None
            born = [name for name in born.split(",") if name in BORN]
            net = lend_netns(born)
            pid, born, joined = clone_run([n for n in born if n != "netns" or net is None], cgroup_fd)
            if net is not None and "pidns" not in born:  # forked, not cloned: the run makes its own
                free_netns.insert(0, net)
                net = None
            if pid == 0:
                if cgroup_fd is not None:
                    os.close(cgroup_fd)
                for fd in (home_netns, *free_netns, *netns_of.values()):
                    os.close(fd)
                return job, born, joined, fds, net
            if cgroup_fd is not None:
                os.close(cgroup_fd)
            if net is not None:
                netns_of[pid] = net
            for fd in fds:
                os.close(fd)
            children[run] = pid
        elif kind == b"done" and (pid := children.pop(body.decode(), None)):
            try:
                os.killpg(pid, signal.SIGKILL)  # unreaped, so the group id cannot have been reused
            except OSError:
                pass
            dying.append(pid)

def reaped(pid):
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True

def become_run(job, joined, fds):
    """In the run's first process (pid 1, where there is a pid namespace), still privileged: its
    cgroup and session. Returns the code's fd and the run's stdio, for become_code: pid 1 runs as
    little as it can, since each page it writes before forking the code's process is copied twice."""
    global spec, status, wd, probe, done, exit_fd, init_closes
    code_fd, out, err, status, exit_fd = fds
    spec, done = job["spec"], {}
    spec["outside_ids"] = zygote_ids
    wd, probe = spec["workdir"], spec["probe"]
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0))
    if proc_ids()[1] != zygote_pid:  # the zygote died before the line above: nothing would stop the run
        os._exit(1)
    if job["cgroup"] and not joined:
        try:
            fd = os.open(job["cgroup"], os.O_WRONLY)
            os.write(fd, str(os.getpid()).encode())
            os.close(fd)
        except OSError as e:
            say(f"error cgroup: {e}")
            fail()
    os.setsid()
    null = os.open("/dev/null", os.O_RDONLY)  # here: the code's process may have a nodev /dev
    init_closes = (0, 1, 2, null, out, err, code_fd, status)
    return code_fd, (null, out, err)

def become_code(job, stdio, keep):
    """In the code's process, after the layers: the run's stdin (/dev/null), stdout, stderr and
    environment; every other fd but `keep` closed."""
    for src, dst in zip(stdio, (0, 1, 2)):
        os.dup2(src, dst)
        os.close(src)
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd > 2 and fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    env = job["env"]  # os.environ becomes exactly `env`: only the variables that differ are set
    for name in [name for name in zygote_env if name not in env]:
        del os.environ[name]
    for name, value in env.items():
        if zygote_env.get(name) != value:
            os.environ[name] = value
    if job["marker"]:
        show_marker(job["marker"])

def proc_ids():
    """(pid, ppid) as /proc numbers them (getppid() is 0 in a pid namespace the parent is not in)."""
    fd = os.open("/proc/self/stat", os.O_RDONLY)  # not open(): its io objects cost page faults
    fields = os.read(fd, 4096).rsplit(b")", 1)
    os.close(fd)
    return int(fields[0].split()[0]), int(fields[1].split()[1])

def show_marker(marker):
    """Write `NAME=value` over the placeholder in this process's original environment block, which
    /proc/<pid>/environ shows (os.environ does not change it): cleanup finds the run's processes by
    it when they have no uid of their own. The placeholder is as long as the value."""
    name = marker.partition("=")[0] + "="
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51 of proc(5)
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        at = mem.read(end - start).find(name.encode())
        if at < 0:
            raise OSError(f"no {name} in the zygote's environment")
        mem.seek(start + at)
        mem.write(marker.encode())

if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.umask(0o022)
    for fd in (0, 1, 2):  # so that no received fd lands on a stdio number
        try:
            os.fstat(fd)
        except OSError:
            os.open("/dev/null", os.O_RDWR)
    libc, exit_fd, clone3_ok = load_libc(), None, True
    home_netns = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    pool_ok = os.geteuid() == 0  # root in its user namespace, which owns the namespaces it makes
    libc.unshare, libc.setns, libc.prctl, libc.syscall, libc.umount2  # ctypes makes a function object at the first use: here, not in every child
    before_fork, after_fork_child, after_fork_parent = (
        ctypes.pythonapi.PyOS_BeforeFork, ctypes.pythonapi.PyOS_AfterFork_Child, ctypes.pythonapi.PyOS_AfterFork_Parent)
    pylibc = ctypes.PyDLL(None, use_errno=True)
    pylibc.syscall.restype = ctypes.c_long
    args_ref, args_size = ctypes.byref(clone_args), ctypes.sizeof(clone_args)
    BOOTSTRAP = compile(sys.argv[2], "<sandbox>", "exec")
    sock = socket.socket(fileno=json.loads(sys.argv[3])["sock"])
    zygote_env = dict(os.environ)  # what become_code compares a run's environment with
    ctypes_modules = [m for m in sys.modules if m == "_ctypes" or m.partition(".")[0] == "ctypes"]
    modules_count = len(sys.modules)
    # every fork copies the zygote's page tables and every child unmaps them: before the first run
    # start-up garbage is freed and (glibc) the heap's free pages are given back
    gc.collect()
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)
    gc.freeze()  # the children's collections leave the zygote's objects (and their pages) alone
    sock.sendall(b"ready")
    zygote_pid = proc_ids()[0]
    zygote_ids = os.getuid(), os.getgid()
    job, born, joined, fds, lent_netns = serve(sock, os.getppid())
    sock.close()
    try:
        code_fd, stdio = become_run(job, joined, fds)
    except Exception as e:  # say() needs the status fd, the first thing become_run sets
        say(f"error starting the run: {e}")
        fail()
    enter_layers(born)
    try:
        become_code(job, stdio, {code_fd, status})
    except Exception as e:
        say(f"error starting the run: {e}")
        fail()
    if len(sys.modules) != modules_count:  # something was imported since the list was made
        ctypes_modules = [m for m in sys.modules if m == "_ctypes" or m.partition(".")[0] == "ctypes"]
    for name in ctypes_modules:
        del sys.modules[name]  # as in a fresh interpreter, `import ctypes` reaches the audit hook
    sys.argv = ["-c", sys.argv[2], wd, str(status), str(code_fd), spec["flags"]]
    exec(BOOTSTRAP)  # in __main__, as the launcher's exec does; it clears the zygote's globals
