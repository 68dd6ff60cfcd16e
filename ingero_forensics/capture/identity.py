"""Who is capturing: the node name and the host facts every segment's manifest carries.

Nothing here touches the network: the hostname comes from /proc/sys/kernel/hostname
(os.uname() as a fallback), never from a resolver.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Mapping

from .. import __version__
from ..bundle.container import NODE_NAME_RE, NODE_NAME_RULE
from ..errors import IngeroError

DEFAULT_CONFIG = Path("/etc/ingero-forensics/config.toml")
NODE_ENV = "INGERO_NODE"


class ConfigError(IngeroError):
    """The capture configuration (options or config file) is unusable."""


def read_hostname() -> str:
    try:
        return Path("/proc/sys/kernel/hostname").read_text().strip()
    except OSError:
        return os.uname().nodename


def read_config(path) -> dict:
    """Parse the capture config file (TOML). Raises ConfigError naming the file.

    Python 3.11+ parses it with tomllib. On 3.10 (no tomllib) only top-level
    ``key = "string"`` lines are understood, which covers the keys the capture reads.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file: {e.strerror or e}") from None
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        return _parse_simple_toml(path, raw)
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


_SIMPLE_LINE = re.compile(r'^\s*([A-Za-z0-9_-]+)\s*=\s*"([^"\\]*)"\s*(?:#.*)?$')


def _parse_simple_toml(path, raw: bytes) -> dict:
    out: dict = {}
    for line in raw.decode("utf-8", "replace").splitlines():
        if line.lstrip().startswith("["):
            break  # a table: the top-level keys are over
        m = _SIMPLE_LINE.match(line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


def resolve_node_name(cli: str | None, config_file=None, env: Mapping[str, str] | None = None,
                      hostname: str | None = None, *,
                      default_config: Path = DEFAULT_CONFIG) -> tuple[str, str]:
    """Pick the node name: ``--node`` > config file > $INGERO_NODE > hostname.

    config_file is ``--config`` (must exist); when None, ``default_config`` is read if
    present. Returns (name, origin) where origin says which of the four gave it.
    Raises ConfigError for an invalid name, naming where it came from.
    """
    env = os.environ if env is None else env
    candidates: list[tuple[str | None, str]] = [(cli, "--node")]
    cfg_path = Path(config_file) if config_file is not None else (
        default_config if default_config.exists() else None)
    if cfg_path is not None:
        node = read_config(cfg_path).get("node")
        if node is not None and not isinstance(node, str):
            raise ConfigError(f"{cfg_path}: 'node' must be a string")
        candidates.append((node, f"config file {cfg_path}"))
    candidates.append((env.get(NODE_ENV), NODE_ENV))
    candidates.append((hostname if hostname is not None else read_hostname(), "hostname"))
    for value, origin in candidates:
        if value is None or (origin != "--node" and value == ""):
            continue
        if not NODE_NAME_RE.match(value):
            raise ConfigError(f"invalid node name {value!r} (from {origin}): use "
                              f"{NODE_NAME_RULE}")
        return value, origin
    raise ConfigError("no node name: pass --node NAME")  # hostname is never absent


def read_boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def host_facts() -> dict:
    """The manifest's host object: hostname, boot_id, kernel_release, machine, tool_version."""
    u = os.uname()
    return {"hostname": read_hostname(), "boot_id": read_boot_id(),
            "kernel_release": u.release, "machine": u.machine, "tool_version": __version__}
