"""Bank: accounts, cards and transfers."""

from __future__ import annotations

from tools_env.domains.base import DB, Domain, DomainError, DomainTask, arg
from tools_env.domains.common import fmt_money, money, people

MAX_TRANSFER = 5000.0

DOMAIN = Domain(
    name="bank",
    description="retail bank: accounts, debit cards, transfers",
    policy=(
        "You are a bank support agent. Look up accounts by owner name before acting. "
        f"Transfers must be positive, at most {MAX_TRANSFER:.0f} dollars, and never from a frozen account "
        "or beyond the available balance. Freeze a card only when its owner asks; a frozen card cannot be "
        "unfrozen by the agent. Report balances with two decimals."
    ),
    schema_sql="""
        CREATE TABLE accounts (id TEXT PRIMARY KEY, owner TEXT, kind TEXT, balance REAL, frozen INTEGER);
        CREATE TABLE cards (id TEXT PRIMARY KEY, account_id TEXT, last4 TEXT, status TEXT);
        CREATE TABLE transfers (id TEXT PRIMARY KEY, from_account TEXT, to_account TEXT, amount REAL);
    """,
)


@DOMAIN.seeder
def seed(db: DB, rng) -> None:
    for i, owner in enumerate(people(rng, 24), 1):
        for kind in ("checking", "savings")[: rng.choice((1, 2))]:
            acc = f"ACC-{i:02d}{kind[0].upper()}"
            frozen = int(rng.random() < 0.1)
            db.run("INSERT INTO accounts VALUES (?,?,?,?,?)", (acc, owner, kind, money(rng.uniform(50, 9000)), frozen))
            if kind == "checking":
                db.run(
                    "INSERT INTO cards VALUES (?,?,?,?)",
                    (f"CARD-{i:02d}", acc, f"{rng.randrange(10000):04d}", "active"),
                )


@DOMAIN.function("List the accounts (id, kind, balance, frozen) owned by a customer.", owner=arg("string", "full name"))
def find_accounts(db: DB, owner: str):
    rows = db.all("SELECT id, kind, balance, frozen FROM accounts WHERE owner = ? ORDER BY id", (owner,))
    if not rows:
        raise DomainError(f"no accounts for owner {owner!r}")
    return rows


@DOMAIN.function("Balance and status of one account.", account_id=arg("string", "account id, e.g. ACC-03C"))
def get_balance(db: DB, account_id: str):
    acc = db.get("accounts", "id", account_id, "account")
    return {"account_id": account_id, "balance": acc["balance"], "frozen": bool(acc["frozen"])}


@DOMAIN.function("Debit cards attached to an account.", account_id=arg("string", "account id"))
def list_cards(db: DB, account_id: str):
    db.get("accounts", "id", account_id, "account")
    return db.all("SELECT id, last4, status FROM cards WHERE account_id = ? ORDER BY id", (account_id,))


@DOMAIN.function(
    "Move money between two accounts (subject to policy).",
    writes=True,
    from_account=arg("string", "source account id"),
    to_account=arg("string", "destination account id"),
    amount=arg("number", "dollars, > 0"),
)
def transfer(db: DB, from_account: str, to_account: str, amount: float):
    src = db.get("accounts", "id", from_account, "account")
    db.get("accounts", "id", to_account, "account")
    amount = money(amount)
    if from_account == to_account:
        raise DomainError("source and destination are the same account")
    if amount <= 0 or amount > MAX_TRANSFER:
        raise DomainError(f"amount must be in (0, {MAX_TRANSFER:.0f}]")
    if src["frozen"]:
        raise DomainError(f"account {from_account} is frozen")
    if amount > src["balance"]:
        raise DomainError("insufficient funds")
    db.run("UPDATE accounts SET balance = ROUND(balance - ?, 2) WHERE id = ?", (amount, from_account))
    db.run("UPDATE accounts SET balance = ROUND(balance + ?, 2) WHERE id = ?", (amount, to_account))
    tid = db.next_id("transfers", "TRF-")
    db.run("INSERT INTO transfers VALUES (?,?,?,?)", (tid, from_account, to_account, amount))
    return {"transfer_id": tid, "new_balance": money(src["balance"] - amount)}


@DOMAIN.function("Freeze a debit card (irreversible for the agent).", writes=True, card_id=arg("string", "card id"))
def freeze_card(db: DB, card_id: str):
    card = db.get("cards", "id", card_id, "card")
    if card["status"] == "frozen":
        raise DomainError(f"card {card_id} is already frozen")
    db.run("UPDATE cards SET status = 'frozen' WHERE id = ?", (card_id,))
    return {"card_id": card_id, "status": "frozen"}


def _open_accounts(db: DB, rng, n: int):
    rows = db.all("SELECT * FROM accounts WHERE frozen = 0 AND balance > 200 ORDER BY id")
    return rng.sample(rows, n) if len(rows) >= n else None


@DOMAIN.template
def transfer_and_report(db: DB, rng) -> DomainTask | None:
    pair = _open_accounts(db, rng, 2)
    if pair is None or pair[0]["owner"] == pair[1]["owner"]:
        return None
    src, dst = pair
    amount = money(rng.randrange(20, int(min(src["balance"], MAX_TRANSFER) * 0.8)))
    return DomainTask(
        scenario=(
            f"I'm {src['owner']}. Please send {amount:.2f} dollars from my {src['kind']} account to "
            f"account {dst['id']}, then tell me my new balance on that account."
        ),
        gold_actions=[
            {"name": "transfer", "arguments": {"from_account": src["id"], "to_account": dst["id"], "amount": amount}}
        ],
        answer=lambda res: fmt_money(res[0]["new_balance"]),
        kind="transfer",
    )


@DOMAIN.template
def freeze_lost_card(db: DB, rng) -> DomainTask | None:
    cards = db.all(
        "SELECT cards.id, accounts.owner FROM cards JOIN accounts ON accounts.id = cards.account_id "
        "WHERE cards.status = 'active' ORDER BY cards.id"
    )
    if not cards:
        return None
    c = rng.choice(cards)
    return DomainTask(
        scenario=f"This is {c['owner']}: I lost my debit card. Please freeze it right away.",
        gold_actions=[{"name": "freeze_card", "arguments": {"card_id": c["id"]}}],
        kind="freeze",
    )


@DOMAIN.template
def refuse_large_transfer(db: DB, rng) -> DomainTask | None:
    pair = _open_accounts(db, rng, 2)
    if pair is None:
        return None
    src, dst = pair
    amount = float(rng.randrange(int(MAX_TRANSFER) + 500, 20000, 250))
    return DomainTask(
        scenario=(
            f"I'm {src['owner']}. Transfer {amount:.2f} dollars from my {src['kind']} account to {dst['id']} "
            "and tell me my balance afterwards. If the bank cannot do it, just tell me my current balance."
        ),
        gold_actions=[{"name": "get_balance", "arguments": {"account_id": src["id"]}}],
        answer=lambda res: fmt_money(res[0]["balance"]),
        kind="policy_refusal",
    )
