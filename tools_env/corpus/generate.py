"""Generate a fictional world (countries, cities, universities, people, companies) and its documents.

Every fact lives in exactly one entity's document, and the names are invented, so a multi-hop
question ("Which city is the company founded by X headquartered in?") can be answered only by
searching: the person's document names the company, the company's document names the city.
The world is deterministic in its seed; ``write_corpus`` writes ``docs.jsonl`` (one
``{"id", "title", "text"}`` per line), the format ``load_corpus`` and the ``search`` tool read
(a folder of ``.jsonl`` and ``.txt`` files, or one file).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field

_ONSETS = [
    "b",
    "br",
    "c",
    "d",
    "dr",
    "f",
    "g",
    "gr",
    "h",
    "k",
    "l",
    "m",
    "n",
    "p",
    "qu",
    "r",
    "s",
    "st",
    "t",
    "th",
    "v",
    "w",
    "z",
]
_VOWELS = ["a", "e", "i", "o", "u", "ae", "ia", "ou"]
_CODAS = ["", "", "n", "r", "l", "s", "th", "x", "nd", "m"]
INDUSTRIES = ["robotics", "shipping", "biotech", "textiles", "solar energy", "publishing", "aerospace", "food"]
PRODUCTS = [
    "delivery drones",
    "cargo barges",
    "enzyme kits",
    "wool fabric",
    "rooftop panels",
    "atlases",
    "satellite buses",
    "canned soups",
    "water filters",
    "wind gauges",
]
PROFESSIONS = ["engineer", "chemist", "economist", "architect", "physician", "geologist", "historian"]
COMPANY_SUFFIX = ["Works", "Labs", "Holdings", "Industries", "Systems", "Group"]


@dataclass
class Document:
    id: str
    title: str
    text: str


@dataclass
class World:
    seed: int
    countries: dict[str, dict] = field(default_factory=dict)  # name -> {capital}
    cities: dict[str, dict] = field(default_factory=dict)  # name -> {country, river, founded}
    universities: dict[str, dict] = field(default_factory=dict)  # name -> {city, founded}
    people: dict[str, dict] = field(default_factory=dict)  # name -> {born, city, university, profession, company}
    companies: dict[str, dict] = field(default_factory=dict)  # name -> {founder, year, city, industry, product}
    docs: list[Document] = field(default_factory=list)
    doc_id: dict[str, str] = field(default_factory=dict)  # entity name -> id of its document


class _Names:
    def __init__(self, rng: random.Random) -> None:
        self.rng, self.used = rng, set()

    def word(self, syllables: int) -> str:
        while True:
            w = "".join(self.rng.choice(_ONSETS) + self.rng.choice(_VOWELS) for _ in range(syllables))
            w = (w + self.rng.choice(_CODAS)).capitalize()
            if w not in self.used and len(w) >= 4:
                self.used.add(w)
                return w


def build_world(
    seed: int = 0,
    n_countries: int = 8,
    n_cities: int = 24,
    n_universities: int = 10,
    n_people: int = 120,
    n_companies: int = 80,
) -> World:
    assert n_companies <= n_people and n_countries <= n_cities
    rng = random.Random(f"corpus:{seed}")
    names, w = _Names(rng), World(seed=seed)
    countries = [names.word(2) + rng.choice(["ia", "land", "stan", "ora"]) for _ in range(n_countries)]
    for i in range(n_cities):
        country = countries[i] if i < n_countries else rng.choice(countries)
        w.cities[names.word(rng.choice((1, 2)))] = {
            "country": country,
            "river": names.word(2),
            "founded": rng.randint(900, 1800),
        }
    for c in countries:
        w.countries[c] = {"capital": next(n for n, v in w.cities.items() if v["country"] == c)}
    cities = list(w.cities)
    for _ in range(n_universities):
        w.universities[f"University of {names.word(2)}"] = {
            "city": rng.choice(cities),
            "founded": rng.randint(1300, 1950),
        }
    for _ in range(n_people):
        w.people[f"{names.word(2)} {names.word(2)}"] = {
            "born": rng.randint(1900, 1990),
            "city": rng.choice(cities),
            "university": rng.choice(list(w.universities)),
            "profession": rng.choice(PROFESSIONS),
            "company": None,
        }
    for founder in rng.sample(list(w.people), n_companies):
        name = f"{names.word(2)} {rng.choice(COMPANY_SUFFIX)}"
        born = w.people[founder]["born"]
        w.companies[name] = {
            "founder": founder,
            "year": born + rng.randint(25, 45),
            "city": rng.choice(cities),
            "industry": rng.choice(INDUSTRIES),
            "product": rng.choice(PRODUCTS),
        }
        w.people[founder]["company"] = name
    _write_docs(w)
    return w


def _write_docs(w: World) -> None:
    def add(kind: str, name: str, text: str) -> None:
        doc = Document(id=f"{kind}-{len(w.docs):04d}", title=name, text=text)
        w.docs.append(doc)
        w.doc_id[name] = doc.id

    for name, c in w.countries.items():
        add("country", name, f"{name} is a country. Its capital is {c['capital']}.")
    for name, c in w.cities.items():
        add(
            "city",
            name,
            f"{name} is a city in {c['country']}, founded in {c['founded']} on the banks of the {c['river']} river.",
        )
    for name, u in w.universities.items():
        add("university", name, f"The {name} was established in {u['founded']} in the city of {u['city']}.")
    for name, p in w.people.items():
        text = (
            f"{name} (born {p['born']}) is a {p['profession']} from {p['city']}. "
            f"{name.split()[0]} studied at the {p['university']}."
        )
        if p["company"]:
            text += f" In {w.companies[p['company']]['year']}, {name.split()[0]} founded {p['company']}."
        add("person", name, text)
    for name, c in w.companies.items():
        add(
            "company",
            name,
            f"{name} is a {c['industry']} company known for its {c['product']}. It was founded in "
            f"{c['year']} by {c['founder']} and is headquartered in {c['city']}.",
        )


def write_corpus(out_dir: str, seed: int = 0) -> str:
    """Write the world's documents to ``<out_dir>/docs.jsonl``; return the path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "docs.jsonl")
    with open(path, "w") as f:
        for d in build_world(seed).docs:
            f.write(json.dumps({"id": d.id, "title": d.title, "text": d.text}, sort_keys=True) + "\n")
    return path


