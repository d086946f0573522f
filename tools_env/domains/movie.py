"""Movie: a cinema chain's films, showtimes and tickets."""

from __future__ import annotations

from tools_env.domains.base import DB, Domain, DomainError, DomainTask, arg
from tools_env.domains.common import date, fmt_money, money, people

TITLES = [
    "The Last Lighthouse",
    "Paper Moons",
    "Glass Harbor",
    "Iron Orchard",
    "Quiet Comet",
    "Salt & Silver",
    "Midnight Ferry",
    "The Ninth Bridge",
    "Velvet Static",
    "Northbound",
]
GENRES = ["drama", "comedy", "thriller", "sci-fi", "animation"]
THEATERS = ["Roxy", "Odeon", "Lumiere"]

DOMAIN = Domain(
    name="movie",
    description="cinema chain: films, showtimes, tickets",
    policy=(
        "You are a cinema ticketing agent. A purchase is 1 to 6 seats for one showtime with enough seats "
        "left. Refunds are allowed only for tickets whose showtime is after today (2025-06-01); refunded "
        "tickets free their seats. Quote prices with two decimals."
    ),
    schema_sql="""
        CREATE TABLE movies (id TEXT PRIMARY KEY, title TEXT, genre TEXT, minutes INTEGER);
        CREATE TABLE showtimes (id TEXT PRIMARY KEY, movie_id TEXT, theater TEXT, date TEXT, time TEXT,
                                seats_left INTEGER, price REAL);
        CREATE TABLE tickets (id TEXT PRIMARY KEY, showtime_id TEXT, customer TEXT, seats INTEGER, status TEXT);
    """,
)


@DOMAIN.seeder
def seed(db: DB, rng) -> None:
    n = 0
    for i, title in enumerate(TITLES, 1):
        db.run("INSERT INTO movies VALUES (?,?,?,?)", (f"M-{i:02d}", title, rng.choice(GENRES), rng.randint(85, 170)))
        for theater in rng.sample(THEATERS, 2):
            for day in rng.sample(range(0, 4), 2):
                n += 1
                db.run(
                    "INSERT INTO showtimes VALUES (?,?,?,?,?,?,?)",
                    (
                        f"S-{n:03d}",
                        f"M-{i:02d}",
                        theater,
                        date(day),
                        f"{rng.randint(12, 22)}:{rng.choice(('00', '30'))}",
                        rng.randint(0, 60),
                        money(rng.choice((8.5, 9.0, 11.5, 12.0, 14.0))),
                    ),
                )
    shows = db.all("SELECT id FROM showtimes ORDER BY id")
    for i, c in enumerate(people(rng, 10), 1):
        db.run(
            "INSERT INTO tickets VALUES (?,?,?,?,?)",
            (f"T-{i:04d}", rng.choice(shows)["id"], c, rng.randint(1, 3), "paid"),
        )


@DOMAIN.function("Find films by (part of) title (id, title, genre, minutes).", title=arg("string", "title words"))
def search_movies(db: DB, title: str):
    return db.all("SELECT * FROM movies WHERE title LIKE ? ORDER BY id", (f"%{title}%",))


@DOMAIN.function(
    "Showtimes of a film (id, theater, date, time, seats left, price).", movie_id=arg("string", "movie id")
)
def list_showtimes(db: DB, movie_id: str):
    db.get("movies", "id", movie_id, "movie")
    return db.all(
        "SELECT id, theater, date, time, seats_left, price FROM showtimes WHERE movie_id = ? ORDER BY date, time, id",
        (movie_id,),
    )


@DOMAIN.function("Tickets of a customer (id, showtime, seats, status).", customer=arg("string", "full name"))
def list_tickets(db: DB, customer: str):
    return db.all("SELECT id, showtime_id, seats, status FROM tickets WHERE customer = ? ORDER BY id", (customer,))


