"""Medicine: a clinic's patients, formulary and prescriptions."""

from __future__ import annotations

from tools_env.domains.base import DB, Domain, DomainError, DomainTask, arg
from tools_env.domains.common import people

DRUGS = [  # name, class, max daily dose (mg)
    ("Amoxil", "penicillin", 3000),
    ("Penvax", "penicillin", 2000),
    ("Cefron", "cephalosporin", 4000),
    ("Ibuprel", "nsaid", 2400),
    ("Naprolin", "nsaid", 1000),
    ("Paracet", "analgesic", 4000),
    ("Lisinor", "ace_inhibitor", 80),
    ("Metforal", "biguanide", 2550),
    ("Sertalin", "ssri", 200),
    ("Atorva", "statin", 80),
]
ALLERGY_CLASSES = ["penicillin", "nsaid", "cephalosporin", "ssri"]

DOMAIN = Domain(
    name="medicine",
    description="clinic pharmacy: patients, drugs, prescriptions",
    policy=(
        "You are a clinic's prescribing assistant. Identify the patient with find_patient. Never prescribe "
        "a drug whose class is among the patient's allergies, nor a daily dose above the drug's maximum; "
        "in that case prescribe nothing and explain. A patient holds at most one active prescription per drug. "
        "Discontinue a prescription only when asked."
    ),
    schema_sql="""
        CREATE TABLE patients (id TEXT PRIMARY KEY, name TEXT, birth_year INTEGER, allergies TEXT);
        CREATE TABLE drugs (id TEXT PRIMARY KEY, name TEXT, class TEXT, max_daily_mg INTEGER);
        CREATE TABLE prescriptions (id TEXT PRIMARY KEY, patient_id TEXT, drug_id TEXT, daily_mg INTEGER, status TEXT);
    """,
)


@DOMAIN.seeder
def seed(db: DB, rng) -> None:
    for i, (name, cls, mx) in enumerate(DRUGS, 1):
        db.run("INSERT INTO drugs VALUES (?,?,?,?)", (f"D-{i:02d}", name, cls, mx))
    for i, name in enumerate(people(rng, 20), 1):
        allergies = ",".join(sorted(rng.sample(ALLERGY_CLASSES, rng.choice((0, 0, 1, 2)))))
        db.run("INSERT INTO patients VALUES (?,?,?,?)", (f"PT-{i:03d}", name, rng.randint(1940, 2010), allergies))
    for i in range(1, 13):
        db.run(
            "INSERT INTO prescriptions VALUES (?,?,?,?,?)",
            (
                f"RX-{i:04d}",
                f"PT-{rng.randint(1, 20):03d}",
                f"D-{rng.randint(7, 10):02d}",
                10 * rng.randint(1, 5),
                "active",
            ),
        )


@DOMAIN.function("Find a patient by name (id, birth year, allergy classes).", name=arg("string", "full name"))
def find_patient(db: DB, name: str):
    p = db.get("patients", "name", name, "patient")
    return {
        "patient_id": p["id"],
        "birth_year": p["birth_year"],
        "allergies": [a for a in p["allergies"].split(",") if a],
    }


@DOMAIN.function("Look a drug up in the formulary (id, class, max daily dose).", name=arg("string", "drug name"))
def find_drug(db: DB, name: str):
    d = db.get("drugs", "name", name, "drug")
    return {"drug_id": d["id"], "class": d["class"], "max_daily_mg": d["max_daily_mg"]}


@DOMAIN.function("A patient's prescriptions.", patient_id=arg("string", "patient id"))
def list_prescriptions(db: DB, patient_id: str):
    db.get("patients", "id", patient_id, "patient")
    return db.all(
        "SELECT id, drug_id, daily_mg, status FROM prescriptions WHERE patient_id = ? ORDER BY id", (patient_id,)
    )


