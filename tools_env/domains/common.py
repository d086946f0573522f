"""Shared vocabulary for the seeded domain generators: people, cities, dates, money."""

from __future__ import annotations

import datetime
import random

FIRST = [
    "Ada",
    "Bruno",
    "Chiara",
    "Dmitri",
    "Elena",
    "Farid",
    "Greta",
    "Hiro",
    "Ines",
    "Jonas",
    "Kamala",
    "Lars",
    "Mina",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wen",
    "Xavier",
    "Yara",
    "Zane",
]
LAST = [
    "Abbott",
    "Berger",
    "Castillo",
    "Duarte",
    "Eriksen",
    "Fontaine",
    "Gallo",
    "Haddad",
    "Ivanova",
    "Jansen",
    "Kowalski",
    "Lindqvist",
    "Moreau",
    "Nakamura",
    "Okafor",
    "Petrov",
    "Quintero",
    "Rahman",
    "Sato",
    "Tanaka",
    "Ueda",
    "Varga",
    "Weber",
    "Yilmaz",
    "Zhou",
]
CITIES = [
    "Aldport",
    "Brightwater",
    "Cedarfall",
    "Dunmore",
    "Eastvale",
    "Fairhaven",
    "Glenrock",
    "Harborview",
    "Ironbridge",
    "Juniper",
    "Kingsreach",
    "Lakeside",
]


def people(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct full names."""
    pool = [f"{f} {l}" for f in FIRST for l in LAST]
    return rng.sample(pool, n)


def date(day_offset: int) -> str:
    """The ISO date ``day_offset`` days after the domains' fixed today (2025-06-01)."""
    return (datetime.date(2025, 6, 1) + datetime.timedelta(days=day_offset)).isoformat()


def money(x: float) -> float:
    return round(float(x), 2)


def fmt_money(x: float) -> str:
    return f"{x:.2f}"
