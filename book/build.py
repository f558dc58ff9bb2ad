"""Build the course website: ``python book/build.py`` (what ``make site`` runs) writes ``_site/``.

Steps (docs/site.md says why each is so):

1. stage the pages in ``_build/book/``: ``book/*.md``, ``docs/*.md``, every lesson *with its
   outputs*, every exercise as a learner gets it (unfilled, not run);
2. a lesson's outputs come from ``_build/executed/notebooks/`` (``make test`` saves nbval's run
   there, root ``conftest.py --executed-dir``) when that copy is newer than the lesson; otherwise
   the lesson is executed here with nbclient, in ``notebooks/`` as nbval does;
3. each lesson page gets a "run it" box under its title, and each widget a line saying it is its
   default setting's figure and how to move it;
4. the API reference: one page per package of the analytic core, the planner, the parallel
   runtime and the framework bridges, from dtlib's docstrings (``sphinx.ext.autodoc``);
5. Sphinx with myst-nb renders it all into ``_site/`` (search included, MathJax bundled).
"""
from __future__ import annotations

import argparse
import pkgutil
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"
# The packages whose docstrings make the API reference (docs/site.md).
API_PACKAGES = {
    "dtlib.analytic": "The analytic core: memory, FLOPs, communication and hardware arithmetic",
    "dtlib.plan": "The planner behind `dtlib plan`",
    "dtlib.parallel": "The parallel runtime: DDP, ZeRO, FSDP, tensor and pipeline parallelism",
    "dtlib.frameworks": "The bridges to DeepSpeed, Megatron-Core, JAX and Ray",
}

RUN_LESSON = """```{{admonition}} Run this lesson
:class: tip
This page is the lesson as it ran in the course's tests, with its outputs. Each widget is shown as
the figure of its default setting; to move its controls, run the lesson: `make lab` in a clone of
the repository, or `pip install "dtlib[course]"` then `dtlib course DIR`, or on your workshop's
server. Details: [Run the course](../run.md). The graded exercise for this lesson:
{exercise}.
```
"""
RUN_EXERCISE = """```{admonition} Graded exercise
:class: note
This is the exercise as a learner gets it: fill in each `...` and run the `grader.check` cell
below it in a running notebook ([Run the course](../run.md)); grading is described in
[Grading](../docs/grading.md).
```
"""
WIDGET_NOTE = ("*Interactive widget, shown at its default setting: run the lesson to move its "
               "controls ([how](../run.md)).*")


def _title_index(nb: nbformat.NotebookNode) -> int:
    """The index of the cell holding the page title (the first markdown cell with a `# ` heading)."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown" and cell.source.lstrip().startswith("# "):
            return i
    raise ValueError("notebook has no '# ' title cell")


def execute(source: Path, target: Path, timeout: int) -> None:
    """Run a lesson as nbval does (in its own folder, the course's kernel) and save it with outputs."""
    from nbclient import NotebookClient

    nb = nbformat.read(source, as_version=4)
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(source.parent)}}).execute()
    target.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, target)


def executed_lesson(lesson: Path, executed_dir: Path, timeout: int) -> tuple[nbformat.NotebookNode, str]:
    """The lesson with outputs, and where they came from ("make test's run" or "executed now")."""
    saved = executed_dir / lesson.relative_to(ROOT)
    if saved.exists() and saved.stat().st_mtime >= lesson.stat().st_mtime:
        return nbformat.read(saved, as_version=4), "saved run"
    execute(lesson, saved, timeout)
    return nbformat.read(saved, as_version=4), "executed now"


def annotate_lesson(nb: nbformat.NotebookNode, exercise: str | None) -> nbformat.NotebookNode:
    """Insert the "run it" box under the title and a note under each widget."""
    link = f"[exercise {exercise}](../exercises/{exercise}.ipynb)" if exercise else "none"
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "markdown":  # the last lesson's link to the course map: the README is the home page here
            cell.source = cell.source.replace("](../README.md)", "](../index.md)")
        cells.append(cell)
        if cell.cell_type == "code" and any(WIDGET_MIME in out.get("data", {}) for out in cell.get("outputs", [])):
            cells.append(nbformat.v4.new_markdown_cell(WIDGET_NOTE))
    at = _title_index(nb) + 1
    cells.insert(at, nbformat.v4.new_markdown_cell(RUN_LESSON.format(exercise=link)))
    nb.cells = cells
    return nb


