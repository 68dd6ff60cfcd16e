"""Build hook for the one C extension; everything else is in pyproject.toml.

ingero_forensics.export._fastslices speeds up ingero-export (see docs/export.md). It is
optional: without a C compiler or the SQLite headers (Debian: gcc, libsqlite3-dev) the
install still succeeds and the export runs its pure-Python path, byte for byte the same.
It does not link against libsqlite3: it borrows apsw's SQLite at run time.
"""

from setuptools import Extension, setup

setup(ext_modules=[
    Extension("ingero_forensics.export._fastslices",
              ["ingero_forensics/export/_fastslices.c"],
              extra_compile_args=["-O2", "-fvisibility=hidden"],
              optional=True),
])