@DOMAIN.function(
    "Buy seats for a showtime.",
    writes=True,
    showtime_id=arg("string", "showtime id"),
    customer=arg("string", "full name"),
    seats=arg("integer", "1 to 6"),
)
def buy_tickets(db: DB, showtime_id: str, customer: str, seats: int):
    s = db.get("showtimes", "id", showtime_id, "showtime")
    if not 1 <= seats <= 6:
        raise DomainError("a purchase is 1 to 6 seats")
    if s["seats_left"] < seats:
        raise DomainError(f"only {s['seats_left']} seats left")
    tid = db.next_id("tickets", "T-")
    db.run("UPDATE showtimes SET seats_left = seats_left - ? WHERE id = ?", (seats, showtime_id))
    db.run("INSERT INTO tickets VALUES (?,?,?,?,?)", (tid, showtime_id, customer, seats, "paid"))
    return {"ticket_id": tid, "total": money(s["price"] * seats)}


@DOMAIN.function("Refund a ticket for a future showtime.", writes=True, ticket_id=arg("string", "ticket id"))
def refund_ticket(db: DB, ticket_id: str):
    t = db.get("tickets", "id", ticket_id, "ticket")
    s = db.get("showtimes", "id", t["showtime_id"], "showtime")
    if t["status"] != "paid":
        raise DomainError(f"ticket {ticket_id} is {t['status']}")
    if s["date"] <= date(0):
        raise DomainError("showtime is not in the future; no refund")
    db.run("UPDATE tickets SET status = 'refunded' WHERE id = ?", (ticket_id,))
    db.run("UPDATE showtimes SET seats_left = seats_left + ? WHERE id = ?", (t["seats"], s["id"]))
    return {"ticket_id": ticket_id, "status": "refunded"}


@DOMAIN.template
def buy_for_show(db: DB, rng) -> DomainTask | None:
    seats = rng.randint(1, 4)
    rows = db.all(
        "SELECT showtimes.*, movies.title FROM showtimes JOIN movies ON movies.id = movie_id "
        "WHERE seats_left >= ? ORDER BY showtimes.id",
        (seats,),
    )
    s = rng.choice(rows)
    customer = people(rng, 1)[0]
    return DomainTask(
        scenario=(
            f"I'm {customer}. Get me {seats} seat(s) for '{s['title']}' at the {s['theater']} on {s['date']} "
            f"at {s['time']}, and tell me the total."
        ),
        gold_actions=[
            {"name": "buy_tickets", "arguments": {"showtime_id": s["id"], "customer": customer, "seats": seats}}
        ],
        answer=lambda res: fmt_money(res[0]["total"]),
        kind="buy",
    )


@DOMAIN.template
def refund(db: DB, rng) -> DomainTask | None:
    rows = db.all(
        "SELECT tickets.id, customer, date FROM tickets JOIN showtimes ON showtimes.id = showtime_id "
        "WHERE status = 'paid' ORDER BY tickets.id"
    )
    t = rng.choice(rows)
    future = t["date"] > date(0)
    return DomainTask(
        scenario=(
            f"This is {t['customer']}. I can't make it to my movie; please refund my ticket if possible. "
            "Answer 'refunded' or 'not refundable'."
        ),
        gold_actions=[{"name": "refund_ticket", "arguments": {"ticket_id": t["id"]}}]
        if future
        else [{"name": "list_tickets", "arguments": {"customer": t["customer"]}}],
        answer=lambda res: "refunded" if future else "not refundable",
        kind="refund" if future else "policy_refusal",
    )


@DOMAIN.template
def cheapest_show(db: DB, rng) -> DomainTask | None:
    m = rng.choice(db.all("SELECT * FROM movies ORDER BY id"))
    rows = db.all(
        "SELECT * FROM showtimes WHERE movie_id = ? AND seats_left >= 2 ORDER BY price, date, time", (m["id"],)
    )
    if not rows or (len(rows) > 1 and rows[0]["price"] == rows[1]["price"]):
        return None
    customer = people(rng, 1)[0]
    return DomainTask(
        scenario=f"{customer} here: two seats for '{m['title']}' at whichever showtime is cheapest, please. Which theater is it?",
        gold_actions=[
            {"name": "buy_tickets", "arguments": {"showtime_id": rows[0]["id"], "customer": customer, "seats": 2}}
        ],
        answer=lambda res: rows[0]["theater"],
        kind="buy",
    )
