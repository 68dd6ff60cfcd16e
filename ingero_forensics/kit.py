"""The offline kit: everything a site with no network needs to install the tools.

``build_kit(out_dir, python="3.11", platform="manylinux_2_28_x86_64")`` runs on a
connected machine and writes one archive, ``ingero-kit-<version>-cp311-<platform>.tar.gz``
(and ``<archive>.sha256``), holding

* ``wheels/``: this project's wheel and the wheels of all its dependencies for the named
  target (CPython version and platform), fetched with ``pip download --only-binary``;
* ``ingero-capture.pyz``: the capture as one file for the same target (below);
* ``install.sh``: the node installer: checks the checksums, the Python version and the
  C library, creates a virtual environment and runs ``pip install --no-index``; it puts
  the node's launchers (``ingero-job-capture.sh``, ``ingero-capture.service``, from
  scripts/) in ``PREFIX/share/``;
* ``kit.json`` (target, wheels, minimum glibc), ``README.txt`` and ``SHA256SUMS``.

The project wheel carries the optional C accelerators (merge and export speed-ups,
docs/export.md) when the target is this machine's own Python and platform; for another
target it is built without them (``INGERO_PURE=1``, a py3-none-any wheel): the tools run
the same, the capture never needed them.

``build_capture_pyz(wheels, out, python=...)`` makes ``ingero-capture.pyz``: a zipapp that
runs with the node's own ``python3`` (of the target's version) and the distribution's
BCC, with nothing pip-installed. It holds this package and the capture's dependencies
(apsw, zstandard, click, orjson) unpacked from their wheels; on first run it extracts
them once to a cache directory (``$INGERO_PYZ_CACHE``, else ``/var/cache/ingero-capture``
for root, else ``~/.cache/ingero-capture``), named after the archive's content hash,
because compiled modules cannot be imported from a zip.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import platform as pyplatform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from . import __version__
from .errors import IngeroError

KIT_FORMAT = 1
#: Files of scripts/ that the kit carries and install.sh puts in PREFIX/share/.
NODE_FILES = ("ingero-job-capture.sh", "ingero-capture.service")
#: What ingero-capture imports beyond the standard library (with this package).
CAPTURE_DEPS = ("apsw", "zstandard", "click", "orjson")
#: glibc of the manylinux tags that name none in their own spelling.
_LEGACY_MANYLINUX = {"manylinux1": (2, 5), "manylinux2010": (2, 12), "manylinux2014": (2, 17)}


class KitError(IngeroError):
    """The kit cannot be built (no source tree, pip failed, no wheel for the target)."""


@dataclass(frozen=True)
class Target:
    python: str          # "3.11"
    platform: str        # "manylinux_2_28_x86_64", or "linux_x86_64" for this machine

    @property
    def abi(self) -> str:
        return "cp" + self.python.replace(".", "")

    @property
    def name(self) -> str:
        return f"{self.abi}-{self.platform}"


def native_target() -> Target:
    return Target(f"{sys.version_info[0]}.{sys.version_info[1]}",
                  sysconfig.get_platform().replace("-", "_").replace(".", "_"))


def source_tree() -> Path | None:
    """The repository this package was imported from, when it is a source checkout."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "pyproject.toml").is_file() and (root / "setup.py").is_file() else None


def wheel_min_glibc(name: str) -> tuple[int, int] | None:
    """The oldest glibc a wheel file installs on (None: pure or not manylinux)."""
    tags = name[:-4].split("-")[-1].split(".")
    found = []
    for tag in tags:
        m = re.match(r"manylinux_(\d+)_(\d+)_", tag)
        if m:
            found.append((int(m.group(1)), int(m.group(2))))
        else:
            base = tag.split("_", 1)[0]
            if base in _LEGACY_MANYLINUX:
                found.append(_LEGACY_MANYLINUX[base])
    return min(found) if found else None


def compatible_platforms(platform: str) -> list[str]:
    """A manylinux_2_Y tag and every older manylinux tag a node with that glibc accepts
    (pip download takes only the tags it is given)."""
    m = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if not m:
        return [platform]
    y, arch = int(m.group(1)), m.group(2)
    tags = [f"manylinux_2_{v}_{arch}" for v in range(y, 4, -1)]
    tags += [f"{legacy}_{arch}" for legacy, (_, v) in _LEGACY_MANYLINUX.items() if v <= y]
    return tags


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def write_sha256sums(directory: Path) -> Path:
    """SHA256SUMS (sha256sum -c format) of every file under directory, sorted."""
    lines = []
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != "SHA256SUMS":
            lines.append(f"{sha256_file(p)}  {p.relative_to(directory).as_posix()}\n")
    out = directory / "SHA256SUMS"
    out.write_text("".join(lines))
    return out


