# The launcher, the cold path: one run, run by the service's interpreter, privileged.
# A program, not a module of the package: prepare.py puts layers.py in front of this text and runs
# it as `python -I -S -B -c <layers.py + this> <spec>`. argv[1] is the spec from _launch_spec;
# stdin carries the code; the status fd gets "layers {json}" (probe) or "error <what>" lines.
# After the layers it execs the sandbox interpreter on the bootstrap.

def read_code():
    """The code from stdin, in a memfd the sandbox interpreter inherits; stdin becomes /dev/null."""
    code = b"".join(iter(lambda: os.read(0, 1 << 20), b""))
    null = os.open("/dev/null", os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    fd = os.memfd_create("sandbox-code")
    os.write(fd, code)
    os.lseek(fd, 0, os.SEEK_SET)
    os.set_inheritable(fd, True)
    return fd

def exec_bootstrap(code_fd):
    py = spec["python"]
    try:
        boot = "import sys; exec(compile(sys.argv[1], '<sandbox>', 'exec'))"
        os.execve(py, [py, "-I", "-B", "-u", "-c", boot, spec["bootstrap"], wd, str(status), str(code_fd),
                       spec["flags"]], dict(os.environ))
    except OSError as e:
        say(f"error exec {py}: {e}")
        os._exit(125)

if __name__ == "__main__":
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.umask(0o022)
    spec = json.loads(sys.argv[1])
    status, wd, probe, exit_fd = spec["status_fd"], spec["workdir"], spec["probe"], None
    libc = load_libc()
    done = {}
    code_fd = read_code()
    enter_layers()
    exec_bootstrap(code_fd)
