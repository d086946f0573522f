"""Launch the GRPO job (``recipes/grpo_orchestrator.py``) through NeMo-Run, NeMo's launcher.

The main job runs under NeMo-Run's torchrun launcher (``launcher="torchrun"``) on the executor
named by ``executor=``: ``local`` (this machine; NeMo-Run's ``LocalExecutor`` runs torchrun with
``gpus_per_node`` processes and waits for it), ``slurm`` (``SlurmExecutor``: an sbatch script that
runs ``srun torchrun`` on ``nodes`` nodes; submitted from this machine, which must have
``sbatch``, or written out with ``dryrun=true``) or ``skypilot`` (``SkypilotExecutor``: needs
``pip install 'nemo-run[skypilot]'`` and cloud credentials). ``dryrun=true`` builds the job and
prints what would run (for Slurm: the sbatch script) without running anything.

Every argument that is not a launcher key below is the main job's ``key=value`` (``recipe=...``,
``trainer.max_steps=...``) and is checked against the config schema here, before anything starts.

Simplification: the job runs from this checkout (NeMo-Run's plain ``Packager``): on a cluster,
``workdir=`` is the checkout's path as the compute nodes see it (a shared filesystem), with the
set-up's ``.venv`` in it (or ``container_image=`` an image that holds both).

Launch:
    python recipes/launch.py executor=local gpus_per_node=8 recipe=qwen3_8b_1n8g data.train_path=tasks.jsonl
    python recipes/launch.py executor=slurm dryrun=true nodes=2 gpus_per_node=8 account=ACCT partition=batch \\
        workdir=/lustre/$USER/nemo-orchestra recipe=qwen3_8b_2n8g data.train_path=/lustre/tasks.jsonl
    python recipes/launch.py executor=skypilot nodes=1 gpus_per_node=8 cloud=aws recipe=qwen3_8b_1n8g ...
"""

import glob
import logging
import os
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from nemo_orchestra.config import ConfigError, load_recipe_config
from nemo_orchestra.config_help import recipe_help, wants_help

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = "recipes/grpo_orchestrator.py"
EXECUTORS = ("local", "slurm", "skypilot")
log = logging.getLogger("launch")
warnings.filterwarnings("ignore", message="starlette.middleware.wsgi is deprecated")  # imported by nemo_run


@dataclass
class LaunchArgs:
    executor: str = "local"  # local | slurm | skypilot
    dryrun: bool = False  # build the job and print it (Slurm: the sbatch script); run nothing
    nodes: int = 1
    gpus_per_node: int = 1  # torchrun processes per node (one per GPU; on a CPU machine, processes)
    name: str = "grpo_orchestrator"  # the experiment's title in NeMo-Run
    job_dir: str = "runs/nemo_run"  # NeMo-Run's experiment folders (logs, the sbatch script)
    workdir: Optional[str] = None  # the checkout as the job's machines see it; default: this checkout
    python: Optional[str] = None  # the interpreter torchrun runs; default: <workdir>/.venv/bin/python
    account: Optional[str] = None  # slurm
    partition: Optional[str] = None  # slurm
    time: str = "04:00:00"  # slurm: the job's time limit
    container_image: Optional[str] = None  # slurm (pyxis/enroot) or skypilot
    cloud: Optional[str] = None  # skypilot: aws | gcp | azure | kubernetes | ...
    gpu_type: str = "H100"  # skypilot: accelerators are <gpu_type>:<gpus_per_node>

    def validate(self) -> None:
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor: must be one of {', '.join(EXECUTORS)}, got {self.executor!r}")
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError(f"nodes, gpus_per_node: must be >= 1, got {self.nodes}, {self.gpus_per_node}")
        if self.executor == "local" and self.nodes != 1:
            raise ValueError(f"nodes: executor=local runs on this machine only, got nodes={self.nodes}")
        if self.executor == "slurm" and not self.account:
            raise ValueError("account: executor=slurm needs the Slurm account (account=NAME)")


def script(args: LaunchArgs, job_argv: list[str]):
    """The main job as a NeMo-Run ``Script`` that torchrun starts once per process: from the checkout,
    ``python recipes/grpo_orchestrator.py <job_argv>`` (relative paths in the job's config resolve there)."""
    import nemo_run as run

    workdir = args.workdir or str(ROOT)
    python = args.python or os.path.join(workdir, ".venv", "bin", "python")
    if args.executor == "local" and args.python is None and not os.path.exists(python):
        python = sys.executable  # this checkout without its own .venv: the interpreter running this
    command = " ".join(shlex.quote(a) for a in [python, MAIN_JOB, *job_argv])
    return run.Script(inline=f"cd {shlex.quote(workdir)} && exec {command}\n", entrypoint="bash")


