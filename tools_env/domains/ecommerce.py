"""E-commerce: catalogue, orders, cancellations."""

from __future__ import annotations

from tools_env.domains.base import DB, Domain, DomainError, DomainTask, arg
from tools_env.domains.common import fmt_money, money, people

CATEGORIES = {
    "audio": ["Headphones", "Speaker", "Earbuds"],
    "kitchen": ["Kettle", "Blender", "Toaster"],
    "office": ["Desk Lamp", "Notebook", "Stapler"],
    "outdoor": ["Tent", "Lantern", "Backpack"],
}
BRANDS = ["Acme", "Borealis", "Corvid", "Dynamo", "Everly"]

DOMAIN = Domain(
    name="ecommerce",
    description="online shop: catalogue, orders",
    policy=(
        "You are a shop assistant. Find products with search_products before ordering. An order holds one "
        "product line of 1 to 5 units and needs enough stock. Only orders in status 'pending' can be "
        "cancelled; shipped orders cannot. Quote totals with two decimals."
    ),
    schema_sql="""
        CREATE TABLE products (id TEXT PRIMARY KEY, name TEXT, category TEXT, price REAL, stock INTEGER);
        CREATE TABLE orders (id TEXT PRIMARY KEY, customer TEXT, product_id TEXT, quantity INTEGER, total REAL,
                             status TEXT);
    """,
)


@DOMAIN.seeder
def seed(db: DB, rng) -> None:
    n = 0
    for cat, items in CATEGORIES.items():
        for item in items:
            for brand in rng.sample(BRANDS, 2):
                n += 1
                db.run(
                    "INSERT INTO products VALUES (?,?,?,?,?)",
                    (f"P-{n:03d}", f"{brand} {item}", cat, money(rng.uniform(5, 250)), rng.randint(0, 30)),
                )
    products = db.all("SELECT id, price FROM products ORDER BY id")
    for i, c in enumerate(people(rng, 12), 1):
        p = rng.choice(products)
        q = rng.randint(1, 3)
        db.run(
            "INSERT INTO orders VALUES (?,?,?,?,?,?)",
            (f"ORD-{i:04d}", c, p["id"], q, money(p["price"] * q), rng.choice(("pending", "shipped"))),
        )


@DOMAIN.function(
    "Products whose name contains the query, optionally in one category (id, name, price, stock).",
    query=arg("string", "words of the product name"),
    category=arg("string", "category filter", enum=sorted(CATEGORIES), optional=True),
)
def search_products(db: DB, query: str, category: str | None = None):
    rows = db.all(
        "SELECT id, name, category, price, stock FROM products WHERE name LIKE ? ORDER BY id", (f"%{query}%",)
    )
    return [r for r in rows if category is None or r["category"] == category]


@DOMAIN.function("Orders (id, product, quantity, total, status) of a customer.", customer=arg("string", "full name"))
def list_orders(db: DB, customer: str):
    return db.all(
        "SELECT id, product_id, quantity, total, status FROM orders WHERE customer = ? ORDER BY id", (customer,)
    )


@DOMAIN.function(
    "Place an order for one product.",
    writes=True,
    customer=arg("string", "full name"),
    product_id=arg("string", "product id"),
    quantity=arg("integer", "1 to 5"),
)
def place_order(db: DB, customer: str, product_id: str, quantity: int):
    p = db.get("products", "id", product_id, "product")
    if not 1 <= quantity <= 5:
        raise DomainError("quantity must be 1 to 5")
    if p["stock"] < quantity:
        raise DomainError(f"only {p['stock']} in stock")
    oid = db.next_id("orders", "ORD-")
    total = money(p["price"] * quantity)
    db.run("UPDATE products SET stock = stock - ? WHERE id = ?", (quantity, product_id))
    db.run("INSERT INTO orders VALUES (?,?,?,?,?,?)", (oid, customer, product_id, quantity, total, "pending"))
    return {"order_id": oid, "total": total}


@DOMAIN.function("Cancel a pending order and restock it.", writes=True, order_id=arg("string", "order id"))
def cancel_order(db: DB, order_id: str):
    o = db.get("orders", "id", order_id, "order")
    if o["status"] != "pending":
        raise DomainError(f"order {order_id} is {o['status']} and cannot be cancelled")
    db.run("UPDATE orders SET status = 'cancelled' WHERE id = ?", (order_id,))
    db.run("UPDATE products SET stock = stock + ? WHERE id = ?", (o["quantity"], o["product_id"]))
    return {"order_id": order_id, "status": "cancelled"}


@DOMAIN.template
def order_cheapest(db: DB, rng) -> DomainTask | None:
    cat = rng.choice(sorted(CATEGORIES))
    item = rng.choice(CATEGORIES[cat])
    q = rng.randint(1, 3)
    rows = db.all("SELECT * FROM products WHERE name LIKE ? AND stock >= ? ORDER BY price, id", (f"%{item}", q))
    if not rows or (len(rows) > 1 and rows[0]["price"] == rows[1]["price"]):
        return None
    customer = people(rng, 1)[0]
    return DomainTask(
        scenario=(
            f"I'm {customer}. Order {q} of the cheapest {item.lower()} you have in stock and tell me the order total."
        ),
        gold_actions=[
            {"name": "place_order", "arguments": {"customer": customer, "product_id": rows[0]["id"], "quantity": q}}
        ],
        answer=lambda res: fmt_money(res[0]["total"]),
        kind="order",
    )


@DOMAIN.template
def cancel_pending(db: DB, rng) -> DomainTask | None:
    rows = db.all("SELECT * FROM orders WHERE status = 'pending' ORDER BY id")
    if not rows:
        return None
    o = rng.choice(rows)
    return DomainTask(
        scenario=f"Hi, {o['customer']} here. Please cancel my order.",
        gold_actions=[{"name": "cancel_order", "arguments": {"order_id": o["id"]}}],
        kind="cancel",
    )


@DOMAIN.template
def refuse_shipped(db: DB, rng) -> DomainTask | None:
    rows = db.all("SELECT * FROM orders WHERE status = 'shipped' ORDER BY id")
    if not rows:
        return None
    o = rng.choice(rows)
    return DomainTask(
        scenario=(f"This is {o['customer']}. Cancel my order if you can; either way tell me its current status."),
        gold_actions=[{"name": "list_orders", "arguments": {"customer": o["customer"]}}],
        answer=lambda res: "shipped",
        kind="policy_refusal",
    )
