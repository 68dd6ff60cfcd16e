"""Every subpackage ships in the wheel, and so do the report templates."""

import json
import os
import re
import shutil
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "ingero_forensics").rglob("__init__.py")}
    assert found <= listed, f"missing from pyproject packages: {sorted(found - listed)}"
    assert "ingero_forensics.templates" in listed


def test_console_scripts_resolve():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    import importlib
    from ingero_forensics import entry
    for name, target in scripts.items():
        mod, func = target.split(":")
        assert callable(getattr(importlib.import_module(mod), func)), name
        # the entry points load their command when run: that module has the main()
        assert mod == "ingero_forensics.entry" and func in entry.COMMANDS, target
        assert callable(importlib.import_module(entry.COMMANDS[func]).main), name
    assert set(scripts) >= {"ingero-capture", "ingero-merge", "ingero-export", "ingero-report",
                            "ingero-simulate", "ingero-query"}


def test_installed_wheel_runs_the_pipeline(tmp_path):
    """A plain wheel install (no source tree on sys.path) simulates, merges and reports."""
    import subprocess
    import sys
    # A wheelhouse of the project and every dependency, built here: the install below
    # reads nothing else (the air-gap install, docs/airgap.md).
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(wheels), str(ROOT)],
                   check=True, capture_output=True)
    (wheel,) = wheels.glob("ingero_forensics-*.whl")
    import zipfile
    names = zipfile.ZipFile(wheel).namelist()
    # The C accelerators are optional; where they can be built (gcc and the SQLite
    # headers, as scripts/test.sh installs), the wheel must carry them.
    can_build = shutil.which("gcc") and Path("/usr/include/sqlite3ext.h").exists()
    built = True
    for mod in ("export/_fastslices", "merge/_fastcoll"):
        has = any(re.match(rf"ingero_forensics/{mod}\..*\.so$", n) for n in names)
        assert has or not can_build, f"the wheel lacks ingero_forensics/{mod}"
        built = built and has
    venv = tmp_path / "venv"
    # No system site-packages: only what the wheelhouse holds can be imported.
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    assert subprocess.run([str(py), "-c", "import sys; print(sys.prefix != sys.base_prefix and "
                           "not any('site-packages' in p and not p.startswith(sys.prefix) "
                           "for p in sys.path))"], check=True, capture_output=True,
                          text=True).stdout.strip() == "True"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull   # no index or find-links from a pip.conf either
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-index", "--find-links",
                    str(wheels), "ingero-forensics"], check=True, capture_output=True, env=env)
    work = tmp_path / "work"   # not the source tree: imports must come from the wheel
    work.mkdir()
    run = lambda *a: subprocess.run([str(venv / "bin" / a[0]), *a[1:]], cwd=work,  # noqa: E731
                                    check=True, capture_output=True, text=True)
    where = subprocess.run([str(py), "-c", "import ingero_forensics, apsw, zstandard; "
                            "print(ingero_forensics.__file__, apsw.__file__, zstandard.__file__)"],
                           cwd=work, check=True, capture_output=True, text=True).stdout.split()
    assert len(where) == 3 and all(w.startswith(str(venv)) for w in where), where
    run("ingero-simulate", "-o", "b", "--nodes", "3", "--ranks-per-node", "2", "--steps", "40",
        "--fault", "cpu", "--seed", "5")
    merged = json.loads(run("ingero-merge", "b", "-o", "fleet.db", "--json").stdout)
    assert merged["accelerated"] == bool(built)
    out = run("ingero-report", "fleet.db", "-o", "report.html")
    accel = subprocess.run([str(py), "-c", "from ingero_forensics.export.chrome_trace import "
                            "ExportOptions, export_chrome_trace as e; "
                            "print(e('fleet.db', 't.json', ExportOptions()).accelerated)"],
                           cwd=work, check=True, capture_output=True, text=True).stdout
    assert accel.strip() == str(bool(built))
    assert (work / "t.json").stat().st_size > 0
    assert "Report written" in out.stdout
    html = (work / "report.html").read_text()
    assert "<style>" in html and "Straggler report" in html


def test_accelerators_build_against_the_kept_sqlite_headers(tmp_path):
    """The C accelerators need SQLite's headers, which a machine with a compiler often
    lacks (a GPU node's image, most likely: the optional extensions were skipped without a
    word and its merge ran the pure-Python path at half the speed). setup.py points every
    compile at csrc/sqlite, and those headers are the ones the compiler finds first."""
    import subprocess
    import sys
    import sysconfig
    out = subprocess.run([sys.executable, "setup.py", "-v", "build_ext", "--dry-run",
                          "--force", "--build-temp", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    compiles = [line for line in out.splitlines() if " -c ingero_forensics/" in line]
    kept = ROOT / "csrc" / "sqlite"
    assert len(compiles) == 3 and all(f"-I{kept} " in line for line in compiles), compiles
    for line in compiles:
        source = line.split(" -c ", 1)[1].split()[0]
        r = subprocess.run(["gcc", "-fsyntax-only", "-H", f"-I{kept}",
                            f"-I{sysconfig.get_paths()['include']}", source], cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        found = [x.lstrip(". ") for x in r.stderr.splitlines() if x.endswith("sqlite3ext.h")]
        assert found and found[0] == str(kept / "sqlite3ext.h"), found