_TASK_FIELDS = frozenset(("answer", "gold_actions", "verifier"))  # fields of a task record, never of a document


def load_corpus(path: str) -> list[Document]:
    """Documents of a ``.jsonl``/``.txt`` file or of every such file in a folder (sorted by name)."""
    if os.path.isdir(path):
        files = sorted(os.path.join(path, n) for n in os.listdir(path) if n.endswith((".jsonl", ".txt")))
    elif os.path.isfile(path):
        files = [path]
    else:
        raise FileNotFoundError(f"search corpus not found: {path}")
    docs: list[Document] = []
    for fp in files:
        if fp.endswith(".txt"):
            with open(fp) as f:
                text = f.read()
            stem = os.path.splitext(os.path.basename(fp))[0]
            docs.append(Document(id=stem, title=text.strip().split("\n", 1)[0][:120], text=text))
            continue
        with open(fp) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                    leak = sorted(_TASK_FIELDS & set(obj)) if isinstance(obj, dict) else []
                    if leak:
                        raise ValueError(
                            f"{fp}:{lineno}: a task record ({', '.join(leak)}), not a corpus document: "
                            "the search tool would serve its answer"
                        )
                    docs.append(Document(id=str(obj["id"]), title=str(obj.get("title", "")), text=str(obj["text"])))
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    raise ValueError(f"{fp}:{lineno}: not a corpus document ({e})") from None
    if len({d.id for d in docs}) != len(docs):
        raise ValueError(f"search corpus {path}: duplicate document ids")
    return docs
