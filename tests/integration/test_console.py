"""The console: the known third-party notices are filtered by message and module (others still show),
in this process and in the processes it starts; run.log_level=DEBUG shows everything."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nemo_orchestra.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]

# each known notice as its library raises it (message, category, module), then two it must not hide
SCRIPT = r"""
import subprocess, sys, warnings
from nemo_orchestra.runtime.console import setup_logging
setup_logging(sys.argv[1], 0)
def raise_as(message, category, module):
    warnings.warn_explicit(message, category, module.replace(".", "/") + ".py", 1, module=module)
raise_as("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", UserWarning,
         "megatron.core.optimizer")
raise_as("Apex is not installed. Falling back to Torch Norm", UserWarning, "megatron.core.models.backends")
raise_as("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed.", UserWarning,
         "megatron.core.optimizer.optimizer")
raise_as("`torch.distributed.all_gather_into_tensor` is deprecated.", FutureWarning, "torch.distributed.c10d_logger")
raise_as("`torch.distributed.reduce_op` is deprecated", FutureWarning, "vllm.triton_utils.dispatcher")
raise_as("SHOWN: another megatron notice", UserWarning, "megatron.core.optimizer")
raise_as("Apex is not installed (SHOWN: from our own module)", UserWarning, "nemo_orchestra.megatron.model")
# a process started from here: vLLM's import-time notices and the resource tracker's report at exit
child = (
    "import warnings\n"
    "warnings.warn_explicit('`torch.distributed.reduce_op` is deprecated', FutureWarning, 'd.py', 1, "
    "module='vllm.triton_utils.dispatcher')\n"
    "warnings.warn_explicit('resource_tracker: There appear to be 1 leaked shared_memory objects', UserWarning, "
    "'r.py', 1, module='multiprocessing.resource_tracker')\n"
    "warnings.warn_explicit('SHOWN: in the child', UserWarning, 'c.py', 1, module='vllm.other')\n"
    "import logging; from nemo_orchestra.runtime import console\n"  # as a spawned vLLM process imports the recipe
    "logging.getLogger('vllm.triton_utils.importing').warning('Triton is installed, but no CPU backend')\n"
)
subprocess.run([sys.executable, "-c", child], check=True)
"""


def _run(level: str) -> list[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONWARNINGS", "VLLM_LOGGING_LEVEL", "TORCH_CPP_LOG_LEVEL", "NEMO_ORCHESTRA_QUIET_CONSOLE")
    }
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run(
        [sys.executable, "-c", SCRIPT, level], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    return [line for line in r.stderr.splitlines() if "Warning:" in line or "Triton" in line]


def test_known_notices_are_filtered_others_shown():
    shown = _run("INFO")
    assert len(shown) == 3 and all("SHOWN" in line for line in shown), shown


def test_debug_shows_everything():
    shown = _run("DEBUG")
    assert len(shown) == 11, shown  # 7 here, 4 in the child


@pytest.mark.slow
def test_megatron_imports_quietly():
    code = (
        "from nemo_orchestra.runtime.console import setup_logging\nsetup_logging('INFO', 0)\n"
        "import megatron.core.optimizer, megatron.core.models.gpt.gpt_layer_specs\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0 and "Warning" not in r.stderr, r.stderr


def test_log_level_is_checked():
    assert load_config(["run.log_level=debug"]).run.log_level == "debug"
    with pytest.raises(ConfigError, match="run.log_level"):
        load_config(["run.log_level=LOUD"])
