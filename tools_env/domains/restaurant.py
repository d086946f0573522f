"""Restaurant: a reservation platform."""

from __future__ import annotations

from tools_env.domains.base import DB, Domain, DomainError, DomainTask, arg
from tools_env.domains.common import CITIES, date, people

CUISINES = ["italian", "japanese", "mexican", "indian", "french", "thai"]
WORDS = ["Golden", "Blue", "Little", "Old", "Wild", "Silver", "Green", "Copper"]
NOUNS = ["Fig", "Lantern", "Spoon", "Garden", "Harbor", "Oven", "Table", "Pepper"]
SLOTS = ["18:00", "19:00", "20:00", "21:00"]

DOMAIN = Domain(
    name="restaurant",
    description="restaurant reservations",
    policy=(
        "You are a reservation agent. Parties are 1 to 8 people. A reservation is possible only if the "
        "restaurant's seats for that date and time slot, minus seats already reserved, cover the party. "
        "Slots are 18:00, 19:00, 20:00 and 21:00. Cancel only the caller's own reservation."
    ),
    schema_sql="""
        CREATE TABLE restaurants (id TEXT PRIMARY KEY, name TEXT, cuisine TEXT, city TEXT, rating REAL, seats INTEGER);
        CREATE TABLE reservations (id TEXT PRIMARY KEY, restaurant_id TEXT, customer TEXT, date TEXT, time TEXT,
                                   party INTEGER, status TEXT);
    """,
)


@DOMAIN.seeder
def seed(db: DB, rng) -> None:
    names = rng.sample([f"The {w} {n}" for w in WORDS for n in NOUNS], 20)
    for i, name in enumerate(names, 1):
        db.run(
            "INSERT INTO restaurants VALUES (?,?,?,?,?,?)",
            (
                f"R-{i:02d}",
                name,
                rng.choice(CUISINES),
                rng.choice(CITIES[:5]),
                rng.randint(30, 50) / 10,
                rng.randint(10, 30),
            ),
        )
    for i, c in enumerate(people(rng, 30), 1):
        db.run(
            "INSERT INTO reservations VALUES (?,?,?,?,?,?,?)",
            (
                f"RS-{i:04d}",
                f"R-{rng.randint(1, 20):02d}",
                c,
                date(rng.randint(1, 3)),
                rng.choice(SLOTS),
                rng.randint(2, 8),
                "booked",
            ),
        )


@DOMAIN.function(
    "Restaurants in a city, optionally of one cuisine (id, name, cuisine, rating).",
    city=arg("string", "city"),
    cuisine=arg("string", "cuisine", enum=CUISINES, optional=True),
)
def search_restaurants(db: DB, city: str, cuisine: str | None = None):
    rows = db.all("SELECT id, name, cuisine, rating FROM restaurants WHERE city = ? ORDER BY rating DESC, id", (city,))
    return [r for r in rows if cuisine is None or r["cuisine"] == cuisine]


def _free(db: DB, restaurant_id: str, date_: str, time: str) -> int:
    r = db.get("restaurants", "id", restaurant_id, "restaurant")
    taken = db.one(
        "SELECT COALESCE(SUM(party), 0) AS n FROM reservations WHERE restaurant_id=? AND date=? AND time=? "
        "AND status='booked'",
        (restaurant_id, date_, time),
    )["n"]
    return max(0, r["seats"] - taken)


@DOMAIN.function(
    "Free seats at a restaurant for a date and slot.",
    restaurant_id=arg("string", "restaurant id"),
    date=arg("string", "YYYY-MM-DD"),
    time=arg("string", "slot", enum=SLOTS),
)
def check_availability(db: DB, restaurant_id: str, date: str, time: str):
    return {
        "restaurant_id": restaurant_id,
        "date": date,
        "time": time,
        "free_seats": _free(db, restaurant_id, date, time),
    }


