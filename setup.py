"""Build step for wheels (the metadata is in pyproject.toml): copy the top-level data folders
suites/ and search_spaces/ into the built package as attnbench/data/<folder>/, where an
installed attnbench reads them (attnbench/resources.py). The folders stay the source of truth:
nothing is copied in the checkout, and an editable install reads them in place."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

DATA_DIRS = ("suites", "search_spaces")  # = attnbench.resources.DATA_DIRS


class BuildPyWithData(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        for name in DATA_DIRS:
            dest = Path(self.build_lib, "attnbench", "data", name)
            shutil.rmtree(dest, ignore_errors=True)  # no stale file from an earlier build
            self.mkpath(str(dest))
            for src in sorted(Path(name).iterdir()):
                if src.is_file():
                    self.copy_file(str(src), str(dest / src.name))


setup(cmdclass={"build_py": BuildPyWithData})
