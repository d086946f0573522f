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
    sys.excepthook = _sandbox_excepthook(status_fd)
    sys.argv = ["-c"]
    sys.path.insert(0, workdir)
    _sandbox_run(source, status_fd, _sandbox_exit_code, _sandbox_end)


def _sandbox_excepthook(status_fd):
    import sys, posix

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

    return excepthook


def _sandbox_run(source, status_fd, exit_code, end):
    # Runs the code as `python -c` does, in a __main__ emptied of the bootstrap (the helpers come in
    # as arguments), and reports an uncaught exception or SystemExit the same way; never returns.
    import sys, posix, gc, atexit  # for `end`, loaded before `before` is taken
    main = sys.modules["__main__"].__dict__
    for name in [n for n in main if not n.startswith("__")]:
        del main[name]
    before = set(sys.modules)
    posix.write(status_fd, b"ready\n")
    code, sigint = 0, False
    try:
        exec(compile(source, "<code>", "exec", dont_inherit=True), main)
    except SystemExit as e:
        code = exit_code(e.code)
    except BaseException as e:
        sigint = isinstance(e, KeyboardInterrupt)
        kind, value, tb = sys.exc_info()
        del e
        try:
            sys.excepthook(kind, value, tb)
        except BaseException:
            sys.__excepthook__(kind, value, tb)
        code = 1
    end(main, before, code, sigint)


def _sandbox_exit_code(code):
    # The exit status of `raise SystemExit(code)`, its message printed as the interpreter does.
    import sys
    if code is None:
        return 0
    if isinstance(code, int):
        return code if -(1 << 31) <= code < 1 << 31 else -1
    try:
        print(code, file=sys.stderr)
    except BaseException:
        pass
    return 1


def _sandbox_end(main, before, code, sigint):
    # The interpreter's exit (Py_FinalizeEx), step for step: wait for non-daemon threads, atexit,
    # flush stdio, clear __main__ and the modules the code imported (closing files it left open and
    # running __del__ methods), collect cycles, flush again, exit. Left out: the teardown of the
    # interpreter's own modules, which prints nothing and in a zygote's child costs a copy-on-write
    # fault for every inherited page it touches. C stdio buffers are not flushed (os._exit). Only
    # locals from here on: the code may have rebound any global.
    import sys, posix, gc, atexit

    def flush(code):
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None and not stream.closed:
                    stream.flush()
            except BaseException:
                if stream is sys.stdout:
                    code = 120  # as the interpreter does when stdout cannot be flushed at exit
        return code

    threading = sys.modules.get("threading")
    if threading is not None:
        try:
            threading._shutdown()
        except BaseException:
            pass
    atexit._run_exitfuncs()
    code = flush(code)
    for module in [sys.modules.get("__main__")] + [m for n, m in reversed(list(sys.modules.items())) if n not in before]:
        names = getattr(module, "__dict__", None)
        if type(names) is dict:
            for key in [k for k in names if type(k) is str and k[:1] == "_" and k[:2] != "__"]:
                names[key] = None
            for key in [k for k in names if k != "__builtins__"]:
                names[key] = None
    main.clear()
    gc.collect()
    code = flush(code)
    if sigint:
        import signal
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        posix.kill(posix.getpid(), signal.SIGINT)
    posix._exit(code & 0xFF)


if __name__ == "__main__":
    _sandbox_main()
