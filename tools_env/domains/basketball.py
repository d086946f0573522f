"""Basketball: a league office's teams, rosters and game results."""

from __future__ import annotations

from tools_env.domains.base import DB, Domain, DomainError, DomainTask, arg
from tools_env.domains.common import CITIES, date, people

MASCOTS = ["Otters", "Comets", "Foxes", "Pilots", "Rangers", "Tides", "Wolves", "Hawks"]
POSITIONS = ["PG", "SG", "SF", "PF", "C"]
MAX_ROSTER = 8

DOMAIN = Domain(
    name="basketball",
    description="basketball league office: rosters, games, standings",
    policy=(
        "You are the league office's assistant. A roster holds at most "
        f"{MAX_ROSTER} players; a trade moves one player to another team only if that roster has room. "
        "A game's result can be recorded once, only for a scheduled game, and ties are not allowed. "
        "Standings rank teams by wins (ties broken by team id)."
    ),
    schema_sql="""
        CREATE TABLE teams (id TEXT PRIMARY KEY, name TEXT, city TEXT);
        CREATE TABLE players (id TEXT PRIMARY KEY, name TEXT, team_id TEXT, position TEXT, ppg REAL);
        CREATE TABLE games (id TEXT PRIMARY KEY, date TEXT, home TEXT, away TEXT, home_score INTEGER,
                            away_score INTEGER, status TEXT);
    """,
)


@DOMAIN.seeder
def seed(db: DB, rng) -> None:
    cities = rng.sample(CITIES, 6)
    for i, (city, mascot) in enumerate(zip(cities, rng.sample(MASCOTS, 6)), 1):
        db.run("INSERT INTO teams VALUES (?,?,?)", (f"TM-{i}", f"{city} {mascot}", city))
    for i, name in enumerate(people(rng, 40), 1):
        team = f"TM-{(i - 1) % 6 + 1}"
        db.run(
            "INSERT INTO players VALUES (?,?,?,?,?)",
            (f"PL-{i:03d}", name, team, rng.choice(POSITIONS), round(rng.uniform(2, 28), 1)),
        )
    n = 0
    for day in range(-6, 4):
        home, away = rng.sample(range(1, 7), 2)
        n += 1
        played = day < 0
        hs, as_ = (rng.randint(80, 120), rng.randint(80, 120)) if played else (None, None)
        if played and hs == as_:
            hs += 1
        db.run(
            "INSERT INTO games VALUES (?,?,?,?,?,?,?)",
            (f"G-{n:03d}", date(day), f"TM-{home}", f"TM-{away}", hs, as_, "final" if played else "scheduled"),
        )


@DOMAIN.function("Find a team by name (id, city).", name=arg("string", "team name, e.g. 'Aldport Otters'"))
def find_team(db: DB, name: str):
    return db.get("teams", "name", name, "team")


@DOMAIN.function("A team's roster (id, name, position, points per game).", team_id=arg("string", "team id"))
def get_roster(db: DB, team_id: str):
    db.get("teams", "id", team_id, "team")
    return db.all("SELECT id, name, position, ppg FROM players WHERE team_id = ? ORDER BY id", (team_id,))


@DOMAIN.function("Games of a team (id, date, home, away, scores, status).", team_id=arg("string", "team id"))
def list_games(db: DB, team_id: str):
    return db.all("SELECT * FROM games WHERE home = ? OR away = ? ORDER BY date, id", (team_id, team_id))


@DOMAIN.function("Standings: wins and losses of every team from final games, best first.")
def get_standings(db: DB):
    table = {
        t["id"]: {"team_id": t["id"], "name": t["name"], "wins": 0, "losses": 0}
        for t in db.all("SELECT * FROM teams ORDER BY id")
    }
    for g in db.all("SELECT * FROM games WHERE status = 'final' ORDER BY id"):
        win, lose = (g["home"], g["away"]) if g["home_score"] > g["away_score"] else (g["away"], g["home"])
        table[win]["wins"] += 1
        table[lose]["losses"] += 1
    return sorted(table.values(), key=lambda r: (-r["wins"], r["team_id"]))


