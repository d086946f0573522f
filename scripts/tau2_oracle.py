"""Check tau2-bench's tasks through the tool service: the oracle's and doing nothing's pass rates per domain.

Every task of each domain's ``base`` split (telecom: ``small`` and ``base``) runs in the service's own
episode store with the replay user (``user: replay``): the oracle replays the record's gold script
(``gold_actions``: the agent's gold actions, the user's in the gold order), doing nothing only greets and
signs off. tau2's evaluator grades each episode. Exits 1 when the oracle passes fewer than 99% of a
domain's tasks, and names every task it failed.

    python scripts/tau2_oracle.py [--domains airline retail telecom] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from tools_env.domains.tau2.episode import environment
from tools_env.domains.tau2.importer import read_tasks, to_record
from tools_env.domains.tau2.tools import service_name
from tools_env.episodes import EpisodeStore
from tools_env.prometheus import Metrics
from tools_env.server import build_tools
from tools_env.service_config import ServiceConfig

SETS = {"airline": ["base"], "retail": ["base"], "telecom": ["small", "base"]}
TARGET = 0.99


async def play(store: EpisodeStore, record, actions) -> dict:
    ep, _ = store.create(record.to_dict())
    out: dict = {"done": False}
    for a in actions:
        out = await store.step(ep.id, a["name"], a["arguments"])
        if out["done"]:
            break
    return out


def check(domain: str, split: str, store: EpisodeStore) -> dict:
    env = environment(domain)
    tools = [service_name(domain, t.name) for t in env.get_tools()]
    records = [to_record(t, domain, split, env.get_policy(), tools) for t in read_tasks(domain, split)]
    oracle, nothing, failed, t0 = 0, 0, [], time.perf_counter()
    for i, r in enumerate(records, 1):
        out = asyncio.run(play(store, r, r.gold_actions))
        if out.get("outcome", {}).get("correct"):
            oracle += 1
        else:
            failed.append({"id": r.id, "reason": (out.get("outcome") or {}).get("reason", out.get("observation"))})
        idle = asyncio.run(play(store, r, [r.gold_actions[0], *[r.gold_actions[-1]] * 10]))
        nothing += bool(idle.get("outcome", {}).get("correct"))
        if i % 10 == 0 or i == len(records):
            print(f"  {domain}/{split}: {i}/{len(records)} tasks", file=sys.stderr, flush=True)
    n = len(records)
    return {
        "domain": domain,
        "split": split,
        "tasks": n,
        "oracle_pass": oracle / n,
        "do_nothing_pass": nothing / n,
        "failed": failed,
        "wall_s_per_episode": (time.perf_counter() - t0) / (2 * n),
    }


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--domains", nargs="+", default=list(SETS), choices=list(SETS))
    ap.add_argument("--json", default="", help="also write the rows to this file")
    args = ap.parse_args(argv)
    cfg = ServiceConfig.from_dict({"user": "replay", "guards": {"max_turns": 200}})
    store = EpisodeStore(cfg, build_tools(cfg), Metrics())
    rows = [check(d, s, store) for d in args.domains for s in SETS[d]]
    print(f"{'domain/split':<16} {'tasks':>5} {'oracle':>7} {'nothing':>8} {'s/episode':>9}")
    for r in rows:
        print(
            f"{r['domain'] + '/' + r['split']:<16} {r['tasks']:>5} {r['oracle_pass']:>7.3f} "
            f"{r['do_nothing_pass']:>8.3f} {r['wall_s_per_episode']:>9.2f}"
        )
        for f in r["failed"]:
            print(f"  oracle failed {f['id']}: {f['reason']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    short = [r for r in rows if r["oracle_pass"] < TARGET]
    if short:
        print(f"error: the oracle passes fewer than {TARGET:.0%} of {', '.join(r['domain'] for r in short)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
