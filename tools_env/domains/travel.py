"""Travel: flights, hotels and packaged trips."""

from __future__ import annotations

from tools_env.domains.base import DB, Domain, DomainError, DomainTask, arg
from tools_env.domains.common import CITIES, date, fmt_money, money, people

HOTEL_WORDS = ["Grand", "Harbor", "Park", "Royal", "Garden", "Summit"]

DOMAIN = Domain(
    name="travel",
    description="travel agency: flights, hotels, trips",
    policy=(
        "You are a travel agent. A trip is one flight plus, optionally, a hotel in the flight's destination "
        "city for 1 to 14 nights; both need availability. The trip total is the flight price plus nights times "
        "the hotel's nightly rate. Cancelling a trip frees the seat and the room. Quote totals with two decimals."
    ),
    schema_sql="""
        CREATE TABLE flights (id TEXT PRIMARY KEY, origin TEXT, destination TEXT, date TEXT, price REAL, seats_left INTEGER);
        CREATE TABLE hotels (id TEXT PRIMARY KEY, name TEXT, city TEXT, nightly REAL, rooms_left INTEGER);
        CREATE TABLE trips (id TEXT PRIMARY KEY, traveler TEXT, flight_id TEXT, hotel_id TEXT, nights INTEGER,
                            total REAL, status TEXT);
    """,
)


@DOMAIN.seeder
def seed(db: DB, rng) -> None:
    n = 0
    for origin in CITIES[:6]:
        for dest in rng.sample([c for c in CITIES[:6] if c != origin], 3):
            for day in rng.sample(range(1, 6), 2):
                n += 1
                db.run(
                    "INSERT INTO flights VALUES (?,?,?,?,?,?)",
                    (f"FL-{n:03d}", origin, dest, date(day), money(rng.uniform(60, 600)), rng.randint(0, 9)),
                )
    n = 0
    for city in CITIES[:6]:
        for word in rng.sample(HOTEL_WORDS, 3):
            n += 1
            db.run(
                "INSERT INTO hotels VALUES (?,?,?,?,?)",
                (f"H-{n:02d}", f"{word} {city} Hotel", city, money(rng.uniform(70, 320)), rng.randint(0, 5)),
            )
    flights = db.all("SELECT * FROM flights WHERE seats_left > 0 ORDER BY id")
    for i, t in enumerate(people(rng, 8), 1):
        f = rng.choice(flights)
        db.run("INSERT INTO trips VALUES (?,?,?,?,?,?,?)", (f"TP-{i:04d}", t, f["id"], None, 0, f["price"], "booked"))


@DOMAIN.function(
    "Flights between two cities, optionally on a date (id, date, price, seats left).",
    origin=arg("string", "from city"),
    destination=arg("string", "to city"),
    date=arg("string", "YYYY-MM-DD", optional=True),
)
def search_flights(db: DB, origin: str, destination: str, date: str | None = None):
    rows = db.all(
        "SELECT id, date, price, seats_left FROM flights WHERE origin=? AND destination=? ORDER BY date, id",
        (origin, destination),
    )
    return [r for r in rows if date is None or r["date"] == date]


@DOMAIN.function("Hotels in a city (id, name, nightly rate, rooms left).", city=arg("string", "city"))
def search_hotels(db: DB, city: str):
    return db.all("SELECT id, name, nightly, rooms_left FROM hotels WHERE city = ? ORDER BY nightly, id", (city,))


@DOMAIN.function(
    "Book a trip: a flight and optionally a hotel.",
    writes=True,
    traveler=arg("string", "full name"),
    flight_id=arg("string", "flight id"),
    hotel_id=arg("string", "hotel id", optional=True),
    nights=arg("integer", "1 to 14 with a hotel", optional=True),
)
def book_trip(db: DB, traveler: str, flight_id: str, hotel_id: str | None = None, nights: int = 0):
    f = db.get("flights", "id", flight_id, "flight")
    if f["seats_left"] < 1:
        raise DomainError(f"flight {flight_id} is full")
    total = f["price"]
    if hotel_id is not None:
        h = db.get("hotels", "id", hotel_id, "hotel")
        if h["city"] != f["destination"]:
            raise DomainError("the hotel is not in the flight's destination city")
        if not 1 <= nights <= 14:
            raise DomainError("a hotel stay is 1 to 14 nights")
        if h["rooms_left"] < 1:
            raise DomainError(f"hotel {hotel_id} has no rooms left")
        total += h["nightly"] * nights
        db.run("UPDATE hotels SET rooms_left = rooms_left - 1 WHERE id = ?", (hotel_id,))
    else:
        nights = 0
    tid = db.next_id("trips", "TP-")
    db.run("UPDATE flights SET seats_left = seats_left - 1 WHERE id = ?", (flight_id,))
    db.run(
        "INSERT INTO trips VALUES (?,?,?,?,?,?,?)", (tid, traveler, flight_id, hotel_id, nights, money(total), "booked")
    )
    return {"trip_id": tid, "total": money(total)}


