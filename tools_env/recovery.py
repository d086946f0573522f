"""What a training run does when the tool service stops answering: restart it and retry, or stop.

``with_tool_service(fn, client, what=..., resume_hint=...)`` runs ``fn()`` (a batch of episodes
through ``client``). When it fails on transport (``ToolsEnvError`` with status 0: connection
refused or reset, or no answer within the client's ``timeout_s``):

- if ``client.service`` is a service this process started (``ServiceHandle``), it is restarted
  (same config, workers and token; fresh ports), the client is pointed at it and ``fn()`` runs
  again from the start: the episodes of the dead service are gone, so the whole batch is redone.
  At most ``max_restarts`` times per call; a warning says which service and why.
- otherwise (a service given by URL, shared with other ranks, or dead again after its restarts)
  the run stops with ``ToolServiceDown``: a ``SystemExit`` whose one-line message names the
  service, what it was doing and how to resume. It is raised as soon as the failure is seen;
  the only wait is the client's own timeout when the service hangs instead of dying.

HTTP errors (4xx/5xx) are not transport failures and pass through unchanged. ``restarts(client)``
counts the restarts so far: a training run logs it as ``tools_env/restarts`` at every step.
"""

from __future__ import annotations

import logging
import urllib.error
import urllib.request
from typing import Any, Callable, TypeVar

from tools_env.client import ToolsEnvError

log = logging.getLogger(__name__)
T = TypeVar("T")


class ToolServiceDown(SystemExit):
    """The run stops: the tool service is gone. ``str()`` is the one line printed on exit (status 1)."""


def answers(url: str, timeout_s: float = 2.0) -> bool:
    """Whether ``url/healthz`` answers 200 within ``timeout_s``."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def with_tool_service(fn: Callable[[], T], client: Any, *, what: str, resume_hint: str, max_restarts: int = 1) -> T:
    """``fn()``, restarting the service ``client.service`` and retrying when it dies (see the module)."""
    for attempt in range(max_restarts + 1):
        try:
            return fn()
        except ToolsEnvError as e:
            if e.status != 0:
                raise
            failure = e
        down = [u for u in client.urls if not answers(u)] or list(client.urls)
        service = getattr(client, "service", None)
        if service is None or attempt == max_restarts:
            raise ToolServiceDown(_stop_line(down, what, failure, resume_hint, service)) from None
        log.warning(
            "tool service %s stopped answering during %s (%s); restarting it and retrying",
            ", ".join(down),
            what,
            _short(failure),
        )
        try:
            urls = service.restart()
        except Exception as e:  # a service that cannot come back: stop, saying so
            raise ToolServiceDown(
                f"error: tool service {', '.join(down)} stopped answering during {what} and did "
                f"not restart ({_short(e)}); {resume_hint}"
            ) from None
        client.retarget(urls)
        log.warning("tool service restarted at %s; redoing %s", ", ".join(urls), what)
    raise AssertionError("unreachable")


def restarts(client: Any) -> int:
    """How many times this process has restarted ``client``'s tool service (the step metric
    ``tools_env/restarts``, cumulative); 0 for a service it did not start."""
    return int(getattr(getattr(client, "service", None), "restarts", 0) or 0)


def tool_service_context(output_dir: str, step: int, heldout: bool = False) -> dict[str, str]:
    """``what`` and ``resume_hint`` for a training run's episodes at ``step`` (steps done so far)."""
    what = f"the held-out evaluation at step {step}" if heldout else f"step {step + 1}'s rollouts"
    hint = (
        f"once it answers again, run the same command: it resumes from the newest checkpoint in "
        f"{output_dir}/checkpoints"
    )
    return {"what": what, "resume_hint": hint}


def _short(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= limit else text[:limit] + "..."


def _stop_line(down: list[str], what: str, failure: ToolsEnvError, resume_hint: str, service: Any) -> str:
    again = f" again after {service.restarts} restart(s)" if service is not None else ""
    return (
        f"error: tool service {', '.join(down)} stopped answering{again} during {what} ({failure.code}: "
        f"{_short(failure.message)}); {resume_hint}"
    )
