"""What of the course's repository a submission must not see: in every checkout of it on this
machine, the git history and the solved copies.

A git repository holds every committed solution: ``git -c safe.directory=* -C <checkout> show
HEAD:solutions/01_data_parallel.ipynb`` from an answer cell once gave full marks. Besides the
checkout the grader runs from, the same repository may have a main worktree and other worktrees
(``git worktree add``), each with its own ``solutions/``; git lists them in
``<common dir>/worktrees/*/gitdir`` (the layout of ``git worktree``, see
https://git-scm.com/docs/git-worktree#_details).
"""
from __future__ import annotations

import os
from pathlib import Path

__all__ = ["SOLVED", "secrets"]

SOLVED = (".git", "masters", "solutions")  # in each checkout: history, masters and solved copies


def _git_dirs(checkout: Path) -> tuple[Path | None, Path | None]:
    """``(git dir, common dir)`` of ``checkout``: its ``.git`` folder, or where its ``.git`` file
    (a worktree's ``gitdir: PATH``) points and that folder's ``commondir``."""
    dot = checkout / ".git"
    if dot.is_dir():
        return dot, dot
    try:
        line = dot.read_text().strip()
    except OSError:
        return None, None
    if not line.startswith("gitdir:"):
        return None, None
    git_dir = (checkout / line[len("gitdir:"):].strip()).resolve()
    try:
        common = (git_dir / (git_dir / "commondir").read_text().strip()).resolve()
    except OSError:
        common = git_dir
    return git_dir, common


def _checkouts(common: Path) -> list[Path]:
    """Every working tree of the repository whose common git dir is ``common``."""
    found = [common.parent] if common.name == ".git" else []
    for gitdir_file in (common / "worktrees").glob("*/gitdir"):
        try:
            found.append(Path(gitdir_file.read_text().strip()).parent)
        except OSError:
            continue
    return found


def secrets(*checkouts: str | os.PathLike) -> tuple[str, ...]:
    """Existing paths to hide from a submission: :data:`SOLVED` in each of ``checkouts`` and in
    every other checkout of their repositories, and their git dirs (folders or files)."""
    paths: list[Path] = []
    for checkout in map(Path, checkouts):
        git_dir, common = _git_dirs(checkout)
        trees = [checkout] + (_checkouts(common) if common else [])
        paths += [p for p in (git_dir, common) if p]
        paths += [tree / name for tree in trees for name in SOLVED]
    return tuple(dict.fromkeys(str(p.resolve()) for p in paths if p.exists() or p.is_symlink()))
