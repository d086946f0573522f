"""School: students, courses, enrollment and grades."""

from __future__ import annotations

from tools_env.domains.base import DB, Domain, DomainError, DomainTask, arg
from tools_env.domains.common import people

SUBJECTS = [
    "Algebra",
    "Biology",
    "Chemistry",
    "Drama",
    "Economics",
    "French",
    "Geography",
    "History",
    "Latin",
    "Music",
    "Physics",
    "Robotics",
]
MAX_COURSES = 4

DOMAIN = Domain(
    name="school",
    description="secondary school registrar",
    policy=(
        "You are the school registrar's assistant. Identify students with find_student. A student may be "
        f"enrolled in at most {MAX_COURSES} courses and only in courses of their grade level that are not full. "
        "Dropping a course is allowed only while no grade has been recorded for it. Report averages with "
        "one decimal."
    ),
    schema_sql="""
        CREATE TABLE students (id TEXT PRIMARY KEY, name TEXT, grade_level INTEGER);
        CREATE TABLE courses (id TEXT PRIMARY KEY, title TEXT, grade_level INTEGER, capacity INTEGER, teacher TEXT);
        CREATE TABLE enrollments (student_id TEXT, course_id TEXT, score REAL, PRIMARY KEY (student_id, course_id));
    """,
)


@DOMAIN.seeder
def seed(db: DB, rng) -> None:
    teachers = people(rng, 8)
    n = 0
    for level in (9, 10, 11):
        for subject in rng.sample(SUBJECTS, 6):
            n += 1
            db.run(
                "INSERT INTO courses VALUES (?,?,?,?,?)",
                (f"C-{n:02d}", f"{subject} {level}", level, rng.randint(3, 8), rng.choice(teachers)),
            )
    for i, name in enumerate(people(rng, 30), 1):
        level = rng.choice((9, 10, 11))
        db.run("INSERT INTO students VALUES (?,?,?)", (f"ST-{i:03d}", name, level))
        courses = db.all("SELECT id FROM courses WHERE grade_level = ? ORDER BY id", (level,))
        for c in rng.sample(courses, rng.randint(1, 3)):
            score = rng.choice((None, None, rng.randint(50, 100)))
            db.run("INSERT INTO enrollments VALUES (?,?,?)", (f"ST-{i:03d}", c["id"], score))


@DOMAIN.function("Find a student by name (id, grade level).", name=arg("string", "full name"))
def find_student(db: DB, name: str):
    s = db.get("students", "name", name, "student")
    return {"student_id": s["id"], "grade_level": s["grade_level"]}


@DOMAIN.function("Courses of a grade level with seats taken and capacity.", grade_level=arg("integer", "9, 10 or 11"))
def list_courses(db: DB, grade_level: int):
    return db.all(
        "SELECT c.id, c.title, c.capacity, COUNT(e.student_id) AS enrolled FROM courses c "
        "LEFT JOIN enrollments e ON e.course_id = c.id WHERE c.grade_level = ? GROUP BY c.id ORDER BY c.id",
        (grade_level,),
    )


@DOMAIN.function(
    "A student's courses and recorded scores (null: no grade yet).", student_id=arg("string", "student id")
)
def get_transcript(db: DB, student_id: str):
    db.get("students", "id", student_id, "student")
    return db.all("SELECT course_id, score FROM enrollments WHERE student_id = ? ORDER BY course_id", (student_id,))


@DOMAIN.function(
    "Enroll a student in a course.",
    writes=True,
    student_id=arg("string", "student id"),
    course_id=arg("string", "course id"),
)
def enroll(db: DB, student_id: str, course_id: str):
    s = db.get("students", "id", student_id, "student")
    c = db.get("courses", "id", course_id, "course")
    if c["grade_level"] != s["grade_level"]:
        raise DomainError("course is for another grade level")
    if db.one("SELECT 1 FROM enrollments WHERE student_id=? AND course_id=?", (student_id, course_id)):
        raise DomainError("already enrolled")
    if db.one("SELECT COUNT(*) AS n FROM enrollments WHERE student_id=?", (student_id,))["n"] >= MAX_COURSES:
        raise DomainError(f"students take at most {MAX_COURSES} courses")
    if db.one("SELECT COUNT(*) AS n FROM enrollments WHERE course_id=?", (course_id,))["n"] >= c["capacity"]:
        raise DomainError("course is full")
    db.run("INSERT INTO enrollments VALUES (?,?,NULL)", (student_id, course_id))
    return {"student_id": student_id, "course_id": course_id, "status": "enrolled"}


@DOMAIN.function(
    "Drop a course that has no grade yet.",
    writes=True,
    student_id=arg("string", "student id"),
    course_id=arg("string", "course id"),
)
def drop_course(db: DB, student_id: str, course_id: str):
    e = db.one("SELECT * FROM enrollments WHERE student_id=? AND course_id=?", (student_id, course_id))
    if e is None:
        raise DomainError("not enrolled in that course")
    if e["score"] is not None:
        raise DomainError("a grade is recorded; the course cannot be dropped")
    db.run("DELETE FROM enrollments WHERE student_id=? AND course_id=?", (student_id, course_id))
    return {"student_id": student_id, "course_id": course_id, "status": "dropped"}


@DOMAIN.template
def enroll_open(db: DB, rng) -> DomainTask | None:
    s = rng.choice(db.all("SELECT * FROM students ORDER BY id"))
    if db.one("SELECT COUNT(*) AS n FROM enrollments WHERE student_id=?", (s["id"],))["n"] >= MAX_COURSES:
        return None
    open_ = [
        c
        for c in list_courses(db, s["grade_level"])
        if c["enrolled"] < c["capacity"]
        and not db.one("SELECT 1 FROM enrollments WHERE student_id=? AND course_id=?", (s["id"], c["id"]))
    ]
    if not open_:
        return None
    c = rng.choice(open_)
    return DomainTask(
        scenario=f"Please enroll {s['name']} in {c['title']}.",
        gold_actions=[{"name": "enroll", "arguments": {"student_id": s["id"], "course_id": c["id"]}}],
        kind="enroll",
    )


@DOMAIN.template
def drop_ungraded(db: DB, rng) -> DomainTask | None:
    rows = db.all(
        "SELECT e.student_id, e.course_id, s.name, c.title FROM enrollments e JOIN students s ON s.id = e.student_id "
        "JOIN courses c ON c.id = e.course_id WHERE e.score IS NULL ORDER BY e.student_id, e.course_id"
    )
    r = rng.choice(rows)
    return DomainTask(
        scenario=f"{r['name']} wants to drop {r['title']}. Please take care of it.",
        gold_actions=[
            {"name": "drop_course", "arguments": {"student_id": r["student_id"], "course_id": r["course_id"]}}
        ],
        kind="drop",
    )


@DOMAIN.template
def average_score(db: DB, rng) -> DomainTask | None:
    rows = db.all(
        "SELECT s.id, s.name FROM students s JOIN enrollments e ON e.student_id = s.id "
        "WHERE e.score IS NOT NULL GROUP BY s.id ORDER BY s.id"
    )
    if not rows:
        return None
    s = rng.choice(rows)
    return DomainTask(
        scenario=f"What is the average recorded score of {s['name']} (graded courses only)? Change nothing.",
        gold_actions=[{"name": "get_transcript", "arguments": {"student_id": s["id"]}}],
        answer=lambda res: (
            f"{sum(r['score'] for r in res[0] if r['score'] is not None) / sum(1 for r in res[0] if r['score'] is not None):.1f}"
        ),
        kind="read",
    )