def _pip(args: list[str], what: str) -> None:
    cmd = [sys.executable, "-m", "pip", *args]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        last = [ln for ln in (p.stderr or p.stdout).splitlines() if ln.strip()]
        raise KitError(f"{what}: pip failed: {last[-1] if last else p.returncode}")


def _requirements(wheel: Path) -> list[str]:
    """Requires-Dist of a wheel, without extras."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:") and "extra ==" not in line]


@dataclass
class KitResult:
    archive: str
    sha256: str
    target: dict
    wheels: list[str] = field(default_factory=list)
    min_glibc: str | None = None
    pure: bool = False
    pyz: str | None = None
    elapsed_s: float = 0.0
    #: what the builder should know: a native kit whose wheel lacks the accelerators
    warnings: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


#: A wheel platform tag pip can download for: manylinux (PEP 600 or legacy), musllinux.
PLATFORM_TAG = re.compile(r"(manylinux_\d+_\d+|manylinux(1|2010|2014)|musllinux_\d+_\d+|linux)"
                          r"_(x86_64|aarch64|ppc64le|s390x|i686|armv7l)")


def default_platform(python: str, native: Target) -> str:
    """This machine's tag for this machine's Python; for another Python, the manylinux
    tag of glibc 2.28 on this architecture (the binary wheels on PyPI carry manylinux
    tags, never this machine's plain linux_* one)."""
    if python == native.python:
        return native.platform
    machine = {"arm64": "aarch64", "amd64": "x86_64"}.get(pyplatform.machine().lower(),
                                                          pyplatform.machine())
    return f"manylinux_2_28_{machine}"


def source_version(src: Path) -> str:
    """The version the source tree builds (its pyproject.toml), which names the kit."""
    m = re.search(r'^version\s*=\s*"([^"]+)"', (src / "pyproject.toml").read_text(), re.M)
    return m.group(1) if m else __version__


def build_kit(out_dir, *, python: str | None = None, platform: str | None = None,
              source=None, pyz: bool = True) -> KitResult:
    """Build the kit archive for one target into out_dir; return what it holds."""
    native = native_target()
    python = python or native.python
    if not re.fullmatch(r"3\.\d{1,2}", python):
        raise KitError(f"--python {python}: give a CPython version such as 3.11")
    if tuple(map(int, python.split("."))) < (3, 10):
        raise KitError(f"--python {python}: ingero-forensics needs Python 3.10 or "
                       "newer (RHEL 8/9: dnf install python3.11; then --python 3.11)")
    target = Target(python, platform or default_platform(python, native))
    if target != native and not PLATFORM_TAG.fullmatch(target.platform):
        raise KitError(f"--platform {target.platform}: not a wheel platform tag pip can "
                       "download for (e.g. manylinux_2_28_x86_64, manylinux_2_28_aarch64)")
    src = Path(source) if source else source_tree()
    if src is None or not (src / "pyproject.toml").is_file():
        raise KitError(f"{src or Path(__file__).parent}: not a source tree of "
                       "ingero-forensics (give --source DIR, a clone of the repository)")
    out_dir = Path(out_dir)
    made = not out_dir.exists()
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KitError(f"{out_dir}: cannot create the output directory: "
                       f"{e.strerror or e}") from None
    try:
        return _build(out_dir, target, native, src, pyz)
    except BaseException:
        if made:            # a failed build leaves no empty directory behind
            with contextlib.suppress(OSError):
                out_dir.rmdir()
        raise


def _build(out_dir: Path, target: Target, native: Target, src: Path, pyz: bool) -> KitResult:
    t0 = time.monotonic()
    is_native = target == native
    version = source_version(src)
    name = f"ingero-kit-{version}-{target.name}"
    with tempfile.TemporaryDirectory(prefix=".ingero-kit-", dir=out_dir) as tmp:
        kit = Path(tmp) / name
        wheels = kit / "wheels"
        wheels.mkdir(parents=True)
        env_pure = {} if is_native else {"INGERO_PURE": "1"}
        _build_project_wheel(src, wheels, env_pure)
        (project,) = wheels.glob("ingero_forensics-*.whl")
        warnings = []
        accelerated = is_native and wheel_has_accelerators(project)
        if is_native and not accelerated:
            # the build goes on without them (they are optional), but not in silence
            warnings.append(
                "the C accelerators were not built (no C compiler or Python headers "
                "here?): merge and export will run their Python paths, about 2x slower; "
                "install gcc and the Python headers (python3-dev, python3-devel) and "
                "build the kit again")
        reqs = _requirements(project)
        platform_args = [] if is_native else [
            *(a for tag in compatible_platforms(target.platform) for a in ("--platform", tag)),
            "--python-version", target.python, "--implementation", "cp", "--abi", target.abi]
        _pip(["download", "-q", "--only-binary=:all:", "-d", str(wheels), *platform_args,
              *reqs], f"dependencies for {target.name}")
        names = sorted(p.name for p in wheels.glob("*.whl"))
        glibcs = [g for g in map(wheel_min_glibc, names) if g]
        min_glibc = ".".join(map(str, max(glibcs))) if glibcs else None
        pyz_name = None
        if pyz:
            pyz_path = build_capture_pyz(wheels, kit / "ingero-capture.pyz", target,
                                         version)
            pyz_name = pyz_path.name
        (kit / "kit.json").write_text(json.dumps({
            "kit_format": KIT_FORMAT, "version": version, "python": target.python,
            "platform": target.platform, "abi": target.abi, "min_glibc": min_glibc,
            "accelerators": accelerated, "wheels": names, "pyz": pyz_name,
            "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, indent=2) + "\n")
        for extra in NODE_FILES:       # the node's launchers, from the source tree
            shutil.copy(src / "scripts" / extra, kit / extra)
        # the runbook travels with the kit: the site has no network to read it on
        shutil.copy(src / "docs" / "airgap.md", kit / "airgap.md")
        (kit / "install.sh").write_text(INSTALL_SH)
        (kit / "install.sh").chmod(0o755)
        (kit / "README.txt").write_text(README_TXT.format(
            name=name, python=target.python, platform=target.platform,
            glibc=min_glibc or "any"))
        write_sha256sums(kit)
        archive = out_dir / f"{name}.tar.gz"
        tmp_archive = Path(tmp) / archive.name
        with tarfile.open(tmp_archive, "w:gz") as tar:
            tar.add(kit, arcname=name, filter=_tar_filter)
        digest = sha256_file(tmp_archive)
        os.replace(tmp_archive, archive)
    (out_dir / f"{archive.name}.sha256").write_text(f"{digest}  {archive.name}\n")
    return KitResult(str(archive), digest, asdict(target), names, min_glibc, not accelerated,
                     pyz_name, round(time.monotonic() - t0, 1), warnings)


def wheel_has_accelerators(wheel: Path) -> bool:
    """The project wheel carries compiled extension modules (the C accelerators)."""
    with zipfile.ZipFile(wheel) as z:
        return any(n.endswith(".so") for n in z.namelist())


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo:
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    return info


def _build_project_wheel(src: Path, wheels: Path, extra_env: dict) -> None:
    env = {**os.environ, **extra_env}
    with tempfile.TemporaryDirectory(prefix="ingero-wheel-") as build:
        # a copy: a pure build must not reuse the C objects of an earlier build
        # in src/build, and the source tree stays as it was
        copy = Path(build) / "src"
        shutil.copytree(src, copy, ignore=shutil.ignore_patterns(
            ".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".cache",
            "*.so", "bench", "tests"))
        p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "-w", str(wheels), str(copy)], capture_output=True, text=True,
                           env=env)
    if p.returncode != 0:
        last = [ln for ln in p.stderr.splitlines() if ln.strip()]
        raise KitError(f"{src}: building the wheel failed: {last[-1] if last else p.returncode}")


# ------------------------------------------------------------------ the one-file capture

PYZ_MAIN = r'''"""ingero-capture as one file (ingero-forensics {version}, {abi}-{platform}).

Runs with the node's python3 {python}; nothing needs to be installed but BCC from the
distribution. The packages inside are extracted once to a cache directory (compiled
modules cannot be imported from a zip): $INGERO_PYZ_CACHE, else
/var/cache/ingero-capture (root) or ~/.cache/ingero-capture, in a directory named after
this file's content hash.
"""
import os
import sys
import zipfile

BUILD = "{build}"
PYTHON = ({major}, {minor})


def _cache_root():
    if os.environ.get("INGERO_PYZ_CACHE"):
        return os.environ["INGERO_PYZ_CACHE"]
    if os.geteuid() == 0:
        return "/var/cache/ingero-capture"
    return os.path.join(os.path.expanduser("~"), ".cache", "ingero-capture")


def _site():
    here = os.path.dirname(os.path.abspath(__file__))    # the .pyz itself
    site = os.path.join(_cache_root(), BUILD)
    if os.path.isfile(os.path.join(site, ".complete")):
        return site
    import shutil
    os.makedirs(_cache_root(), mode=0o755, exist_ok=True)
    tmp = site + ".%d.tmp" % os.getpid()
    with zipfile.ZipFile(here) as z:
        z.extractall(tmp, [n for n in z.namelist()
                           if n.startswith("site/") and not n.endswith("/")])
    open(os.path.join(tmp, "site", ".complete"), "w").close()
    try:
        os.rename(os.path.join(tmp, "site"), site)     # complete, or not there at all
    except OSError:
        if not os.path.isfile(os.path.join(site, ".complete")):
            raise
    shutil.rmtree(tmp, ignore_errors=True)
    return site


def main():
    if sys.version_info[:2] != PYTHON:
        fix = ("run it with python%d.%d, or use a kit built for this Python "
               "(ingero-kit --python %d.%d)" % (PYTHON + sys.version_info[:2])
               if sys.version_info[:2] >= (3, 10) else
               "run it with python%d.%d (ingero-forensics needs 3.10 or newer)" % PYTHON)
        sys.stderr.write("Error: %s: built for Python %d.%d, not %d.%d; %s\n"
                         % (sys.argv[0], PYTHON[0], PYTHON[1], sys.version_info[0],
                            sys.version_info[1], fix))
        sys.exit(1)
    try:
        site = _site()
    except OSError as e:
        sys.stderr.write("Error: %s: cannot extract to %s: %s (set INGERO_PYZ_CACHE)\n"
                         % (sys.argv[0], _cache_root(), e.strerror or e))
        sys.exit(1)
    sys.path.insert(0, site)
    from ingero_forensics.capture.cli import main as capture
    capture(prog_name="ingero-capture")


if __name__ == "__main__":
    main()
'''


def build_capture_pyz(wheels, out, target: Target | None = None,
                      version: str = __version__) -> Path:
    """ingero-capture.pyz from a wheelhouse holding the project and CAPTURE_DEPS."""
    target = target or native_target()
    wheels, out = Path(wheels), Path(out)
    chosen = []
    for dist in ("ingero_forensics",) + CAPTURE_DEPS:
        found = sorted(wheels.glob(f"{dist}-*.whl"))
        if not found:
            raise KitError(f"{wheels}: no wheel of {dist} for the one-file capture")
        chosen.append(found[-1])
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for whl in chosen:
            with zipfile.ZipFile(whl) as w:
                for info in sorted(w.infolist(), key=lambda i: i.filename):
                    if info.is_dir() or ".dist-info/" in info.filename:
                        continue
                    if whl.name.startswith("ingero_forensics-") and \
                            info.filename.endswith(".so"):
                        continue     # the capture never loads the accelerators
                    zi = zipfile.ZipInfo(f"site/{info.filename}", (1980, 1, 1, 0, 0, 0))
                    zi.external_attr = 0o644 << 16
                    zi.compress_type = zipfile.ZIP_DEFLATED
                    z.writestr(zi, w.read(info))
    body = buf.getvalue()
    build = hashlib.sha256(body).hexdigest()[:16]
    major, minor = target.python.split(".")
    main = PYZ_MAIN.format(version=version, abi=target.abi, platform=target.platform,
                           python=target.python, build=build, major=major, minor=minor)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(b"#!/usr/bin/env python3\n")
        with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as z:
            zi = zipfile.ZipInfo("__main__.py", (1980, 1, 1, 0, 0, 0))
            zi.external_attr = 0o644 << 16
            zi.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(zi, main)
            with zipfile.ZipFile(io.BytesIO(body)) as src:
                for info in src.infolist():
                    z.writestr(info, src.read(info))
    tmp.chmod(0o755)
    os.replace(tmp, out)
    return out


# ------------------------------------------------------------------ files in the kit

INSTALL_SH = r'''#!/bin/sh
# Install ingero-forensics on a node from this kit, with no network.
#   sh install.sh [PREFIX]        (default PREFIX: /opt/ingero-forensics)
# Checks SHA256SUMS, the Python version and the C library against kit.json, creates a
# virtual environment in PREFIX and installs the wheels with pip --no-index. Needs
# python3 of the kit's version with its venv module (Debian/Ubuntu: python3-venv);
# python3.X of that version is used when present, PYTHON=... names another.
# BCC and the kernel headers come from the distribution (docs/airgap.md).
set -eu
KIT=$(cd "$(dirname "$0")" && pwd)
PREFIX=${1:-/opt/ingero-forensics}
case "$PREFIX" in /*) ;; *) PREFIX="$(pwd)/$PREFIX" ;; esac   # before the cd below
cd "$KIT"
# the kit's Python: python3.X when installed beside another python3 (RHEL: python3.11
# next to the system's 3.9), else python3; PYTHON=/path/to/python overrides
KITPY=$(sed -n 's/.*"python": *"\([0-9][0-9.]*\)".*/\1/p' kit.json)
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -n "$KITPY" ] && command -v "python$KITPY" >/dev/null 2>&1; then PY="python$KITPY"
else PY=python3; fi

if command -v sha256sum >/dev/null 2>&1; then
  sha256sum -c --quiet SHA256SUMS || { echo "Error: $KIT: SHA256SUMS check failed" >&2; exit 1; }
else
  "$PY" - <<'EOF' || { echo "Error: $KIT: SHA256SUMS check failed" >&2; exit 1; }
import hashlib, sys
bad = [n for s, n in (l.split("  ", 1) for l in open("SHA256SUMS").read().splitlines())
       if hashlib.sha256(open(n, "rb").read()).hexdigest() != s]
sys.exit(1 if bad else 0)
EOF
fi

"$PY" - <<'EOF' || exit 1
import json, platform, sys
kit = json.load(open("kit.json"))
want = tuple(int(x) for x in kit["python"].split("."))
if sys.version_info[:2] != want:
    other = ("build a kit with ingero-kit --python %d.%d, or " % sys.version_info[:2]
             if sys.version_info[:2] >= (3, 10) else "ingero-forensics needs 3.10 or newer: ")
    sys.exit("Error: %s is Python %d.%d; this kit is for Python %s (%sinstall python%s; "
             "if it is installed under another name, PYTHON=/path/to/it sh install.sh)"
             % (sys.executable, sys.version_info[0], sys.version_info[1], kit["python"],
                other, kit["python"]))
lib, ver = platform.libc_ver()
if kit["min_glibc"] and lib == "glibc":
    have = tuple(int(x) for x in ver.split(".")[:2])
    need = tuple(int(x) for x in kit["min_glibc"].split("."))
    if have < need:
        sys.exit("Error: glibc %s is older than %s, which the kit's wheels need; see "
                 "airgap.md, section 3, 'The C library'" % (ver, kit["min_glibc"]))
EOF

VERSION=$("$PY" -c 'import json; print(json.load(open("kit.json"))["version"])')
"$PY" -m venv "$PREFIX"
# this kit's version and dependencies, over whatever an earlier kit installed there;
# then this kit's own wheel again: a kit of the same version number from newer sources
# must replace the code (pip keeps an installed version it is asked for)
"$PREFIX/bin/python" -m pip install --quiet --no-index --no-cache-dir --upgrade \
    --find-links "$KIT/wheels" "ingero-forensics==$VERSION"
"$PREFIX/bin/python" -m pip install --quiet --no-index --no-cache-dir --no-deps \
    --force-reinstall "$KIT"/wheels/ingero_forensics-*.whl
mkdir -p "$PREFIX/share"
cp ingero-job-capture.sh ingero-capture.service "$PREFIX/share/"
chmod 755 "$PREFIX/share/ingero-job-capture.sh"
echo "ingero-forensics $VERSION installed in $PREFIX (no network used)."
echo "Next: $PREFIX/bin/ingero-capture --check --strict"
'''

README_TXT = """{name}

ingero-forensics, offline kit for CPython {python} on {platform} (glibc >= {glibc}).

  sha256sum -c SHA256SUMS                     # the files are what was packed
  sudo sh install.sh /opt/ingero-forensics    # venv + pip install --no-index
  /opt/ingero-forensics/bin/ingero-capture --check --strict

or, with nothing installed on the node (BCC from the distribution still needed):

  sudo python3 ingero-capture.pyz --check --strict

(python3 of version {python}: python{python} where that is its name, as on RHEL;
install.sh finds it by itself, PYTHON=/path/to/python names another.)

airgap.md, in this kit, is the whole procedure (docs/airgap.md of the project).
"""


__all__ = ["CAPTURE_DEPS", "KitError", "KitResult", "Target", "build_capture_pyz",
           "build_kit", "compatible_platforms", "native_target", "sha256_file", "source_tree",
           "wheel_has_accelerators", "wheel_min_glibc",
           "write_sha256sums"]