def annotate_exercise(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    nb.cells.insert(_title_index(nb) + 1, nbformat.v4.new_markdown_cell(RUN_EXERCISE))
    return nb


def api_pages(folder: Path) -> list[str]:
    """One MyST page per package, each module's public members from its docstrings."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for package, title in API_PACKAGES.items():
        pkg = __import__(package, fromlist=["__path__"])
        modules = [package] + sorted(m.name for m in pkgutil.walk_packages(pkg.__path__, package + ".")
                                     if not m.name.rsplit(".", 1)[-1].startswith("_"))
        blocks = [f"# `{package}`\n\n{title}.\n"]
        for module in modules:
            blocks.append(f"## `{module}`\n\n```{{eval-rst}}\n.. automodule:: {module}\n"
                          f"   :members:\n   :noindex:\n```\n")
        (folder / f"{package}.md").write_text("\n".join(blocks))
        names.append(package)
    toc = "\n".join(names)
    (folder / "index.md").write_text(
        "# API reference\n\nGenerated from dtlib's docstrings by `book/build.py` "
        "(`sphinx.ext.autodoc`).\n\n```{toctree}\n:maxdepth: 1\n\n" + toc + "\n```\n")
    return names


def stage(stage_dir: Path, executed_dir: Path, timeout: int) -> dict[str, str]:
    """Write every page's source into stage_dir; return where each lesson's outputs came from."""
    if stage_dir.exists():
        shutil.rmtree(stage_dir)
    (stage_dir / "notebooks").mkdir(parents=True)
    (stage_dir / "exercises").mkdir()
    (stage_dir / "docs").mkdir()
    for page in (ROOT / "book").glob("*.md"):
        shutil.copy(page, stage_dir / page.name)
    for page in sorted((ROOT / "docs").glob("*.md")):
        shutil.copy(page, stage_dir / "docs" / page.name)
    exercises = {p.stem for p in (ROOT / "exercises").glob("*.ipynb")}
    origin = {}
    for lesson in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb, origin[lesson.stem] = executed_lesson(lesson, executed_dir, timeout)
        nbformat.write(annotate_lesson(nb, lesson.stem if lesson.stem in exercises else None),
                       stage_dir / "notebooks" / lesson.name)
    for exercise in sorted((ROOT / "exercises").glob("*.ipynb")):
        nb = annotate_exercise(nbformat.read(exercise, as_version=4))
        nbformat.write(nb, stage_dir / "exercises" / exercise.name)
    api_pages(stage_dir / "api")
    return origin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "_site"), help="the site's folder (default _site/)")
    parser.add_argument("--executed", default=str(ROOT / "_build" / "executed"),
                        help="executed notebooks saved by make test (default _build/executed/)")
    parser.add_argument("--timeout", type=int, default=600, help="seconds a cell may run when a lesson is executed here")
    args = parser.parse_args(argv)
    if args.timeout <= 0:
        parser.exit(2, f"--timeout must be a positive number of seconds, got {args.timeout}\n")
    start = time.monotonic()
    stage_dir = ROOT / "_build" / "book"
    origin = stage(stage_dir, Path(args.executed), args.timeout)
    staged = time.monotonic()
    # Sphinx writes into _build/html and myst-nb its notebooks beside it (outdir's parent /
    # jupyter_execute): all in _build/; the site is then moved to --out.
    html = ROOT / "_build" / "html"
    if html.exists():
        shutil.rmtree(html)
    subprocess.run([sys.executable, "-m", "sphinx", "-b", "html", "-q", "-j", "auto", "-c", str(ROOT / "book"),
                    "-d", str(ROOT / "_build" / "doctrees"), str(stage_dir), str(html)], check=True)
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    shutil.move(html, out)
    (out / ".nojekyll").touch()  # GitHub Pages: serve _static/ as is
    done = time.monotonic()
    ran = sorted(k for k, v in origin.items() if v == "executed now")
    print(f"site: {out} in {done - start:.0f} s ({staged - start:.0f} s staging, {len(ran)} lessons "
          f"executed now{': ' + ', '.join(ran) if ran else ''}; {done - staged:.0f} s Sphinx)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