@DOMAIN.function(
    "Reserve a table.",
    writes=True,
    restaurant_id=arg("string", "restaurant id"),
    customer=arg("string", "full name"),
    date=arg("string", "YYYY-MM-DD"),
    time=arg("string", "slot", enum=SLOTS),
    party=arg("integer", "1 to 8 people"),
)
def make_reservation(db: DB, restaurant_id: str, customer: str, date: str, time: str, party: int):
    if not 1 <= party <= 8:
        raise DomainError("parties are 1 to 8 people")
    if time not in SLOTS:
        raise DomainError(f"time must be one of {SLOTS}")
    if _free(db, restaurant_id, date, time) < party:
        raise DomainError("not enough free seats for that slot")
    rid = db.next_id("reservations", "RS-")
    db.run(
        "INSERT INTO reservations VALUES (?,?,?,?,?,?,?)", (rid, restaurant_id, customer, date, time, party, "booked")
    )
    return {"reservation_id": rid}


@DOMAIN.function("Reservations of a customer.", customer=arg("string", "full name"))
def list_reservations(db: DB, customer: str):
    return db.all(
        "SELECT id, restaurant_id, date, time, party, status FROM reservations WHERE customer = ? ORDER BY id",
        (customer,),
    )


@DOMAIN.function("Cancel a reservation.", writes=True, reservation_id=arg("string", "reservation id"))
def cancel_reservation(db: DB, reservation_id: str):
    r = db.get("reservations", "id", reservation_id, "reservation")
    if r["status"] != "booked":
        raise DomainError(f"reservation {reservation_id} is {r['status']}")
    db.run("UPDATE reservations SET status = 'cancelled' WHERE id = ?", (reservation_id,))
    return {"reservation_id": reservation_id, "status": "cancelled"}


@DOMAIN.template
def book_best_rated(db: DB, rng) -> DomainTask | None:
    city, cuisine = rng.choice(CITIES[:5]), rng.choice(CUISINES)
    rows = db.all("SELECT * FROM restaurants WHERE city=? AND cuisine=? ORDER BY rating DESC, id", (city, cuisine))
    if not rows or (len(rows) > 1 and rows[0]["rating"] == rows[1]["rating"]):
        return None
    party, day, slot = rng.randint(2, 6), date(rng.randint(1, 3)), rng.choice(SLOTS)
    if _free(db, rows[0]["id"], day, slot) < party:
        return None
    customer = people(rng, 1)[0]
    return DomainTask(
        scenario=(
            f"I'm {customer}. Book a table for {party} at the best-rated {cuisine} restaurant in {city} on "
            f"{day} at {slot}. What's the restaurant called?"
        ),
        gold_actions=[
            {
                "name": "make_reservation",
                "arguments": {
                    "restaurant_id": rows[0]["id"],
                    "customer": customer,
                    "date": day,
                    "time": slot,
                    "party": party,
                },
            }
        ],
        answer=lambda res: rows[0]["name"],
        kind="reserve",
    )


@DOMAIN.template
def cancel_mine(db: DB, rng) -> DomainTask | None:
    r = rng.choice(
        db.all(
            "SELECT reservations.*, restaurants.name FROM reservations JOIN restaurants "
            "ON restaurants.id = restaurant_id WHERE status='booked' ORDER BY reservations.id"
        )
    )
    return DomainTask(
        scenario=f"Hi, {r['customer']} speaking. Please cancel my reservation at {r['name']}.",
        gold_actions=[{"name": "cancel_reservation", "arguments": {"reservation_id": r["id"]}}],
        kind="cancel",
    )


@DOMAIN.template
def count_free(db: DB, rng) -> DomainTask | None:
    r = rng.choice(db.all("SELECT * FROM restaurants ORDER BY id"))
    day, slot = date(rng.randint(1, 3)), rng.choice(SLOTS)
    return DomainTask(
        scenario=f"How many seats are still free at {r['name']} in {r['city']} on {day} at {slot}? Don't book anything.",
        gold_actions=[
            {"name": "check_availability", "arguments": {"restaurant_id": r["id"], "date": day, "time": slot}}
        ],
        answer=lambda res: str(res[0]["free_seats"]),
        kind="read",
    )
