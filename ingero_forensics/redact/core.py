"""A redacted copy of fleet.db: what may leave an air-gapped site (docs/airgap.md).

``redact_fleet(src, dest)`` writes a copy of a fleet.db in which

* host names and node names become node ids (``nodeid-3``: the node_id of the node that
  first carries the name), wherever they appear: nodes, manifests, meta, file names,
  log messages, command lines;
* IP addresses (IPv4, IPv6, IPv4-mapped, and chrony's hex reference ids) become stable
  pseudonyms, the same for one address throughout one output and prefix-preserving
  octet by octet (IPv6: group by group), so addresses that share a subnet still share
  it. The pseudonyms come from a random key drawn for each output, never equal an
  original address and never contain one; loopback and unspecified addresses are kept;
* command lines (processes.cmdline), executables, stack frames' modules and files, and
  every path in any text (and the paths the merge was given, relative ones too) are
  reduced to base names; URLs to scheme, host pseudonym and base name;
* user names (from home directories /home/NAME, /Users/NAME, /scratch/NAME, ~NAME/,
  URL user info, user@host words whose host is a node or an address) are removed: a
  path that ends in one becomes ``~`` and any other occurrence ``user``; user@host
  words with any named host, and e-mail addresses, become ``user@host``;
* other machines named in the fleet's DNS domains become ``host.domain`` (a node's own
  name, ``NODE.domain``).

The working copy is built in a private directory beside src (never beside dest, which may
be the medium that leaves the site), every TEXT column of every table is rewritten (enum
columns and hashes excepted), then ``VACUUM INTO`` writes dest fresh, so no page of the
original content survives in free space; fleet_info gets a ``redacted`` row. The source
is only read.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import json
import os
import re
import secrets
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import apsw

from .. import __version__
from ..cliutil import BadUsage, evidence_kind, sqlite_message
from ..db import connect_readonly
from ..errors import IngeroError
from ..fleetfile import check_fleet_file
from ..interrupts import run_held

#: Columns holding hashes or fixed vocabularies: never sensitive, not scanned (a user
#: name that is also a word must not rewrite a metric or API name the report reads).
SKIP_COLUMNS = frozenset({"comm_id_hash", "parent_hash", "hash", "sha256", "segment_id",
                          "hist_log2"})
SKIP_TABLE_COLUMNS = frozenset({("host_samples", "metric"), ("host_bins", "metric"),
                                ("event_stats", "name"),
                                ("cuda_events", "api"), ("calls_in_flight", "api")})
NODE_PREFIX = "nodeid-"
HOME_DIRS = ("home", "Users", "scratch", "u", "homes")
USER_WORD = "user"

_IPV4 = re.compile(r"(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?![\w.]*\d)")
_IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|"
                   r"\d{1,3}(?:\.\d{1,3}){3})?(?![\w:])")
_URL = re.compile(r"\b([A-Za-z][A-Za-z0-9+.-]*)://([^/\s\"'<>]*)([^\s\"'<>]*)")
_PATH = re.compile(r"(?<![\w.\-/~])(?:~[A-Za-z_][A-Za-z0-9._-]{0,31}|~|\.{1,2})?/(?!/)"
                   r"[^\s\"'`,;()<>\[\]{}|*]*")
_HOME = re.compile(r"/(?:" + "|".join(HOME_DIRS) + r")/([A-Za-z0-9._-]+)")
#: An e-mail address: any local part (dots, plus, digits, quotes), then a DNS name whose
#: last label is a word (acme.com; not a version such as torch@2.1). It also takes words
#: of that shape that are no address (ckpt@step10.pt): over-redaction, never a leak.
_EMAIL = re.compile(r"[^\s@<>\"(),;:=/\[\]]+@([A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,})"
                    r"(?![A-Za-z0-9-])")
_USER_AT = re.compile(r"(?<![\w.+-])([A-Za-z_][A-Za-z0-9._-]{0,31})@([A-Za-z0-9][\w.-]*)")
_HEX_IPV4 = re.compile(r"^[0-9A-F]{8}$")
#: ~NAME/...: a user's home directory in shell shorthand
#: A word with a slash in it, looked up among the paths the merge was given
_SLASHED_WORD = re.compile(r"[^\s\"'`,;()<>\[\]{}|*=]*/[^\s\"'`,;()<>\[\]{}|*]*")
#: The host of user@host when it is a host name: letters, digits, hyphens and dots
#: (not GLIBC_2.14), and no version (v4), digest (sha256) or linker suffix (plt)
_HOST_NAME = re.compile(r"(?!v\d|sha\d|plt$|got$)[A-Za-z][A-Za-z0-9-]*(?:\.[A-Za-z0-9-]+)*")
_TILDE_USER = re.compile(r"(?<![\w~])~([A-Za-z_][A-Za-z0-9._-]{0,31})(?=/|\s|$)")
#: Top-level directories whose bare name says nothing of a site ("/proc and NVML
#: counters" keeps its slash); any longer path is still cut to its base name
SYSTEM_ROOTS = frozenset({"proc", "sys", "dev", "tmp", "etc", "usr", "var", "opt", "run",
                          "bin", "sbin", "lib", "lib64", "boot", "mnt", "srv", "root"})


#: What SQLite says of a damaged page met in the working copy: the source's (the backup
#: copies pages as they are), so the source is named.
_DAMAGED = (apsw.CorruptError, apsw.NotADBError)


class RedactError(IngeroError):
    """fleet.db cannot be redacted (not a fleet.db, unreadable, output not writable)."""


class OutputIsInput(RedactError, BadUsage):
    """The output names the input itself: a usage error (exit 2), refused before any work."""


class BadOutput(RedactError, BadUsage):
    """An -o that is refused before any work (exit 2): a bundle or a fleet.db that is not
    redacted (evidence), or "-" (the copy is a database file, not a stream)."""


# ------------------------------------------------------------------ IP pseudonyms

class IpPseudonyms:
    """Prefix-preserving pseudonyms, keyed per output.

    IPv4 maps octet by octet, IPv6 16-bit group by group: the pseudonym of a prefix
    depends only on that prefix, so two addresses sharing their first k octets (groups)
    share the first k of their pseudonyms, and different children of one prefix get
    different pseudonyms. The first octet (group) is drawn outside the originals' first
    octets, and a full pseudonym that would contain an original address as text is
    skipped, so no original can be read back from a pseudonym.
    """

    def __init__(self, key: bytes, originals: set[str]):
        self.key = key
        self.originals = set(originals)
        self._tree: dict[tuple, int] = {}      # (version, original prefix) -> new part
        self._used: dict[tuple, set] = {}      # (version, new prefix) -> parts taken
        self._done: dict[str, str] = {}
        addrs = [a for a in (_parse_ip(o) for o in originals) if a is not None]
        self._first = {4: {a.packed[0] for a in addrs if a.version == 4},
                       6: {int.from_bytes(a.packed[:2], "big") for a in addrs if a.version == 6}}

    def _candidates(self, version: int, prefix: tuple, size: int):
        """Candidate values for one part, in an order fixed by the key and the prefix."""
        seed = hmac.new(self.key, repr((version, prefix)).encode(), hashlib.sha256).digest()
        start = int.from_bytes(seed[:4], "big") % size
        step = (int.from_bytes(seed[4:8], "big") % (size - 1)) | 1   # odd: visits all
        for i in range(size):
            yield (start + i * step) % size

    def _part(self, version, orig_prefix, new_prefix, value, level, size, leaf_ok):
        key = (version, orig_prefix + (value,))
        if key in self._tree:
            return self._tree[key]
        used = self._used.setdefault((version, new_prefix), set())
        for cand in self._candidates(version, orig_prefix + (value,), size):
            if cand in used:
                continue
            if level == 0 and not _first_ok(version, cand, self._first[version]):
                continue
            if leaf_ok is not None and not leaf_ok(new_prefix + (cand,)):
                continue
            used.add(cand)
            self._tree[key] = cand
            return cand
        raise RedactError("no free pseudonym left for an address prefix")

    def _map(self, version, parts, size, render):
        orig, new = (), ()
        for level, value in enumerate(parts):
            last = level == len(parts) - 1
            leaf_ok = (lambda p: not any(o in render(p) for o in self.originals)) if last else None
            new = new + (self._part(version, orig, new, value, level, size, leaf_ok),)
            orig = orig + (value,)
        return render(new)

    def pseudonym(self, text: str) -> str:
        """The pseudonym of an address given as text (kept when not an address)."""
        if text in self._done:
            return self._done[text]
        addr = _parse_ip(text)
        if addr is None or addr.is_loopback or addr.is_unspecified:
            out = text
        elif addr.version == 6 and addr.ipv4_mapped is not None:
            out = "::ffff:" + self.pseudonym(str(addr.ipv4_mapped))
        elif addr.version == 4:
            out = self._map(4, tuple(addr.packed), 256, lambda p: ".".join(map(str, p)))
        else:
            groups = tuple(int.from_bytes(addr.packed[i:i + 2], "big") for i in range(0, 16, 2))
            out = self._map(6, groups, 65536, lambda p: str(ipaddress.IPv6Address(
                b"".join(g.to_bytes(2, "big") for g in p + (0,) * (8 - len(p))))))
        self._done[text] = out
        return out


def _first_ok(version: int, value: int, originals: set[int]) -> bool:
    if value in originals:
        return False
    if version == 4:
        # not 0/8, loopback, multicast or reserved, and not ending in an original's
        # first octet as text (110 would contain 10)
        return (0 < value < 224 and value != 127 and
                not any(str(value).endswith(str(o)) for o in originals))
    return value not in (0, 0xFFFF) and not any(f"{value:x}".endswith(f"{o:x}")
                                                for o in originals)


def _parse_ip(text: str):
    try:
        return ipaddress.ip_address(text.split("%", 1)[0])
    except ValueError:
        return None


# ------------------------------------------------------------------ the redactor

@dataclass
class Redactor:
    """Text rewriting once the sensitive names, addresses and users are known."""

    names: dict[str, str]                 # host or node name -> node pseudonym
    users: set[str]
    ips: IpPseudonyms
    #: paths as the merge's user typed them (merge_log.input), relative ones too:
    #: wherever they appear, they become base names
    paths: frozenset[str] = frozenset()
    _names_re: re.Pattern | None = field(default=None, init=False)
    _users_re: re.Pattern | None = field(default=None, init=False)

    def __post_init__(self):
        # host names are case-insensitive (GPU-17 is gpu-17): matched and looked up so
        self._lower: dict[str, str] = {}
        for n, p in self.names.items():
            self._lower.setdefault(n.lower(), p)
        if self.names:
            alts = "|".join(re.escape(n) for n in sorted(self._lower, key=len, reverse=True))
            self._names_re = re.compile(rf"(?<![A-Za-z0-9])(?:{alts})(?![A-Za-z0-9])",
                                        re.IGNORECASE)
        domains = [n for n, p in self._lower.items() if p == "domain"]
        self._in_domain_re = None
        if domains:
            # any other machine in the site's domains: name.domain -> host.domain
            alts = "|".join(re.escape(d) for d in sorted(domains, key=len, reverse=True))
            self._in_domain_re = re.compile(
                rf"(?<![A-Za-z0-9.-])[A-Za-z0-9][A-Za-z0-9-]*(?:\.[A-Za-z0-9-]+)*"
                rf"\.(?:{alts})(?![A-Za-z0-9-])", re.IGNORECASE)
        if self.users:
            alts = "|".join(re.escape(u) for u in sorted(self.users, key=len, reverse=True))
            self._users_re = re.compile(rf"(?<![A-Za-z0-9])(?:{alts})(?![A-Za-z0-9])")

    def host(self, host: str) -> str:
        """A host part (name or address) -> its pseudonym, or 'host' when unknown."""
        if _parse_ip(host.strip("[]")) is not None:
            return self.ips.pseudonym(host.strip("[]"))
        low = host.lower()
        known = self._lower.get(low) or self._lower.get(low.split(".", 1)[0])
        if known:
            return known
        m = self._in_domain_re.fullmatch(host) if self._in_domain_re is not None else None
        return self._in_domain(m) if m else "host"      # another machine of the site: host.domain

    def basename(self, path: str) -> str:
        trimmed = path.rstrip("/")
        if not trimmed:
            return path
        base = trimmed.rsplit("/", 1)[-1]
        if base in self.users or (trimmed.startswith("~") and "/" not in trimmed):
            return "~"
        if trimmed == f"/{base}" and base in SYSTEM_ROOTS:
            return path
        return base

    def _url(self, m: re.Match) -> str:
        scheme, authority, rest = m.group(1), m.group(2), m.group(3)
        hostport = authority.rsplit("@", 1)[-1]
        if hostport.startswith("["):
            host, _, port = hostport[1:].partition("]")
            port = port.lstrip(":")
        else:
            host, _, port = hostport.partition(":")
            if _parse_ip(hostport) is not None:      # a bare IPv6 address
                host, port = hostport, ""
        new_host = self.host(host) if host else ""
        out = f"{scheme}://{new_host}" + (f":{port}" if port.isdigit() else "")
        base = self.basename(rest) if rest.strip("/") else ""
        return out + (f"/{base}" if base else "")

    def _in_domain(self, m: re.Match) -> str:
        """A name in one of the fleet's domains: a node's full name is left to the names
        rule; a node's first label keeps its pseudonym (NODE.domain); any other machine
        becomes host.domain."""
        name = m.group(0).lower()
        if name in self._lower:
            return m.group(0)
        label = self._lower.get(name.split(".", 1)[0])
        return f"{label if label and label != 'domain' else 'host'}.domain"

    def known_host(self, host: str) -> bool:
        return host.lower() in self._lower or _parse_ip(host) is not None

    def _user_at(self, m: re.Match) -> str:
        """user@host: a known user or host, or any host that is a name (login01); not
        a version (torch@2.1, pkg@v4), a digest (image@sha256:...), a versioned or PLT
        symbol (memcpy@GLIBC_2.14, foo@plt) or a URL (torch@https://...)."""
        user, host = m.group(1), m.group(2)
        if user == USER_WORD:
            return m.group(0)       # rewritten already (an e-mail address)
        named = _HOST_NAME.fullmatch(host) is not None and \
            not m.string.startswith("://", m.end())
        if user in self.users or self.known_host(host) or named:
            return f"{USER_WORD}@{self.host(host)}"
        return m.group(0)

    def _known_path(self, m: re.Match) -> str:
        word = m.group(0)
        path = word.rstrip(":.,")
        if path in self.paths:
            return self.basename(path) + word[len(path):]
        return word

    def text(self, s: str) -> str:
        """Free text: URLs, user@host, paths, addresses, names and users rewritten."""
        if not s:
            return s
        if self.paths and "/" in s:
            s = _SLASHED_WORD.sub(self._known_path, s)
        s = _URL.sub(self._url, s)
        s = _EMAIL.sub(lambda m: f"{USER_WORD}@{self.host(m.group(1))}", s)
        s = _USER_AT.sub(self._user_at, s)
        s = _PATH.sub(lambda m: self.basename(m.group(0)), s)
        s = _IPV4.sub(lambda m: self.ips.pseudonym(m.group(0)), s)
        s = _IPV6.sub(lambda m: self.ips.pseudonym(m.group(0))
                      if _parse_ip(m.group(0)) is not None else m.group(0), s)
        if self._in_domain_re is not None:
            s = self._in_domain_re.sub(self._in_domain, s)
        if self._names_re is not None:
            s = self._names_re.sub(lambda m: self._lower[m.group(0).lower()], s)
        if self._users_re is not None:
            s = self._users_re.sub(USER_WORD, s)
        return s

    def word(self, arg: str) -> str:
        """One command-line word: as text, then anything left with a slash to its base
        name (an option keeps its --name= part)."""
        arg = self.text(arg)
        if "/" not in arg:
            return arg
        m = re.match(r"^(-{1,2}[\w.-]+=)(.*)$", arg, re.S)
        opt, value = (m.group(1), m.group(2)) if m else ("", arg)
        if _URL.search(value):
            return arg          # text() left scheme, host pseudonym and base name
        return opt + self.basename(value)

    def _json_list(self, value: str, item, **dump) -> str:
        """A JSON array rewritten item by item; anything else as free text."""
        try:
            items = json.loads(value)
        except ValueError:
            return self.text(value)
        if not isinstance(items, list):
            return self.text(value)
        return json.dumps([item(x) for x in items], **dump)

    def cmdline(self, value: str) -> str:
        return self._json_list(value, lambda a: self.word(a) if isinstance(a, str) else a)

    def _frame(self, f):
        if not isinstance(f, dict):
            return f
        return {k: (self.basename(self.text(v)) if k in ("module", "file", "py_file")
                    else self.text(v)) if isinstance(v, str) else v for k, v in f.items()}

    def frames(self, value: str) -> str:
        return self._json_list(value, self._frame, separators=(",", ":"))

    def chrony_ref(self, value: str) -> str:
        """chrony's reference id: 8 hex digits that are an IPv4 address (or a name)."""
        if value and _HEX_IPV4.match(value):
            addr = str(ipaddress.IPv4Address(int(value, 16)))
            new = self.ips.pseudonym(addr)
            return f"{int(ipaddress.IPv4Address(new)):08X}"
        return self.text(value)


# ------------------------------------------------------------------ collecting

def _text_columns(con) -> list[tuple[str, str]]:
    """(table, column) of every TEXT column worth scanning, in schema order."""
    from ..merge.fleet_schema import FLEET_TABLES_BY_NAME  # noqa: PLC0415
    out = []
    tables = [r[0] for r in con.execute(
        "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%' "
        "ORDER BY name")]
    for t in tables:
        known = FLEET_TABLES_BY_NAME.get(t)
        enums = {c.name for c in known.columns if c.values} if known else set()
        for row in con.execute("SELECT name, type FROM pragma_table_info(?)", (t,)):
            name, typ = row
            if ((typ or "").upper() == "TEXT" and name not in SKIP_COLUMNS
                    and name not in enums and (t, name) not in SKIP_TABLE_COLUMNS):
                out.append((t, name))
    return out


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _distinct(con, table, column, where="") -> list[str]:
    return [r[0] for r in con.execute(
        f"SELECT DISTINCT {_q(column)} FROM {_q(table)} WHERE typeof({_q(column)}) = 'text'"
        + (f" AND {where}" if where else ""))]


def _collect(values, users: set, ips: set, hosts: set) -> None:
    for v in values:
        for m in _HOME.finditer(v):
            users.add(m.group(1))
        for m in _TILDE_USER.finditer(v):
            users.add(m.group(1))
        for m in _URL.finditer(v):
            auth = m.group(2)
            if "@" in auth:
                users.add(auth.rsplit("@", 1)[0].split(":", 1)[0])
        for m in _USER_AT.finditer(v):      # ssh/scp/rsync targets: user@known-host
            if m.group(2) in hosts or _parse_ip(m.group(2)) is not None:
                users.add(m.group(1))
        for m in _IPV4.finditer(v):
            if _parse_ip(m.group(0)) is not None:
                ips.add(m.group(0))
        for m in _IPV6.finditer(v):
            if _parse_ip(m.group(0)) is not None:
                ips.add(m.group(0))


def _node_names(con) -> dict[str, str]:
    """Every node name, claimed name and host name (and a host's first label and
    domain) -> the pseudonym of the first node (by node_id) that carries it."""
    names: dict[str, str] = {}
    rows = list(con.execute("SELECT node_id, name, claimed_name, hostname FROM nodes "
                            "ORDER BY node_id"))
    for node_id, *strings in rows:
        pseudo = f"{NODE_PREFIX}{node_id}"
        for s in strings:
            if not s:
                continue
            names.setdefault(s, pseudo)
            label, _, domain = s.partition(".")
            if len(label) >= 3:
                names.setdefault(label, pseudo)
            if _parse_ip(s) is not None or s.rsplit(".", 1)[-1].isdigit():
                continue    # an address or a numbered name has no DNS domain
            # the host's domain and its parents of two labels or more: other machines of
            # the site (an NTP server, a git host) are named in them
            while domain and "." in domain:
                names.setdefault(domain, "domain")
                domain = domain.partition(".")[2]
    # a pseudonym must not be another node's original name (an already redacted
    # fleet.db maps each nodeid-N to itself, which is fine)
    clash = sorted(n for n, p in names.items()
                   if n != p and (n in names.values() or n.startswith(NODE_PREFIX)))
    if clash:
        raise RedactError(f"node name {clash[0]!r} has the form of the pseudonyms "
                          f"({NODE_PREFIX}N) but is not that node's; cannot tell them apart")
    return names


# ------------------------------------------------------------------ the copy

@dataclass
class RedactResult:
    output: str
    nodes: int
    addresses: int
    users: int
    columns_rewritten: dict[str, int]      # "table.column" -> distinct values changed
    elapsed_s: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def private_dir(near: Path, prefix: str) -> str:
    """A private temporary directory beside ``near`` (on the site's side: the unredacted
    source's own directory), else in the system's temporary directory."""
    for parent in (near.parent, None):
        try:
            return tempfile.mkdtemp(prefix=prefix, dir=parent)
        except OSError as e:
            if parent is None:
                raise RedactError(f"{tempfile.gettempdir()}: cannot create a temporary "
                                  f"directory: {e.strerror or e}") from None
    raise AssertionError("unreachable")


@contextlib.contextmanager
def scratch_dir(near: Path, prefix: str):
    """private_dir(), removed with what it holds when the block ends: made and put in
    the way of removal with SIGINT held, and removed so, so that a Ctrl-C never leaves
    it behind (it may hold the unredacted working copy)."""
    with contextlib.ExitStack() as stack:
        made = []

        def make():
            if not made:
                made.append(private_dir(near, prefix))
                stack.callback(run_held, lambda: shutil.rmtree(made[0], ignore_errors=True))
        run_held(make)
        yield made[0]


def redact_fleet(src, dest, *, key: bytes | None = None) -> RedactResult:
    """Write a redacted copy of the fleet.db src to dest (replaced atomically).

    The unredacted working copy is made beside src (or in the system's temporary
    directory), never beside dest: dest may be the medium that leaves the site, and
    nothing but redacted pages may ever be written there."""
    t0 = time.monotonic()
    shown = str(dest)
    src, dest = Path(src), Path(dest)
    check_fleet_file(src, RedactError)
    if shown == "-":
        raise BadOutput("-o -: the redacted copy is a database file, not a stream; "
                               "give it a file name (-o redacted.db)")
    if not dest.name or shown.endswith(os.sep) or dest.is_dir():
        raise RedactError(f"{shown or repr(shown)}: -o needs a file name, not a directory")
    if dest.exists() and os.path.samefile(src, dest):
        raise OutputIsInput(f"{dest}: the output would replace the input; choose another -o")
    kind = evidence_kind(dest)
    if kind == "a bundle" or (kind == "a fleet.db" and not _is_redacted(dest)):
        # an earlier redacted copy is replaced; evidence never is
        raise BadOutput(f"{dest}: is {kind}" + (" that is not redacted" if kind ==
                                                     "a fleet.db" else "")
                            + "; refusing to replace it with a redacted copy (remove it "
                            "first, or choose another -o)")
    if not dest.parent.is_dir():
        raise RedactError(f"{dest}: directory {dest.parent} does not exist")
    try:
        source = connect_readonly(src)
    except apsw.Error as e:
        raise RedactError(f"{src}: cannot read fleet.db ({e})") from None
    tmp_out = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with contextlib.closing(source), \
                scratch_dir(src, ".ingero-redact-work-") as work_dir:
            res = _write_redacted(source, src, dest, Path(work_dir), tmp_out, key)
        # the working copy is gone: the output goes in place last, so that nothing is
        # left to do (and no Ctrl-C to report) once it is there
        os.replace(tmp_out, dest)
    except BaseException:
        # VACUUM INTO keeps a journal beside its target while it writes
        run_held(lambda: [p.unlink(missing_ok=True)
                          for p in (tmp_out, tmp_out.with_name(tmp_out.name + "-journal"))])
        raise
    res.output = str(dest)
    res.elapsed_s = round(time.monotonic() - t0, 3)
    return res


def _is_redacted(path) -> bool:
    """Whether the fleet.db at path is one ingero-redact wrote (fleet_info 'redacted')."""
    try:
        con = connect_readonly(path)
    except apsw.Error:
        return False
    try:
        return con.execute("SELECT 1 FROM fleet_info WHERE key = 'redacted'").fetchone() \
            is not None
    except apsw.Error:
        return False
    finally:
        con.close()


def _write_redacted(source, src, dest, work_dir: Path, tmp_out: Path, key) -> RedactResult:
    """The working copy of source in work_dir, redacted, VACUUMed INTO tmp_out (which
    the caller moves to dest)."""
    work = work_dir / "unredacted-working-copy.db"
    try:
        con = apsw.Connection(str(work))
        with con.backup("main", source, "main") as b:
            b.step()
    except apsw.Error as e:
        raise RedactError(f"{work_dir}: cannot write the working copy of {src} "
                          f"({sqlite_message(e)}; it is made beside the source, or in "
                          "TMPDIR when that directory is not writable)") from None
    try:
        # a damaged schema page of the source fails the first statement on the copy
        con.execute("PRAGMA journal_mode = OFF")
        con.execute("PRAGMA synchronous = OFF")
        res = _redact(con, key or secrets.token_bytes(32))
    except RedactError as e:
        con.close()
        raise RedactError(f"{src}: {e}") from None
    except _DAMAGED as e:
        # a damaged page of the source (the backup copies pages as they are)
        con.close()
        raise RedactError(f"{src}: cannot read fleet.db ({sqlite_message(e)})") from None
    except apsw.FullError:
        con.close()
        raise RedactError(f"{dest}: file system full") from None
    con.execute("INSERT OR REPLACE INTO fleet_info (key, value) VALUES ('redacted', ?)",
                (json.dumps({"tool": f"ingero-redact {__version__}",
                             "utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}),))
    tmp_out.unlink(missing_ok=True)
    try:
        con.execute("VACUUM INTO ?", (str(tmp_out),))
    except apsw.FullError:
        con.close()
        raise RedactError(f"{dest}: file system full") from None
    except _DAMAGED as e:
        con.close()
        raise RedactError(f"{src}: cannot read fleet.db ({sqlite_message(e)})") from None
    con.close()
    with open(tmp_out, "rb+") as f:
        os.fsync(f.fileno())
    return res


def _redact(con, key: bytes) -> RedactResult:
    names = _node_names(con)
    columns = _text_columns(con)
    users, ips = set(), set()
    distinct = {}
    for t, c in columns:
        distinct[(t, c)] = _distinct(con, t, c)
        _collect(distinct[(t, c)], users, ips, set(names))
    users -= {"root", USER_WORD}
    for table in ("tcp_events", "tcp_progress"):
        if _has(con, table):
            for col in ("saddr", "daddr"):
                ips.update(v for v in _distinct(con, table, col) if _parse_ip(v))
    chrony = []
    if _has(con, "clock_samples"):
        chrony = _distinct(con, "clock_samples", "device", "source = 'chrony'")
        ips.update(str(ipaddress.IPv4Address(int(v, 16))) for v in chrony
                   if _HEX_IPV4.match(v))
    inputs = frozenset(_distinct(con, "merge_log", "input")) if _has(con, "merge_log") \
        else frozenset()
    r = Redactor(names, users, IpPseudonyms(key, ips), inputs)
    changed: dict[str, int] = {}

    def path(v):
        return r.basename(r.text(v))

    special = {("processes", "cmdline"): r.cmdline, ("stacks", "frames"): r.frames,
               ("processes", "exe"): path, ("merge_log", "input"): path}
    with con:
        # nodes first, by id: the names are what every other rewrite refers to
        for node_id, in list(con.execute("SELECT node_id FROM nodes")):
            con.execute("UPDATE nodes SET name = ? WHERE node_id = ?",
                        (f"{NODE_PREFIX}{node_id}", node_id))
        for t, c in columns:
            if t == "nodes" and c == "name":
                continue
            fn = special.get((t, c), r.text)
            mapping = {v: fn(v) for v in distinct[(t, c)]}
            n = _apply(con, t, c, {k: v for k, v in mapping.items() if k != v})
            if n:
                changed[f"{t}.{c}"] = n
        if chrony:
            n = _apply(con, "clock_samples", "device",
                       {v: r.chrony_ref(v) for v in chrony if r.chrony_ref(v) != v},
                       "source = 'chrony'")
            if n:
                changed["clock_samples.device"] = changed.get("clock_samples.device", 0) + n
    return RedactResult(output="", nodes=len(set(names.values()) - {"domain"}),
                        addresses=len(ips), users=len(users), columns_rewritten=changed,
                        elapsed_s=0.0)


def _has(con, table: str) -> bool:
    return con.execute("SELECT 1 FROM sqlite_schema WHERE type = 'table' AND name = ?",
                       (table,)).fetchone() is not None


def _apply(con, table: str, column: str, mapping: dict, where: str = "") -> int:
    """Replace the values of one column by a mapping, in one pass over the table."""
    if not mapping:
        return 0
    con.execute("CREATE TEMP TABLE IF NOT EXISTS redact_map (old TEXT PRIMARY KEY, new TEXT)")
    con.execute("DELETE FROM temp.redact_map")
    con.executemany("INSERT INTO temp.redact_map VALUES (?, ?)", mapping.items())
    t, c = _q(table), _q(column)
    con.execute(f"UPDATE {t} SET {c} = (SELECT new FROM temp.redact_map WHERE old = {t}.{c}) "
                f"WHERE {c} IN (SELECT old FROM temp.redact_map)" +
                (f" AND {where}" if where else ""))
    return len(mapping)


@contextlib.contextmanager
def redacted_input(src, enabled: bool = True):
    """``--redact`` on ingero-report and ingero-export: yield the path of a redacted copy
    of src (``redacted-fleet.db`` in a private temporary directory beside src, or in the
    system's), removed afterwards; with enabled False, src itself."""
    if not enabled:
        yield src
        return
    with scratch_dir(Path(src), ".ingero-redact-") as d:
        out = Path(d) / "redacted-fleet.db"
        redact_fleet(src, out)
        yield out


__all__ = ["IpPseudonyms", "RedactError", "RedactResult", "Redactor", "redact_fleet",
           "redacted_input"]
