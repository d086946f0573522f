"""Railway: timetable search, ticket booking and cancellation."""

from __future__ import annotations

from tools_env.domains.base import DB, Domain, DomainError, DomainTask, arg
from tools_env.domains.common import CITIES, date, fmt_money, money, people

DOMAIN = Domain(
    name="railway",
    description="train operator: timetable, bookings",
    policy=(
        "You are a railway booking agent. Search the timetable before booking. A booking holds 1 to 4 seats "
        "on one train and only if enough seats are left. Only bookings in status 'confirmed' can be cancelled; "
        "cancelling frees the seats. When a user asks for the cheapest or earliest train, compare all matches."
    ),
    schema_sql="""
        CREATE TABLE trains (id TEXT PRIMARY KEY, origin TEXT, destination TEXT, date TEXT, depart TEXT,
                             seats_left INTEGER, price REAL);
        CREATE TABLE bookings (id TEXT PRIMARY KEY, passenger TEXT, train_id TEXT, seats INTEGER, status TEXT);
    """,
)


@DOMAIN.seeder
def seed(db: DB, rng) -> None:
    n = 0
    routes = [(a, b) for a in CITIES[:6] for b in CITIES[:6] if a != b]
    for origin, dest in rng.sample(routes, 14):
        for day in range(3):
            for _ in range(rng.randint(2, 3)):
                n += 1
                depart = f"{rng.randint(6, 21):02d}:{rng.choice(('00', '15', '30', '45'))}"
                db.run(
                    "INSERT INTO trains VALUES (?,?,?,?,?,?,?)",
                    (
                        f"TR-{n:03d}",
                        origin,
                        dest,
                        date(day + 1),
                        depart,
                        rng.randint(0, 40),
                        money(rng.uniform(15, 120)),
                    ),
                )
    trains = db.all("SELECT id FROM trains WHERE seats_left > 2 ORDER BY id")
    for i, p in enumerate(people(rng, 10), 1):
        db.run("INSERT INTO bookings VALUES (?,?,?,?,?)", (f"BK-{i:04d}", p, rng.choice(trains)["id"], 1, "confirmed"))


@DOMAIN.function(
    "Trains between two cities on a date (id, depart time, seats left, price).",
    origin=arg("string", "departure city"),
    destination=arg("string", "arrival city"),
    date=arg("string", "YYYY-MM-DD"),
)
def search_trains(db: DB, origin: str, destination: str, date: str):
    return db.all(
        "SELECT id, depart, seats_left, price FROM trains WHERE origin = ? AND destination = ? AND date = ? "
        "ORDER BY depart, id",
        (origin, destination, date),
    )


@DOMAIN.function("Bookings (id, train, seats, status) held by a passenger.", passenger=arg("string", "full name"))
def list_bookings(db: DB, passenger: str):
    return db.all("SELECT id, train_id, seats, status FROM bookings WHERE passenger = ? ORDER BY id", (passenger,))


@DOMAIN.function(
    "Book seats on a train.",
    writes=True,
    train_id=arg("string", "train id"),
    passenger=arg("string", "full name"),
    seats=arg("integer", "1 to 4"),
)
def book_ticket(db: DB, train_id: str, passenger: str, seats: int):
    train = db.get("trains", "id", train_id, "train")
    if not 1 <= seats <= 4:
        raise DomainError("a booking holds 1 to 4 seats")
    if train["seats_left"] < seats:
        raise DomainError(f"only {train['seats_left']} seats left on {train_id}")
    bid = db.next_id("bookings", "BK-")
    db.run("UPDATE trains SET seats_left = seats_left - ? WHERE id = ?", (seats, train_id))
    db.run("INSERT INTO bookings VALUES (?,?,?,?,?)", (bid, passenger, train_id, seats, "confirmed"))
    return {"booking_id": bid, "total_price": money(train["price"] * seats)}


@DOMAIN.function("Cancel a confirmed booking.", writes=True, booking_id=arg("string", "booking id"))
def cancel_booking(db: DB, booking_id: str):
    b = db.get("bookings", "id", booking_id, "booking")
    if b["status"] != "confirmed":
        raise DomainError(f"booking {booking_id} is {b['status']}")
    db.run("UPDATE bookings SET status = 'cancelled' WHERE id = ?", (booking_id,))
    db.run("UPDATE trains SET seats_left = seats_left + ? WHERE id = ?", (b["seats"], b["train_id"]))
    return {"booking_id": booking_id, "status": "cancelled"}


def _route_with_seats(db: DB, rng, seats: int):
    rows = db.all(
        "SELECT origin, destination, date FROM trains WHERE seats_left >= ? GROUP BY origin, destination, date "
        "HAVING COUNT(*) >= 2 ORDER BY origin, destination, date",
        (seats,),
    )
    return rng.choice(rows) if rows else None


@DOMAIN.template
def book_cheapest(db: DB, rng) -> DomainTask | None:
    seats = rng.randint(1, 3)
    r = _route_with_seats(db, rng, seats)
    if r is None:
        return None
    trains = db.all(
        "SELECT * FROM trains WHERE origin=? AND destination=? AND date=? AND seats_left >= ? ORDER BY price, id",
        (r["origin"], r["destination"], r["date"], seats),
    )
    if len(trains) > 1 and trains[0]["price"] == trains[1]["price"]:
        return None
    passenger = people(rng, 1)[0]
    return DomainTask(
        scenario=(
            f"My name is {passenger}. Book {seats} seat(s) on the cheapest train from {r['origin']} to "
            f"{r['destination']} on {r['date']} that still has room, and tell me the total price."
        ),
        gold_actions=[
            {"name": "book_ticket", "arguments": {"train_id": trains[0]["id"], "passenger": passenger, "seats": seats}}
        ],
        answer=lambda res: fmt_money(res[0]["total_price"]),
        kind="book",
    )


@DOMAIN.template
def book_earliest(db: DB, rng) -> DomainTask | None:
    r = _route_with_seats(db, rng, 1)
    if r is None:
        return None
    t = db.one(
        "SELECT * FROM trains WHERE origin=? AND destination=? AND date=? AND seats_left >= 1 "
        "ORDER BY depart, id LIMIT 1",
        (r["origin"], r["destination"], r["date"]),
    )
    passenger = people(rng, 1)[0]
    return DomainTask(
        scenario=(
            f"I'm {passenger}. I need one seat on the earliest available train from {r['origin']} to "
            f"{r['destination']} on {r['date']}. Please book it and tell me the train id."
        ),
        gold_actions=[{"name": "book_ticket", "arguments": {"train_id": t["id"], "passenger": passenger, "seats": 1}}],
        answer=lambda res: t["id"],
        kind="book",
    )


@DOMAIN.template
def cancel_mine(db: DB, rng) -> DomainTask | None:
    rows = db.all("SELECT * FROM bookings WHERE status = 'confirmed' ORDER BY id")
    if not rows:
        return None
    b = rng.choice(rows)
    return DomainTask(
        scenario=f"Hello, this is {b['passenger']}. Please cancel my train booking.",
        gold_actions=[{"name": "cancel_booking", "arguments": {"booking_id": b["id"]}}],
        kind="cancel",
    )