@DOMAIN.function(
    "Move a player to another team.",
    writes=True,
    player_id=arg("string", "player id"),
    to_team_id=arg("string", "destination team id"),
)
def trade_player(db: DB, player_id: str, to_team_id: str):
    p = db.get("players", "id", player_id, "player")
    db.get("teams", "id", to_team_id, "team")
    if p["team_id"] == to_team_id:
        raise DomainError("the player is already on that team")
    if db.one("SELECT COUNT(*) AS n FROM players WHERE team_id = ?", (to_team_id,))["n"] >= MAX_ROSTER:
        raise DomainError("destination roster is full")
    db.run("UPDATE players SET team_id = ? WHERE id = ?", (to_team_id, player_id))
    return {"player_id": player_id, "team_id": to_team_id}


@DOMAIN.function(
    "Record the final score of a scheduled game.",
    writes=True,
    game_id=arg("string", "game id"),
    home_score=arg("integer", "home points"),
    away_score=arg("integer", "away points"),
)
def record_result(db: DB, game_id: str, home_score: int, away_score: int):
    g = db.get("games", "id", game_id, "game")
    if g["status"] != "scheduled":
        raise DomainError(f"game {game_id} is already {g['status']}")
    if home_score == away_score or min(home_score, away_score) < 0:
        raise DomainError("scores must be non-negative and not tied")
    db.run("UPDATE games SET home_score=?, away_score=?, status='final' WHERE id=?", (home_score, away_score, game_id))
    return {"game_id": game_id, "status": "final"}


def _team_name(db: DB, team_id: str) -> str:
    return db.get("teams", "id", team_id, "team")["name"]


@DOMAIN.template
def top_scorer(db: DB, rng) -> DomainTask | None:
    t = rng.choice(db.all("SELECT * FROM teams ORDER BY id"))
    roster = sorted(get_roster(db, t["id"]), key=lambda p: -p["ppg"])
    if len(roster) > 1 and roster[0]["ppg"] == roster[1]["ppg"]:
        return None
    return DomainTask(
        scenario=f"Who averages the most points per game on the {t['name']}? Full name only.",
        gold_actions=[{"name": "get_roster", "arguments": {"team_id": t["id"]}}],
        answer=lambda res: roster[0]["name"],
        kind="read",
    )


@DOMAIN.template
def record_score(db: DB, rng) -> DomainTask | None:
    g = rng.choice(db.all("SELECT * FROM games WHERE status = 'scheduled' ORDER BY id"))
    hs, as_ = rng.sample(range(85, 125), 2)
    return DomainTask(
        scenario=(
            f"Final from {g['date']}: {_team_name(db, g['home'])} {hs}, {_team_name(db, g['away'])} {as_} "
            f"(home team first). Record it."
        ),
        gold_actions=[
            {"name": "record_result", "arguments": {"game_id": g["id"], "home_score": hs, "away_score": as_}}
        ],
        kind="record",
    )


@DOMAIN.template
def trade(db: DB, rng) -> DomainTask | None:
    p = rng.choice(db.all("SELECT * FROM players ORDER BY id"))
    room = [
        t
        for t in db.all(
            "SELECT t.id, t.name, COUNT(p.id) AS n FROM teams t LEFT JOIN players p ON p.team_id = t.id "
            "GROUP BY t.id ORDER BY t.id"
        )
        if t["n"] < MAX_ROSTER and t["id"] != p["team_id"]
    ]
    if not room:
        return None
    t = rng.choice(room)
    return DomainTask(
        scenario=f"Trade {p['name']} to the {t['name']}.",
        gold_actions=[{"name": "trade_player", "arguments": {"player_id": p["id"], "to_team_id": t["id"]}}],
        kind="trade",
    )


@DOMAIN.template
def leader(db: DB, rng) -> DomainTask | None:
    s = get_standings(db)
    if s[0]["wins"] == s[1]["wins"]:
        return None
    return DomainTask(
        scenario="Which team currently leads the standings? Team name only.",
        gold_actions=[{"name": "get_standings", "arguments": {}}],
        answer=lambda res: s[0]["name"],
        kind="read",
    )
