"""The course's path: which lesson teaches which term, which lessons each needs, the map.

Each lesson declares in its notebook metadata what it teaches, which lessons it needs and how long
it takes::

    "metadata": {"dtlib": {"teaches": ["tensor parallel", ...], "requires": ["04_zero_fsdp"], "minutes": 45}}

:data:`TERMS` spells every term a lesson may teach (regular expressions, case-insensitive unless a
part says ``(?-i:...)``). :func:`early_uses` finds a term used in a lesson before the lesson that
teaches it: outside the lessons it requires (transitively) and itself, and outside cells tagged
``preview`` (a forward pointer, e.g. lesson 3 naming tensor parallelism's memory terms for lesson 5).
:func:`map_table` is the course map in the README (and, through it, on the website's home page);
``python -m dtlib.course_path README.md`` rewrites it there from the metadata.
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["PREVIEW_TAG", "TERMS", "Lesson", "early_uses", "load_lessons", "map_table", "write_map"]

PREVIEW_TAG = "preview"
MAP_BEGIN = "<!-- course map: written by `python -m dtlib.course_path README.md` from the lessons' metadata -->"
MAP_END = "<!-- end of course map -->"

TERMS: dict[str, str] = {
    # 00 collectives
    "all-reduce": r"all[-_ ]?reduce",
    "reduce-scatter": r"reduce[-_ ]scatter",
    "all-gather": r"all[-_ ]gather",
    "all-to-all": r"all[-_ ]to[-_ ]all",
    # 01 data parallelism
    "data parallel": r"data[- ]parallel|(?-i:\bDDP\b)|DistributedDataParallel",
    "scaling efficiency": r"scaling efficiency",
    # 02 communication
    "ring all-reduce": r"\bring all[-_ ]?reduce|ring algorithm",
    "alpha-beta model": r"alpha[- ]beta|α[- ]β",
    "bus bandwidth": r"bus bandwidth|busbw",
    "bucketing": r"\bbucket",
    "gradient compression": r"gradient compression|PowerSGD",
    # 03 memory
    "mixed precision": r"mixed[- ]precision",
    "gradient checkpointing": r"gradient checkpointing|activation checkpointing|\brecompute|recomputation",
    # 04 ZeRO and FSDP
    "ZeRO": r"(?-i:\bZeRO\b)|ZeRO-[123]|distributed optimizer|use-distributed-optimizer",
    "FSDP": r"(?-i:\bFSDP2?\b)|fully_shard|fully sharded",
    # 05 tensor parallelism
    "tensor parallel": r"tensor[- ]parallel|(?-i:\bTP\b)",
    "sequence parallel": r"sequence[- ]parallel",
    "column- and row-parallel layers": r"(?:column|row)[- ]parallel|ColumnParallelLinear|RowParallelLinear",
    # 06 pipeline parallelism
    "pipeline parallel": r"pipeline[- ]parallel|pipeline stage|(?-i:\bPP\b)",
    "bubble": r"\bbubble",
    "pipeline schedules": r"(?-i:1F1B|GPipe)|interleaved (?:1F1B|schedule|pipeline)|virtual pipeline|zero[- ]bubble",
    # 07 profiling
    "MFU": r"(?-i:\b[MH]FU\b)|flops utili[sz]ation",
    # 08 fault tolerance
    "goodput": r"goodput",
    "distributed checkpoint": r"(?-i:\bDCP\b)|distributed checkpoint|torch\.distributed\.checkpoint",
    "checkpoint interval": r"\bYoung\b|\bDaly\b|checkpoint interval",
    "heartbeat": r"heartbeat",
    # 09 3D parallelism
    "rank grid": r"rank grid|\b[345]D parallel",
    "context parallel": r"context[- ]parallel|ring attention|(?-i:\bCP\b)",
    "expert parallel": r"expert[- ]parallel|mixture[- ]of[- ]experts|(?-i:\bMoE\b)",
    # 10 capstone
    "layout search": r"dtlib plan\b",
    # 11 beyond synchronous
    "local SGD": r"local SGD",
    "DiLoCo": r"DiLoCo",
    "parameter server": r"parameter server|staleness",
    # 12 data and the cluster
    "streaming data": r"streaming (?:data|dataset)|StreamingDataset",
    "gang scheduling": r"gang schedul",
    "incremental checkpoint": r"incremental checkpoint",
    # 13 frameworks
    "GSPMD": r"GSPMD|(?-i:\bHLO\b)|PartitionSpec",
}
_PATTERNS = {term: re.compile(spelling, re.I) for term, spelling in TERMS.items()}


@dataclass(frozen=True)
class Lesson:
    stem: str
    title: str
    teaches: tuple[str, ...]
    requires: tuple[str, ...]
    minutes: int
    cells: tuple[tuple[str, bool], ...]  # (source, tagged preview)


def load_lessons(folder: Path) -> list[Lesson]:
    """Every ``NN_*.ipynb`` in ``folder``, in order, with its ``dtlib`` metadata checked."""
    lessons = []
    for path in sorted(Path(folder).glob("[0-9][0-9]_*.ipynb")):
        nb = json.loads(path.read_text())
        meta = nb["metadata"].get("dtlib")
        if not isinstance(meta, dict) or set(meta) != {"teaches", "requires", "minutes"}:
            raise ValueError(f"{path.name}: metadata 'dtlib' must hold teaches, requires and minutes, got {meta!r}")
        unknown = [t for t in meta["teaches"] if t not in TERMS]
        if unknown:
            raise ValueError(f"{path.name}: teaches {unknown}, which dtlib.course_path.TERMS does not spell")
        if not isinstance(meta["minutes"], int) or not 5 <= meta["minutes"] <= 240:
            raise ValueError(f"{path.name}: minutes must be a whole number from 5 to 240, got {meta['minutes']!r}")
        title = next("".join(c["source"]).lstrip()[2:].split("\n")[0] for c in nb["cells"]
                     if c["cell_type"] == "markdown" and "".join(c["source"]).lstrip().startswith("# "))
        cells = tuple(("".join(c["source"]), PREVIEW_TAG in c["metadata"].get("tags", [])) for c in nb["cells"])
        lessons.append(Lesson(path.stem, title, tuple(meta["teaches"]), tuple(meta["requires"]),
                              meta["minutes"], cells))
    earlier: set[str] = set()
    for lesson in lessons:
        late = [r for r in lesson.requires if r not in earlier]
        if late:
            raise ValueError(f"{lesson.stem}: requires {late}, which are not earlier lessons")
        earlier.add(lesson.stem)
    return lessons


def _known(lesson: Lesson, by_stem: dict[str, Lesson]) -> set[str]:
    """The terms taught by the lesson and by every lesson it requires, transitively."""
    known, todo, seen = set(lesson.teaches), list(lesson.requires), set()
    while todo:
        stem = todo.pop()
        if stem not in seen:
            seen.add(stem)
            known |= set(by_stem[stem].teaches)
            todo += by_stem[stem].requires
    return known


def early_uses(lessons: list[Lesson]) -> list[str]:
    """One line per (lesson, cell, term) where a lesson uses a term neither it nor its prerequisites
    teach, outside a cell tagged ``preview``; also each term taught by no lesson or by two."""
    problems = []
    teacher: dict[str, str] = {}
    for lesson in lessons:
        for term in lesson.teaches:
            if term in teacher:
                problems.append(f"{term!r} is taught by both {teacher[term]} and {lesson.stem}")
            teacher.setdefault(term, lesson.stem)
    problems += [f"{term!r} is taught by no lesson" for term in TERMS if term not in teacher]
    by_stem = {lesson.stem: lesson for lesson in lessons}
    for lesson in lessons:
        known = _known(lesson, by_stem)
        for index, (source, preview) in enumerate(lesson.cells):
            if preview:
                continue
            for term, pattern in _PATTERNS.items():
                found = pattern.search(source)
                if term not in known and found and term in teacher:
                    problems.append(f"{lesson.stem} cell {index} uses {term!r} ({found.group(0)!r}) "
                                    f"before {teacher[term]} teaches it: tag the cell {PREVIEW_TAG!r} or move it")
    return problems


def map_table(lessons: list[Lesson]) -> str:
    """The course map as a Markdown table: lesson, what it teaches, prerequisites, minutes."""
    rows = ["| # | lesson | teaches | prerequisites | minutes |", "|---|---|---|---|---|"]
    for lesson in lessons:
        requires = ", ".join(r[:2] for r in lesson.requires) or "—"
        rows.append(f"| {lesson.stem[:2]} | [{lesson.title}](notebooks/{lesson.stem}.ipynb) | "
                    f"{', '.join(lesson.teaches)} | {requires} | {lesson.minutes} |")
    total = sum(lesson.minutes for lesson in lessons)
    rows.append(f"| | **the whole course** | | | **{total}** |")
    return "\n".join(rows)


def write_map(readme: Path, lessons: list[Lesson]) -> bool:
    """Rewrite the map between the README's markers; True when the text changed."""
    text = readme.read_text()
    if MAP_BEGIN not in text or MAP_END not in text:
        raise ValueError(f"{readme}: no course map markers ({MAP_BEGIN!r} ... {MAP_END!r})")
    head, rest = text.split(MAP_BEGIN, 1)
    new = f"{head}{MAP_BEGIN}\n{map_table(lessons)}\n{MAP_END}{rest.split(MAP_END, 1)[1]}"
    readme.write_text(new)
    return new != text


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m dtlib.course_path README.md", file=sys.stderr)
        return 2
    readme = Path(argv[0])
    if not readme.is_file():
        print(f"README: no such file {readme}", file=sys.stderr)
        return 2
    try:
        changed = write_map(readme, load_lessons(readme.parent / "notebooks"))
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"{readme}: course map {'rewritten' if changed else 'already up to date'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
