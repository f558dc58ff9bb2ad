"""The wheel carries the course: the repository's notebooks/, exercises/ and masters/ are copied
into ``dtlib/course_files/`` when the wheel is built, so they have one source (the top-level
folders, which `make lab` and the tests use) and no committed copy. ``dtlib.course`` reads them
from there in an install, and from the checkout's folders in a source tree (an editable install
too). Everything else about the package is in pyproject.toml."""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

COURSE_FOLDERS = ("notebooks", "exercises", "masters")  # dtlib.course.FOLDERS; a test keeps them equal


class BuildPyWithCourse(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # the checkout's folders are read in place
            return
        target = Path(self.build_lib) / "dtlib" / "course_files"
        for folder in COURSE_FOLDERS:
            shutil.copytree(folder, target / folder, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", ".OTTER_LOG"))


setup(cmdclass={"build_py": BuildPyWithCourse})
