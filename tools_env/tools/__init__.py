"""Tool plug-ins. Importing this package registers every tool in ``TOOL_REGISTRY``.

``search`` and ``domain`` are optional here: when their module is absent or fails to import,
the service starts without them (with a warning) instead of not starting at all.
"""

import importlib
import importlib.util
import logging

from tools_env.tools import answer, calculator, experts, python_tool  # noqa: F401  (register)
from tools_env.tools.base import TOOL_REGISTRY, Tool, ToolArgumentError, ToolResult, register_tool  # noqa: F401

for _name in ("search", "domain"):
    if importlib.util.find_spec(f"tools_env.tools.{_name}") is not None:
        try:
            importlib.import_module(f"tools_env.tools.{_name}")
        except Exception as _e:  # a plug-in being written must not take the service down
            logging.getLogger(__name__).warning("tool plug-in tools_env.tools.%s not loaded: %s", _name, _e)

from tools_env.domains.bfcl import tools as _bfcl_tools  # noqa: F401,E402  (BFCL's API functions, when installed)
