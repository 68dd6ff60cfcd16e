"""Build hook for the C extensions; everything else is in pyproject.toml.

ingero_forensics.export._fastslices speeds up ingero-export (docs/export.md),
ingero_forensics.merge._fastcoll the collectives of ingero-merge (docs/merge.md), and
ingero_forensics.bundle._screen the checks of untrusted rows (bundle reader and merge). All are optional: without a C compiler or the SQLite headers (Debian:
gcc, libsqlite3-dev) the install still succeeds and the tools run their Python/SQL
paths, with the same output. None links against libsqlite3: they borrow apsw's SQLite
at run time.

INGERO_PURE=1 builds without them: a py3-none-any wheel that installs on any Python and
platform the dependencies have wheels for (the offline kit for another target,
ingero_forensics/kit.py; the capture needs none of them).
"""

import os

from setuptools import Extension, setup

PURE = os.environ.get("INGERO_PURE", "") not in ("", "0")

setup(ext_modules=[] if PURE else [
    Extension(f"ingero_forensics.{pkg}.{name}", [f"ingero_forensics/{pkg}/{name}.c"],
              extra_compile_args=["-O2", "-fvisibility=hidden"], optional=True)
    for pkg, name in (("export", "_fastslices"), ("merge", "_fastcoll"),
                      ("bundle", "_screen"))
])