def executor(args: LaunchArgs):
    """The NeMo-Run executor for ``args.executor``, with the torchrun launcher."""
    import nemo_run as run

    if args.executor == "local":  # torchrun from the interpreter running this, whether or not it is on PATH
        path = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
        return run.LocalExecutor(ntasks_per_node=args.gpus_per_node, launcher="torchrun", env_vars={"PATH": path})
    if args.executor == "slurm":
        venv = (
            os.path.dirname(os.path.dirname(args.python))
            if args.python
            else os.path.join(args.workdir or str(ROOT), ".venv")
        )
        return run.SlurmExecutor(
            account=args.account,
            partition=args.partition,
            nodes=args.nodes,
            ntasks_per_node=args.gpus_per_node,
            gpus_per_node=args.gpus_per_node,
            time=args.time,
            container_image=args.container_image,
            exclusive=True,
            launcher="torchrun",
            packager=run.Packager(),
            job_name_prefix="nemo-orchestra-",
            setup_lines=None if args.container_image else f"source {shlex.quote(venv)}/bin/activate",
            tunnel=run.LocalTunnel(job_dir=os.path.abspath(args.job_dir)),
        )
    try:
        return run.SkypilotExecutor(
            num_nodes=args.nodes,
            gpus=args.gpu_type,
            gpus_per_node=args.gpus_per_node,
            cloud=args.cloud,
            container_image=args.container_image,
            launcher="torchrun",
            packager=run.Packager(),
        )
    except AssertionError as e:  # NeMo-Run asserts that SkyPilot is importable
        raise ImportError(f"executor=skypilot needs SkyPilot: pip install 'nemo-run[skypilot]' ({e})") from None


def launch(args: LaunchArgs, job_argv: list[str]) -> bool:
    """Run (or with ``dryrun``, print) the main job; True when it ran to completion or was submitted."""
    import nemo_run as run
    from torchx.specs import AppState

    job, ex = script(args, job_argv), executor(args)
    os.makedirs(args.job_dir, exist_ok=True)
    with run.Experiment(
        args.name,
        executor=ex,
        base_dir=os.path.abspath(args.job_dir),
        log_level="WARNING",
        enable_goodbye_message=False,
    ) as exp:
        exp.add(job, name=args.name, tail_logs=args.executor == "local")
        if args.dryrun:
            exp.dryrun(log=args.executor != "slurm", delete_exp_dir=False)
            if args.executor == "slurm":
                print_sbatch(args.job_dir, args.name)
            return True
        exp.run(detach=args.executor != "local")
    if args.executor != "local":
        return True
    states = [job.state for job in exp.jobs]  # set on leaving the experiment, which waits for the job
    log.info("job %s: %s", args.name, ", ".join(str(s) for s in states))
    return bool(states) and all(s == AppState.SUCCEEDED for s in states)


def print_sbatch(job_dir: str, name: str) -> None:
    """Print the newest sbatch script NeMo-Run wrote for experiment ``name``, and where it is."""
    scripts = sorted(
        glob.glob(os.path.join(job_dir, "experiments", name, "*", f"{name}_sbatch.sh")), key=os.path.getmtime
    )
    assert scripts, f"NeMo-Run wrote no sbatch script under {job_dir}/experiments/{name}"
    with open(scripts[-1]) as f:
        print(f.read())
    print(
        f"# written to {scripts[-1]}; launch.py without dryrun=true copies the job folder to the paths "
        "above and submits it"
    )


def main(argv: list[str]) -> int:
    if wants_help(argv):
        print(recipe_help(__doc__, LaunchArgs, main=True, argv=argv), end="")
        return 0
    own = {f for f in LaunchArgs.__dataclass_fields__}
    job_argv = [a for a in argv if a.split("=", 1)[0].split(".")[0] not in own]
    try:
        args, _ = load_recipe_config(LaunchArgs, argv)  # the main job's keys are checked here too
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        ok = launch(args, job_argv)
    except (ImportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not ok:
        print(f"error: the job failed; its log is under {args.job_dir}/experiments/{args.name}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
