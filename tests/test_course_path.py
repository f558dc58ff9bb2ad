"""One course, one path: no lesson uses a term before the lesson that teaches it, every lesson asks for
a prediction before it reveals the number, and ends with what it established and the next lesson."""
import json
import re
from pathlib import Path

import pytest

from dtlib.course_path import MAP_BEGIN, MAP_END, early_uses, load_lessons, map_table

ROOT = Path(__file__).resolve().parent.parent
LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def _cell(source, kind="markdown", tags=()):
    cell = {"cell_type": kind, "metadata": {"tags": list(tags)} if tags else {}, "source": [source]}
    return cell | ({"outputs": [], "execution_count": None} if kind == "code" else {})


def _write(folder, stem, cells, teaches, requires=(), minutes=30):
    nb = {"cells": [_cell(f"# {stem}")] + cells, "metadata": {"dtlib": {"teaches": list(teaches),
                                                                       "requires": list(requires), "minutes": minutes}}}
    (folder / f"{stem}.ipynb").write_text(json.dumps(nb))


def test_no_lesson_uses_a_term_before_the_lesson_that_teaches_it():
    assert early_uses(load_lessons(ROOT / "notebooks")) == []


def test_the_readme_course_map_is_the_lessons_metadata():
    readme = (ROOT / "README.md").read_text()
    shown = readme.split(MAP_BEGIN, 1)[1].split(MAP_END, 1)[0].strip()
    assert shown == map_table(load_lessons(ROOT / "notebooks")), "run: python -m dtlib.course_path README.md"


def test_an_early_term_is_found_and_a_preview_cell_is_allowed(tmp_path):
    _write(tmp_path, "00_a", [_cell("Averaging gradients; ZeRO comes later.")], ["data parallel"])
    _write(tmp_path, "01_b", [_cell("Shard with ZeRO-1.")], ["ZeRO"], ["00_a"])
    problems = early_uses(load_lessons(tmp_path))
    assert any(p.startswith("00_a cell 1 uses 'ZeRO' ('ZeRO') before 01_b teaches it") for p in problems)
    _write(tmp_path, "00_a", [_cell("Averaging gradients; ZeRO comes later.", tags=["preview"])], ["data parallel"])
    assert not any(p.startswith("00_a") for p in early_uses(load_lessons(tmp_path)))
    # a term taught by an earlier lesson that is not a prerequisite is still early
    _write(tmp_path, "02_c", [_cell("Use ZeRO here.")], ["tensor parallel"], ["00_a"])
    assert any(p.startswith("02_c cell 1 uses 'ZeRO'") for p in early_uses(load_lessons(tmp_path)))


@pytest.mark.parametrize("meta, message", [
    ({"teaches": ["ZeRO"], "requires": ["09_later"], "minutes": 30}, "not earlier lessons"),
    ({"teaches": ["warp drive"], "requires": [], "minutes": 30}, "does not spell"),
    ({"teaches": [], "requires": [], "minutes": 0}, "minutes must be"),
    ({"teaches": []}, "must hold teaches, requires and minutes")])
def test_bad_metadata_is_refused_in_one_line(tmp_path, meta, message):
    (tmp_path / "00_a.ipynb").write_text(json.dumps({"cells": [_cell("# a")], "metadata": {"dtlib": meta}}))
    with pytest.raises(ValueError, match=message):
        load_lessons(tmp_path)


def _sources(path):
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"]]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_every_lesson_predicts_before_it_reveals(path):
    """Each lesson has a predict("slug", ...) cell, and the reveal("slug", ...) of that slug comes in a
    later cell (the learner commits before the number is shown)."""
    sources = _sources(path)
    predicted = {m: i for i, s in enumerate(sources) for m in re.findall(r'\bpredict\("([\w-]+)"', s)}
    revealed = {m: i for i, s in enumerate(sources) for m in re.findall(r'\breveal\("([\w-]+)"', s)}
    assert predicted, f"{path.name} asks for no prediction"
    assert set(predicted) == set(revealed), f"{path.name}: predictions {sorted(predicted)}, reveals {sorted(revealed)}"
    assert all(predicted[slug] < revealed[slug] for slug in predicted), f"{path.name} reveals before it predicts"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_every_lesson_ends_with_what_it_established_and_the_next_lesson(path):
    sources = _sources(path)
    assert any(s.startswith("## What this lesson established") for s in sources[-3:]), path.name
    link = re.search(r"\]\(([^)]+)\)", sources[-1])
    following = LESSONS[LESSONS.index(path) + 1].name if path != LESSONS[-1] else "../README.md"
    assert link and link.group(1) == following, f"{path.name} should end with a link to {following}"
