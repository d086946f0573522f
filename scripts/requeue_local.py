"""Run a training command and run it again when it asks to be requeued: Slurm's requeue, locally.

    python scripts/requeue_local.py [--time-limit S] [--signal-before S] [--max-restarts N] -- \
        python recipes/grpo_orchestrator.py run.output_dir=runs/long trainer.max_steps=1000

The command is started; the signals this wrapper receives (SIGUSR1, SIGTERM, SIGINT) are passed
on to it, as ``sbatch --signal=B:USR1@N`` and the template's trap do. With ``--time-limit`` each
launch gets that many seconds: SIGUSR1 at ``time-limit - signal-before``, SIGTERM at the limit and
SIGKILL ``--kill-wait`` seconds later, as Slurm does. When the command exits with 75 (the recipe's
"stopped by the preempt signal, requeue me", see nemo_orchestra/runtime/run_control.py) it is started
again, with ``NEMO_ORCHESTRA_RESTARTS`` set to the number of restarts so far, up to
``--max-restarts`` times; the recipe itself stops asking after ``run.max_restarts``. The wrapper
exits with the last launch's exit code.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

REQUEUE_EXIT = 75  # nemo_orchestra.runtime.run_control.REQUEUE_EXIT (not imported: the wrapper needs no torch)
FORWARDED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--time-limit", type=float, default=0.0, help="seconds per launch (0: none)")
    p.add_argument("--signal-before", type=float, default=60.0, help="SIGUSR1 this many seconds before the limit")
    p.add_argument("--kill-wait", type=float, default=30.0, help="SIGKILL this many seconds after SIGTERM")
    p.add_argument("--max-restarts", type=int, default=100)
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        p.error("no command given (put it after --)")
    return args


def launch(args: argparse.Namespace, restarts: int) -> int:
    env = dict(os.environ, NEMO_ORCHESTRA_RESTARTS=str(restarts))
    child = subprocess.Popen(args.command, env=env)
    for sig in FORWARDED:  # as Slurm's B: signal reaches the batch shell, whose trap forwards it
        signal.signal(sig, lambda signum, _: child.poll() is None and child.send_signal(signum))
    start = time.monotonic()
    plan = (
        []
        if not args.time_limit
        else [
            (args.time_limit - args.signal_before, signal.SIGUSR1),
            (args.time_limit, signal.SIGTERM),
            (args.time_limit + args.kill_wait, signal.SIGKILL),
        ]
    )
    while child.poll() is None:
        if plan and time.monotonic() - start >= plan[0][0]:
            child.send_signal(plan.pop(0)[1])
        try:
            child.wait(timeout=0.2)
        except subprocess.TimeoutExpired:
            pass
    return child.returncode


def main(argv: list[str]) -> int:
    args = parse(argv)
    restarts = 0
    while True:
        rc = launch(args, restarts)
        if rc != REQUEUE_EXIT:
            return rc if rc >= 0 else 128 - rc
        if restarts >= args.max_restarts:
            print(f"requeue_local: not relaunched, --max-restarts={args.max_restarts} reached", file=sys.stderr)
            return rc
        restarts += 1
        print(f"requeue_local: relaunching (restart {restarts})", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
