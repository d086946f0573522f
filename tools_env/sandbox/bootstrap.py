# The bootstrap: first code of the sandbox interpreter, unprivileged, compiled as "<sandbox>".
# A program, not a module of the package: prepare.py reads this file and the launcher passes its
# text in argv to `python -I -B -u -c "exec(compile(sys.argv[1], '<sandbox>', 'exec'))"`.
# argv[2:]: workdir, status fd, code fd, flags ("net": refuse network, "strict": refuse programs and gc walks, "probe").
# The hook keeps its state in closures over builtins captured at start, so rebinding names in
# builtins or in modules later does not change what it checks.
# (Comments, not a docstring: a docstring would become the code's `__doc__` in `__main__`.)

def _sandbox_hook(workdir, block_net, strict):
    import posix
    lstat, readlink, getcwd, getpid, fspath = posix.lstat, posix.readlink, posix.getcwd, posix.getpid, posix.fspath
    isinstance_, type_, str_, bytes_, int_, OSError_, PermissionError_ = (
        isinstance, type, str, bytes, int, OSError, PermissionError)
    write = posix.O_WRONLY | posix.O_RDWR | posix.O_APPEND | posix.O_CREAT | posix.O_TRUNC
    devices = frozenset(("/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/dev/stdout", "/dev/stderr",
                         "/dev/random", "/dev/urandom"))
    paths = {  # event -> ((index of a path argument, index of its dir_fd argument or None), ...)
        "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.chmod": ((0, 2),),
        "os.chown": ((0, 3),), "os.utime": ((0, 3),), "os.truncate": ((0, None),), "os.symlink": ((1, 2),),
        "os.setxattr": ((0, None),), "os.removexattr": ((0, None),), "os.rename": ((0, 2), (1, 3)),
        "os.link": ((0, 2), (1, 3)), "shutil.rmtree": ((0, 1),), "sqlite3.connect": ((0, None),)}
    net = frozenset(("socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"))
    dns = frozenset(("socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr", "socket.getnameinfo"))
    spawn = frozenset(("subprocess.Popen", "os.exec", "os.posix_spawn", "os.spawn", "os.system"))
    walks = frozenset(("gc.get_objects", "gc.get_referrers", "gc.get_referents"))
    native = frozenset(("ctypes", "_ctypes", "cffi", "_cffi_backend"))
    frozen = frozenset(("__code__", "__defaults__", "__kwdefaults__"))

    def real(path, dir_fd):
        """os.path.realpath from captured primitives; missing components are kept as written."""
        if not path.startswith("/"):
            base = getcwd() if dir_fd is None or dir_fd < 0 else readlink("/proc/self/fd/%d" % dir_fd)
            path = base + "/" + path
        todo, out, hops = path.split("/")[::-1], "", 0
        while todo:
            part = todo.pop()
            if part == "" or part == ".":
                continue
            if part == "..":
                out = out[:out.rfind("/")]
                continue
            nxt = out + "/" + part
            try:
                mode = lstat(nxt).st_mode
            except OSError_:
                out = nxt
                continue
            if mode & 0o170000 != 0o120000:
                out = nxt
                continue
            hops += 1
            if hops > 40:
                raise OSError_("symlink loop")
            target = readlink(nxt)
            if target.startswith("/"):
                out = ""
            todo.extend(target.split("/")[::-1])
        return out or "/"

    def inside(path, dir_fd=None):
        if path is None or isinstance_(path, int_):
            return True  # an open file descriptor: opening it went through this hook
        path = fspath(path)
        path = "".join((path,)) if isinstance_(path, str_) else b"".join((path,)).decode("utf-8", "surrogateescape")
        if path in devices or path == ":memory:" or path == "":
            return True
        try:
            path = real(path, dir_fd)
        except OSError_:
            return False
        return path == workdir or path.startswith(workdir + "/")

    def other_process(path):
        """Is `path` in /proc/<pid>/ of another process (same uid: environ, mem, ... are readable)?"""
        try:
            parts = real(path, None).split("/")
        except OSError_:
            return True
        return len(parts) > 2 and parts[1] == "proc" and str_.isdigit(parts[2]) and parts[2] != "%d" % getpid()

    def deny(what, path=None):
        shown = " %r" % (path,) if type_(path) is str_ else ""
        raise PermissionError_(1, "sandbox: %s%s is not allowed" % (what, shown))

    def hook(event, args):
        if event == "open":
            if args[2] & write and not inside(args[0]):
                deny("writing outside the working directory:", args[0])
            if strict and type_(args[0]) is str_ and str_.startswith(args[0], "/proc/") and other_process(args[0]):
                deny("reading another process's /proc entry:", args[0])
        elif event in paths:
            for i, d in paths[event]:
                path = args[i]
                if event == "sqlite3.connect" and isinstance_(path, str_) and str_.startswith(path, "file:"):
                    path = str_.split(path[5:], "?")[0]  # a URI names the file sqlite will open
                if not inside(path, None if d is None else args[d]):
                    deny(event + " outside the working directory:", path)
        elif event in net:
            if block_net:
                addr = args[1]
                if addr is not None and not (  # None: sendmsg on a connected socket
                        isinstance_(addr, (str_, bytes_)) and addr[:1] not in ("\0", b"\0") and inside(addr)):
                    deny("network access (" + event + ")")
        elif event in dns:
            if block_net:
                deny("network access (" + event + ")")
        elif event == "object.__setattr__":
            if args[1] in frozen:
                for f in ours:
                    if args[0] is f:
                        deny("changing the sandbox's own functions")
        elif event == "import":
            if args[0] in native or args[0].startswith("ctypes."):
                deny("importing " + args[0])
        elif event.startswith("ctypes."):
            deny(event)
        elif strict and (event in spawn or event in walks):
            deny(event)

    ours = (hook, real, inside, other_process, deny)
    return hook


def _sandbox_main():
    import sys, posix
    workdir, status_fd, code_fd, flags = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5].split(",")
    sys.addaudithook(_sandbox_hook(workdir, "net" in flags, "strict" in flags))
    posix.set_inheritable(status_fd, False)
    if "probe" in flags:
        posix.write(status_fd, b"probe-ok\n")
        return
    chunks = []
    while True:
        chunk = posix.read(code_fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    posix.close(code_fd)
    source = b"".join(chunks).decode("utf-8", "surrogateescape")
    import linecache
    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")

    def excepthook(kind, value, tb, write=posix.write, hook=sys.__excepthook__):
        if issubclass(kind, MemoryError):
            try:
                write(status_fd, b"memory\n")
            except OSError:
                pass
        frames = []  # the traceback without the sandbox's own frames (bootstrap, audit hook)
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename
            if name != "<sandbox>" and not (name == "<string>" and not frames):
                frames.append(tb)
            tb = tb.tb_next
        for prev, nxt in zip(frames, frames[1:] + [None]):
            prev.tb_next = nxt
        hook(kind, value.with_traceback(frames[0] if frames else None), frames[0] if frames else None)

    sys.excepthook = excepthook
    sys.argv = ["-c"]
    sys.path.insert(0, workdir)
    main = sys.modules["__main__"].__dict__
    for name in [n for n in main if not n.startswith("__")]:
        del main[name]
    posix.write(status_fd, b"ready\n")
    exec(compile(source, "<code>", "exec", dont_inherit=True), main)

if __name__ == "__main__":
    _sandbox_main()
