"""Build hook for the C extensions; everything else is in pyproject.toml.

ingero_forensics.export._fastslices speeds up ingero-export (docs/export.md),
ingero_forensics.merge._fastcoll the collectives of ingero-merge (docs/merge.md), and
ingero_forensics.bundle._screen the checks of untrusted rows (bundle reader and merge).
All are optional: without a C compiler the install still succeeds and the tools run
their Python/SQL paths, with the same output. None links against libsqlite3: they borrow apsw's SQLite
at run time, and build against SQLite's headers kept in csrc/sqlite (a machine with a
compiler often lacks libsqlite3-dev).

INGERO_PURE=1 builds without them: a py3-none-any wheel that installs on any Python and
platform the dependencies have wheels for (the offline kit for another target,
ingero_forensics/kit.py; the capture needs none of them).
"""

import os

from setuptools import Extension, setup

PURE = os.environ.get("INGERO_PURE", "") not in ("", "0")
SQLITE_HEADERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "sqlite")

setup(ext_modules=[] if PURE else [
    Extension(f"ingero_forensics.{pkg}.{name}", [f"ingero_forensics/{pkg}/{name}.c"],
              include_dirs=[SQLITE_HEADERS],
              extra_compile_args=["-O2", "-fvisibility=hidden"], optional=True)
    for pkg, name in (("export", "_fastslices"), ("merge", "_fastcoll"),
                      ("bundle", "_screen"))
])
