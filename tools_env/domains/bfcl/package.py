"""The bfcl-eval package: its version, and the one import path that names the extra when it is missing."""

from __future__ import annotations

import importlib
from typing import Any

BFCL_VERSION = "2026.3.23"
EXTRA_HINT = (
    f"install the 'bfcl' extra: EXTRAS=test,bfcl bash scripts/setup.sh, or "
    f"pip install --no-deps bfcl-eval=={BFCL_VERSION} mpmath"
)


class BfclUnavailable(ImportError):
    """The bfcl-eval package (or what its API classes import) is missing."""


def require_bfcl(module: str = "bfcl_eval") -> Any:
    """Import ``module`` of the bfcl-eval package, or raise ``BfclUnavailable`` naming the extra."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise BfclUnavailable(f"BFCL tasks need the bfcl-eval package ({e}); {EXTRA_HINT}") from None


def available() -> tuple[bool, str]:
    """Whether the package imports, and why not."""
    try:
        require_bfcl()
    except BfclUnavailable as e:
        return False, str(e)
    return True, ""