@DOMAIN.function("Trips of a traveler.", traveler=arg("string", "full name"))
def list_trips(db: DB, traveler: str):
    return db.all(
        "SELECT id, flight_id, hotel_id, nights, total, status FROM trips WHERE traveler = ? ORDER BY id", (traveler,)
    )


@DOMAIN.function("Cancel a booked trip.", writes=True, trip_id=arg("string", "trip id"))
def cancel_trip(db: DB, trip_id: str):
    t = db.get("trips", "id", trip_id, "trip")
    if t["status"] != "booked":
        raise DomainError(f"trip {trip_id} is {t['status']}")
    db.run("UPDATE trips SET status = 'cancelled' WHERE id = ?", (trip_id,))
    db.run("UPDATE flights SET seats_left = seats_left + 1 WHERE id = ?", (t["flight_id"],))
    if t["hotel_id"]:
        db.run("UPDATE hotels SET rooms_left = rooms_left + 1 WHERE id = ?", (t["hotel_id"],))
    return {"trip_id": trip_id, "status": "cancelled"}


@DOMAIN.template
def cheapest_package(db: DB, rng) -> DomainTask | None:
    f = rng.choice(db.all("SELECT * FROM flights WHERE seats_left > 0 ORDER BY id"))
    same_day = db.all(
        "SELECT * FROM flights WHERE origin=? AND destination=? AND date=? AND seats_left > 0 ORDER BY price",
        (f["origin"], f["destination"], f["date"]),
    )
    hotels = db.all("SELECT * FROM hotels WHERE city=? AND rooms_left > 0 ORDER BY nightly, id", (f["destination"],))
    if not hotels or same_day[0]["id"] != f["id"]:
        return None
    nights, traveler = rng.randint(1, 5), people(rng, 1)[0]
    return DomainTask(
        scenario=(
            f"I'm {traveler}. Book me the cheapest flight from {f['origin']} to {f['destination']} on {f['date']} "
            f"and the cheapest hotel there with a free room for {nights} night(s). What's the trip total?"
        ),
        gold_actions=[
            {
                "name": "book_trip",
                "arguments": {
                    "traveler": traveler,
                    "flight_id": f["id"],
                    "hotel_id": hotels[0]["id"],
                    "nights": nights,
                },
            }
        ],
        answer=lambda res: fmt_money(res[0]["total"]),
        kind="book",
    )


@DOMAIN.template
def flight_only(db: DB, rng) -> DomainTask | None:
    f = rng.choice(db.all("SELECT * FROM flights WHERE seats_left > 0 ORDER BY id"))
    if (
        len(
            db.all(
                "SELECT id FROM flights WHERE origin=? AND destination=? AND date=?",
                (f["origin"], f["destination"], f["date"]),
            )
        )
        != 1
    ):
        return None
    traveler = people(rng, 1)[0]
    return DomainTask(
        scenario=f"{traveler} here. Just the flight from {f['origin']} to {f['destination']} on {f['date']}, no hotel.",
        gold_actions=[{"name": "book_trip", "arguments": {"traveler": traveler, "flight_id": f["id"]}}],
        kind="book",
    )


@DOMAIN.template
def cancel_mine(db: DB, rng) -> DomainTask | None:
    t = rng.choice(db.all("SELECT * FROM trips WHERE status = 'booked' ORDER BY id"))
    return DomainTask(
        scenario=f"This is {t['traveler']}. Please cancel my trip.",
        gold_actions=[{"name": "cancel_trip", "arguments": {"trip_id": t["id"]}}],
        kind="cancel",
    )
