"""Weather: station readings, forecasts and alert subscriptions."""

from __future__ import annotations

from tools_env.domains.base import DB, Domain, DomainError, DomainTask, arg
from tools_env.domains.common import CITIES, date, people

CONDITIONS = ["sunny", "cloudy", "rain", "storm", "fog", "snow"]
ALERT_KINDS = ["storm", "heat", "flood", "frost"]
MAX_SUBSCRIPTIONS = 3

DOMAIN = Domain(
    name="weather",
    description="weather service: forecasts, alert subscriptions",
    policy=(
        "You are a weather service assistant. Forecasts cover the next 7 days for each city. Users may hold "
        f"at most {MAX_SUBSCRIPTIONS} active alert subscriptions and one per (city, kind). Temperatures are in "
        "degrees Celsius, reported as integers."
    ),
    schema_sql="""
        CREATE TABLE forecasts (city TEXT, date TEXT, condition TEXT, high_c INTEGER, low_c INTEGER,
                                PRIMARY KEY (city, date));
        CREATE TABLE subscriptions (id TEXT PRIMARY KEY, user TEXT, city TEXT, kind TEXT, status TEXT);
    """,
)


@DOMAIN.seeder
def seed(db: DB, rng) -> None:
    for city in CITIES:
        base = rng.randint(8, 26)
        for day in range(7):
            high = base + rng.randint(-4, 6)
            db.run(
                "INSERT INTO forecasts VALUES (?,?,?,?,?)",
                (city, date(day), rng.choice(CONDITIONS), high, high - rng.randint(4, 12)),
            )
    for i, u in enumerate(people(rng, 10), 1):
        db.run(
            "INSERT INTO subscriptions VALUES (?,?,?,?,?)",
            (f"SUB-{i:04d}", u, rng.choice(CITIES), rng.choice(ALERT_KINDS), "active"),
        )


@DOMAIN.function(
    "Forecast for a city on a date (condition, high, low in C).",
    city=arg("string", "city"),
    date=arg("string", "YYYY-MM-DD"),
)
def get_forecast(db: DB, city: str, date: str):
    row = db.one("SELECT condition, high_c, low_c FROM forecasts WHERE city=? AND date=?", (city, date))
    if row is None:
        raise DomainError(f"no forecast for {city!r} on {date!r}")
    return {"city": city, "date": date, **row}


@DOMAIN.function("The whole 7-day forecast of a city.", city=arg("string", "city"))
def get_week(db: DB, city: str):
    rows = db.all("SELECT date, condition, high_c, low_c FROM forecasts WHERE city=? ORDER BY date", (city,))
    if not rows:
        raise DomainError(f"unknown city {city!r}")
    return rows


@DOMAIN.function("A user's alert subscriptions.", user=arg("string", "full name"))
def list_subscriptions(db: DB, user: str):
    return db.all("SELECT id, city, kind, status FROM subscriptions WHERE user = ? ORDER BY id", (user,))


@DOMAIN.function(
    "Subscribe a user to alerts of one kind for a city.",
    writes=True,
    user=arg("string", "full name"),
    city=arg("string", "city"),
    kind=arg("string", "alert kind", enum=ALERT_KINDS),
)
def subscribe(db: DB, user: str, city: str, kind: str):
    if not db.one("SELECT 1 FROM forecasts WHERE city = ?", (city,)):
        raise DomainError(f"unknown city {city!r}")
    if kind not in ALERT_KINDS:
        raise DomainError(f"kind must be one of {ALERT_KINDS}")
    active = db.all("SELECT city, kind FROM subscriptions WHERE user=? AND status='active'", (user,))
    if {"city": city, "kind": kind} in active:
        raise DomainError("already subscribed")
    if len(active) >= MAX_SUBSCRIPTIONS:
        raise DomainError(f"at most {MAX_SUBSCRIPTIONS} active subscriptions")
    sid = db.next_id("subscriptions", "SUB-")
    db.run("INSERT INTO subscriptions VALUES (?,?,?,?,?)", (sid, user, city, kind, "active"))
    return {"subscription_id": sid}


@DOMAIN.function("Stop a subscription.", writes=True, subscription_id=arg("string", "subscription id"))
def unsubscribe(db: DB, subscription_id: str):
    s = db.get("subscriptions", "id", subscription_id, "subscription")
    if s["status"] != "active":
        raise DomainError(f"subscription {subscription_id} is {s['status']}")
    db.run("UPDATE subscriptions SET status = 'cancelled' WHERE id = ?", (subscription_id,))
    return {"subscription_id": subscription_id, "status": "cancelled"}


@DOMAIN.template
def warmest_day(db: DB, rng) -> DomainTask | None:
    city = rng.choice(CITIES)
    rows = db.all("SELECT * FROM forecasts WHERE city=? ORDER BY high_c DESC, date", (city,))
    if rows[0]["high_c"] == rows[1]["high_c"]:
        return None
    return DomainTask(
        scenario=f"Which day this week will be warmest in {city}? Answer with the date (YYYY-MM-DD).",
        gold_actions=[{"name": "get_week", "arguments": {"city": city}}],
        answer=lambda res: rows[0]["date"],
        kind="read",
    )


@DOMAIN.template
def subscribe_new(db: DB, rng) -> DomainTask | None:
    user, city, kind = people(rng, 1)[0], rng.choice(CITIES), rng.choice(ALERT_KINDS)
    if db.one("SELECT 1 FROM subscriptions WHERE user=?", (user,)):
        return None
    return DomainTask(
        scenario=f"I'm {user}. Sign me up for {kind} alerts in {city}.",
        gold_actions=[{"name": "subscribe", "arguments": {"user": user, "city": city, "kind": kind}}],
        kind="subscribe",
    )


@DOMAIN.template
def unsubscribe_mine(db: DB, rng) -> DomainTask | None:
    s = rng.choice(db.all("SELECT * FROM subscriptions WHERE status='active' ORDER BY id"))
    return DomainTask(
        scenario=f"{s['user']} here. Stop my {s['kind']} alerts for {s['city']}, please.",
        gold_actions=[{"name": "unsubscribe", "arguments": {"subscription_id": s["id"]}}],
        kind="unsubscribe",
    )


@DOMAIN.template
def temperature(db: DB, rng) -> DomainTask | None:
    city, day = rng.choice(CITIES), date(rng.randint(0, 6))
    return DomainTask(
        scenario=f"What's the forecast high in {city} on {day}, in degrees Celsius? Just the number.",
        gold_actions=[{"name": "get_forecast", "arguments": {"city": city, "date": day}}],
        answer=lambda res: str(res[0]["high_c"]),
        kind="read",
    )