@DOMAIN.function(
    "Prescribe a drug (subject to allergy and dose policy).",
    writes=True,
    patient_id=arg("string", "patient id"),
    drug_id=arg("string", "drug id"),
    daily_mg=arg("integer", "daily dose in mg"),
)
def prescribe(db: DB, patient_id: str, drug_id: str, daily_mg: int):
    p = db.get("patients", "id", patient_id, "patient")
    d = db.get("drugs", "id", drug_id, "drug")
    if d["class"] in p["allergies"].split(","):
        raise DomainError(f"patient is allergic to {d['class']}")
    if not 0 < daily_mg <= d["max_daily_mg"]:
        raise DomainError(f"daily dose must be in (0, {d['max_daily_mg']}] mg")
    if db.one(
        "SELECT id FROM prescriptions WHERE patient_id=? AND drug_id=? AND status='active'", (patient_id, drug_id)
    ):
        raise DomainError("an active prescription for this drug already exists")
    rx = db.next_id("prescriptions", "RX-")
    db.run("INSERT INTO prescriptions VALUES (?,?,?,?,?)", (rx, patient_id, drug_id, daily_mg, "active"))
    return {"prescription_id": rx}


@DOMAIN.function("Discontinue an active prescription.", writes=True, prescription_id=arg("string", "prescription id"))
def discontinue(db: DB, prescription_id: str):
    rx = db.get("prescriptions", "id", prescription_id, "prescription")
    if rx["status"] != "active":
        raise DomainError(f"prescription {prescription_id} is {rx['status']}")
    db.run("UPDATE prescriptions SET status = 'discontinued' WHERE id = ?", (prescription_id,))
    return {"prescription_id": prescription_id, "status": "discontinued"}


def _patient(db: DB, rng):
    return rng.choice(db.all("SELECT * FROM patients ORDER BY id"))


@DOMAIN.template
def prescribe_safe(db: DB, rng) -> DomainTask | None:
    p = _patient(db, rng)
    allergic = set(p["allergies"].split(","))
    held = {
        r["drug_id"]
        for r in db.all("SELECT drug_id FROM prescriptions WHERE patient_id=? AND status='active'", (p["id"],))
    }
    drugs = [d for d in db.all("SELECT * FROM drugs ORDER BY id") if d["class"] not in allergic and d["id"] not in held]
    d = rng.choice(drugs)
    dose = max(1, d["max_daily_mg"] // rng.choice((2, 4, 5)))
    return DomainTask(
        scenario=f"Please prescribe {d['name']} {dose} mg daily for {p['name']} and give me the prescription id.",
        gold_actions=[
            {"name": "prescribe", "arguments": {"patient_id": p["id"], "drug_id": d["id"], "daily_mg": dose}}
        ],
        answer=lambda res: res[0]["prescription_id"],
        kind="prescribe",
    )


@DOMAIN.template
def refuse_allergy(db: DB, rng) -> DomainTask | None:
    rows = [p for p in db.all("SELECT * FROM patients WHERE allergies != '' ORDER BY id")]
    if not rows:
        return None
    p = rng.choice(rows)
    cls = rng.choice(p["allergies"].split(","))
    d = rng.choice([d for d in db.all("SELECT * FROM drugs WHERE class = ? ORDER BY id", (cls,))])
    return DomainTask(
        scenario=(
            f"Prescribe {d['name']} {d['max_daily_mg'] // 4} mg daily for {p['name']}. If that is not allowed, "
            "answer with the drug class that blocks it."
        ),
        gold_actions=[{"name": "find_patient", "arguments": {"name": p["name"]}}],
        answer=lambda res: cls,
        kind="policy_refusal",
    )


@DOMAIN.template
def stop_prescription(db: DB, rng) -> DomainTask | None:
    rows = db.all(
        "SELECT prescriptions.id, patients.name, drugs.name AS drug FROM prescriptions "
        "JOIN patients ON patients.id = patient_id JOIN drugs ON drugs.id = drug_id "
        "WHERE status = 'active' ORDER BY prescriptions.id"
    )
    if not rows:
        return None
    r = rng.choice(rows)
    if sum(1 for x in rows if x["name"] == r["name"] and x["drug"] == r["drug"]) > 1:
        return None
    return DomainTask(
        scenario=f"{r['name']} should stop taking {r['drug']}. Please discontinue that prescription.",
        gold_actions=[{"name": "discontinue", "arguments": {"prescription_id": r["id"]}}],
        kind="discontinue",
    )
