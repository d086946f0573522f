"""Play an adversarial policy against a tool service and report what its `python` code could see.

    .venv/bin/python scripts/adversarial_check.py                 # starts a service of its own
    .venv/bin/python scripts/adversarial_check.py --url http://127.0.0.1:8000 --token-env TOOLS_ENV_TOKEN

It plants a task file and a finished run's folder (0755/0644, as a user's tools leave them) under
a fresh folder below /tmp, then runs each attack of ``tools_env.adversary.ATTACKS`` in one episode
and prints one line per attack. Exit 0 when no attack reached anything, 1 otherwise (2: bad
arguments). With --url, the service must run on this machine (the planted files are local).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools_env.adversary import plant, report, run_attacks  # noqa: E402


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running service (default: start one)")
    parser.add_argument("--token-env", help="environment variable holding the service's token")
    args = parser.parse_args(argv)
    if args.token_env and args.token_env not in os.environ:
        print(f"error: --token-env {args.token_env}: no such environment variable", file=sys.stderr)
        return 2
    token = os.environ[args.token_env] if args.token_env else None
    folder = tempfile.mkdtemp(prefix="nemo-adversary-")
    try:
        if args.url:
            planted = plant(folder)
            results = run_attacks(args.url.rstrip("/"), planted, token)
        else:
            from tools_env.sandbox import sandbox_capabilities
            from tools_env.supervisor import start_service

            with start_service({}) as svc:
                planted = plant(folder, os.path.join(svc.tmpdir, "config.json"))
                results = run_attacks(svc.urls[0], planted, svc.token)
            print("sandbox here:", ", ".join(k for k, v in sandbox_capabilities().items() if v))
        lines, hits = report(results)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print("\n".join(lines))
    print(
        f"{hits} of {len(lines)} attacks reached something" if hits else f"no attack of {len(lines)} reached anything"
    )
    return 1 if hits else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
