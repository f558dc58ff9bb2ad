"""``dtlib course DIR``: the lessons and exercises copied for a learner, never over their work
(the wheel's side, from a fresh install, is tests/test_wheel.py)."""
import json
import re
import shlex
from pathlib import Path

import pytest

from dtlib.cli import main
from dtlib.course import FIRST_LESSON, RECORD, course_root, learner_files, write_course

ROOT = Path(__file__).resolve().parent.parent


def test_the_checkout_is_the_course_and_the_learner_gets_no_masters():
    assert course_root() == ROOT  # a source tree reads its own folders: no copy to go stale
    files = learner_files()
    assert FIRST_LESSON in files and "notebooks/recorded/ray_failure_drill.json" in files  # lesson 13 reads it
    assert {f.split("/")[0] for f in files} == {"notebooks", "exercises"}
    assert sorted(f for f in files if f.startswith("exercises/")) == sorted(
        f"exercises/{p.name}" for p in (ROOT / "exercises").glob("*.ipynb"))


def test_setup_py_ships_the_folders_dtlib_course_reads():
    import ast

    from dtlib.course import FOLDERS

    shipped = re.search(r"COURSE_FOLDERS = (\(.*?\))", (ROOT / "setup.py").read_text()).group(1)
    assert ast.literal_eval(shipped) == FOLDERS
    manifest = (ROOT / "MANIFEST.in").read_text()
    assert all(f"graft {folder}" in manifest for folder in FOLDERS)  # the sdist carries them too


def test_course_writes_once_and_refuses_to_overwrite_changes(tmp_path, capsys):
    target = tmp_path / "course"
    assert main(["course", str(target), "--no-lab"]) == 0
    out = capsys.readouterr().out
    assert f"{target}: {len(learner_files())} files written" in out
    command = shlex.split(out.splitlines()[-1])
    assert command[1:3] == ["-m", "jupyterlab"] and f"--ServerApp.root_dir={target}" in command
    assert f"--LabApp.default_url=/lab/tree/{FIRST_LESSON}" in command
    for name in learner_files():
        assert (target / name).read_bytes() == (ROOT / name).read_bytes()
    assert not (target / "masters").exists() and not (target / "solutions").exists()
    # again: nothing to write
    assert write_course(target) == []
    # a learner's answer is never overwritten; nothing at all is written then
    answer = target / "exercises" / "03_memory.ipynb"
    answer.write_text(answer.read_text().replace('"source": [', '"source": ["# mine\\n", ', 1))
    (target / FIRST_LESSON).unlink()
    assert main(["course", str(target), "--no-lab"]) == 2
    err = capsys.readouterr().err
    assert err == f"dtlib: error: {answer} holds your changes: not overwritten; move it away to get the course's " \
                  "copy, or give another DIR\n"
    assert not (target / FIRST_LESSON).exists() and "# mine" in answer.read_text()
    # moved away: the course's copy (and the deleted lesson) come back
    answer.rename(tmp_path / "mine.ipynb")
    assert sorted(write_course(target)) == sorted([FIRST_LESSON, "exercises/03_memory.ipynb"])


def test_an_untouched_old_copy_is_updated(tmp_path):
    """A lesson the learner never changed, from an older dtlib, is replaced by this version's (the
    record says what was written); an unrecorded file that differs is the learner's."""
    write_course(tmp_path)
    lesson = tmp_path / FIRST_LESSON
    lesson.write_text("an older version\n")
    record = json.loads((tmp_path / RECORD).read_text())
    record[FIRST_LESSON] = "0" * 64
    (tmp_path / RECORD).write_text(json.dumps(record))
    with pytest.raises(ValueError, match="00_collectives.ipynb holds your changes"):
        write_course(tmp_path)
    import hashlib

    record[FIRST_LESSON] = hashlib.sha256(lesson.read_bytes()).hexdigest()  # as if written by that dtlib
    (tmp_path / RECORD).write_text(json.dumps(record))
    assert write_course(tmp_path) == [FIRST_LESSON]
    assert lesson.read_bytes() == (ROOT / FIRST_LESSON).read_bytes()


def test_course_refuses_a_file_as_dir(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert main(["course", str(tmp_path / "f"), "--no-lab"]) == 2
    assert capsys.readouterr().err == f"dtlib: error: DIR {str(tmp_path / 'f')!r} is a file, not a folder\n"
