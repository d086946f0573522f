"""What this host allows a run: the layers the probe entered, the sandbox interpreter, the cgroup."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class _Plan:
    root: bool
    python: str  # the sandbox interpreter
    layers: dict  # uid_drop, userns, netns, pidns, mountns, proc, allowlist, nnp -> entered by the probe
    python_ok: bool  # the probe's bootstrap ran under all the layers
    cgroup_base: str | None
    allow: dict | None = None  # allowlist.host_allowlist(python): what a run's own root holds


def _strict(plan: _Plan, network: bool) -> bool:
    """The audit hook is the only barrier for network, filesystem or other processes, so it refuses more."""
    ly = plan.layers
    return not (ly["mountns"] and (network or ly["netns"]) and (ly["uid_drop"] or ly["pidns"] and ly["proc"]))
