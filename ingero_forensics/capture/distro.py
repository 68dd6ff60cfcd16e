"""Which Linux distribution family a node runs, for fix messages that name its packages.

Read from /etc/os-release (``ID`` and ``ID_LIKE``), never from the network. The package
names are those of the distributions' own repositories, which an air-gapped site mirrors:

============  =====================================  ================================
family        BCC (Python module and tools)          kernel headers for BCC
============  =====================================  ================================
debian        python3-bpfcc bpfcc-tools (apt)        linux-headers-$(uname -r)
rhel          python3-bcc bcc-tools (dnf / yum)      kernel-devel-$(uname -r)
suse          python3-bcc bcc-tools (zypper)         kernel-default-devel
============  =====================================  ================================

Debian and Ubuntu put BCC's Python module in /usr/lib/python3/dist-packages; RHEL, Rocky,
Alma, Oracle Linux, CentOS Stream, Fedora and SUSE in /usr/lib/python3.X/site-packages
(or lib64), for the distribution's own Python 3.X (see ``capture.ebpf._bcc``).
"""

from __future__ import annotations

from dataclasses import dataclass

OS_RELEASE = "/etc/os-release"

#: family -> the IDs that belong to it (matched against ID, then each word of ID_LIKE)
FAMILY_IDS = {
    "debian": ("debian", "ubuntu", "linuxmint", "pop", "raspbian"),
    "rhel": ("rhel", "centos", "rocky", "almalinux", "ol", "fedora", "amzn", "circle",
             "navy", "eurolinux"),
    "suse": ("sles", "opensuse", "opensuse-leap", "opensuse-tumbleweed", "suse", "sle"),
}


@dataclass(frozen=True)
class Packages:
    """Install commands for one family (shell text, shown in fix messages)."""
    family: str
    bcc: str
    headers: str
    chrony: str


PACKAGES = {
    "debian": Packages("debian", "apt install python3-bpfcc bpfcc-tools",
                       "apt install linux-headers-$(uname -r)", "apt install chrony"),
    "rhel": Packages("rhel", "dnf install python3-bcc bcc-tools",
                     "dnf install kernel-devel-$(uname -r)", "dnf install chrony"),
    "suse": Packages("suse", "zypper install python3-bcc bcc-tools",
                     "zypper install kernel-default-devel", "zypper install chrony"),
}
UNKNOWN = Packages(
    "unknown",
    "install the distribution's BCC Python package (Debian/Ubuntu: python3-bpfcc "
    "bpfcc-tools; RHEL/Rocky/Alma/Fedora: python3-bcc bcc-tools)",
    "install the kernel headers of the running kernel (Debian/Ubuntu: "
    "linux-headers-$(uname -r); RHEL family: kernel-devel-$(uname -r))",
    "install chrony")


def read_os_release(path: str = OS_RELEASE) -> dict[str, str]:
    """KEY=value pairs of os-release (quotes removed); {} when it cannot be read."""
    out = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read(65536)
    except OSError:
        return out
    for line in text.splitlines():
        key, sep, value = line.strip().partition("=")
        if not sep or key.startswith("#"):
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1].replace('\\"', '"').replace("\\\\", "\\")
        out[key] = value
    return out


def family(info: dict[str, str]) -> str:
    """'debian', 'rhel', 'suse' or 'unknown' from os-release's ID, then ID_LIKE."""
    ids = [info.get("ID", "").lower()] + info.get("ID_LIKE", "").lower().split()
    for ident in ids:
        for fam, members in FAMILY_IDS.items():
            if ident in members:
                return fam
    return "unknown"


def packages(path: str = OS_RELEASE) -> Packages:
    """The install commands for the distribution at path (os-release)."""
    return PACKAGES.get(family(read_os_release(path)), UNKNOWN)


__all__ = ["OS_RELEASE", "Packages", "PACKAGES", "UNKNOWN", "family", "packages",
           "read_os_release"]
