"""Configuration: transfer settings with environment overrides (``FASTCKPT_PART_SIZE=64MiB`` and so on), and every
process-wide setting read from the environment (a backend's own variables are read by its options object).
One rule parses a boolean everywhere: ``parse_bool``."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from urllib.parse import SplitResult, urlsplit
from urllib.request import getproxies_environment, proxy_bypass_environment

__all__ = ["FALSE_WORDS", "TRUE_WORDS", "TransferConfig", "default_state_dir", "env_flag", "env_seconds", "parse_bool",
           "parse_size", "proxy_for"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
          "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def parse_bool(text: str, what: str) -> bool:
    """``true``/``false``, ``1``/``0``, ``yes``/``no``, ``on``/``off`` (any case); ValueError naming ``what``
    for anything else."""
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError(f"invalid {what}={text!r} is not a boolean (use true or false)")


def environment() -> Mapping[str, str]:
    """The process environment, read when asked: outside this module, the command line and the clouds' option
    modules, fastckpt reads its environment only through here."""
    return os.environ


def env_count(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    """A whole number of 1 or more in environment variable ``name``; ``default`` when it is unset or blank;
    ValueError naming the variable otherwise."""
    text = (os.environ if env is None else env).get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"invalid {name}={text!r}: expected a whole number >= 1")
    return int(text)


def env_flag(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """Boolean environment variable ``name``; ``default`` when it is unset or blank."""
    text = (os.environ if env is None else env).get(name, "")
    return parse_bool(text, name) if text.strip() else default


def env_seconds(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """Seconds in environment variable ``name``, read when asked (not at import); ``default`` when it is unset or
    blank; ValueError naming the variable otherwise (``inf`` allowed)."""
    text = (os.environ if env is None else env).get(name, "").strip()
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"invalid {name}={text!r}: expected a number of seconds >= 0")
    return seconds


def default_state_dir(env: Mapping[str, str] | None = None) -> str:
    """Where fastckpt keeps its state (upload journals): ``$FASTCKPT_STATE_DIR``, else ``$XDG_CACHE_HOME/fastckpt``,
    else ``~/.cache/fastckpt``."""
    env = os.environ if env is None else env
    return env.get("FASTCKPT_STATE_DIR") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "fastckpt")


def proxy_for(scheme: str, host: str) -> SplitResult | None:
    """The proxy ``HTTPS_PROXY`` / ``HTTP_PROXY`` name for ``scheme``, unless ``NO_PROXY`` exempts ``host``
    (the environment variables botocore, requests and curl read)."""
    proxies = getproxies_environment()
    url = proxies.get(scheme)
    if not url or proxy_bypass_environment(host, proxies):
        return None
    return urlsplit(url if "://" in url else f"http://{url}")


def parse_size(text: str | int) -> int:
    """Parse ``64MiB``, ``8m``, ``1.5GiB`` or a plain integer into bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", text)
    if not match or match[2].lower() not in _UNITS:
        raise ValueError(f"invalid size {text!r}: expected e.g. 64MiB, 512k, 1GiB")
    return int(float(match[1]) * _UNITS[match[2].lower()])


@dataclass(frozen=True)
class TransferConfig:
    """How transfers are split, bounded and retried.

    Requests in flight and memory are bounded apart. Each endpoint's requests in flight size themselves to its
    link (``stores.concurrency``: they grow while requests keep their speed and stop where the link is full; a
    throttled answer lowers them), up to ``max_in_flight``. The buffers one transfer (or one stream) holds stay
    within ``memory_limit``, whatever the concurrency and the size of the data moved.
    """

    part_size: int = 16 << 20
    """Bytes per multipart part and per hashed chunk (scaled up when a backend's part limit needs it). 16 MiB: on a
    link of ~16 MB/s per connection, a part takes a second, so the last parts of a transfer leave little of the link
    idle (1 GiB over an emulated 240 MB/s link: 0.88 of it with 16 MiB parts, 0.78 with 32 MiB)."""
    max_in_flight: int = 256
    """At most this many requests carrying data in flight per transfer (an upper bound: the operating point is
    each endpoint's adaptive limit). ``8`` caps a transfer at 8 connections' worth of link."""
    memory_limit: int = 1 << 30
    """Bytes of buffers one transfer holds at most (parts read into memory, receive rings, small files)."""
    target_throughput: int = 0
    """Bytes per second the link is expected to carry (0: 10 Gb/s): an endpoint's first requests in flight are
    this over ``CONNECTION_RATE``, from where its limit adapts."""
    range_size: int = 0
    """Bytes per ranged read of a download (0: the files coming down cut into about as many ranges as requests
    start in flight, from ``part_size`` to 128 MiB; a multiple of the recorded chunk size). Long ranges cost servers
    less; an interrupted download resumes range by range."""
    max_open_files: int = 256
    """Files being transferred at once (small files are many: on a link of tens of ms, each file in flight is a
    request in flight)."""
    multipart_threshold: int = 16 << 20
    """Files larger than this are sent as parallel multipart uploads."""
    retries: int = 6
    """Attempts after the first for a retryable error (at least; see ``retry_for``)."""
    retry_for: float = 120.0
    """Seconds a retryable failure keeps being retried, however many attempts that takes: an endpoint
    outage, failover or throttling burst shorter than this does not fail the transfer (0: ``retries`` only)."""
    backoff_base: float = 0.2
    """First backoff in seconds; doubles each retry, with full jitter."""
    backoff_max: float = 10.0
    """Longest single backoff in seconds."""
    stall_timeout: float = 60.0
    """A request carrying data (a part sent or read) that has not finished within ``stall_timeout`` plus
    its size at ``min_rate`` is cancelled and retried: a server or middlebox that stops reading or
    sending mid-body cannot hold a transfer."""
    min_rate: int = 1 << 20
    """Bytes per second per request below which a data request counts as stalled (0: no deadline)."""
    resume: bool = True
    """Keep journals so that a killed or interrupted multipart transfer, run again with the same arguments,
    continues where it stopped (``engine.journal``); parts already stored are re-checked before use."""
    state_dir: str = ""
    """Where fastckpt keeps its state, upload journals below it (default: ``default_state_dir()``)."""
    verify: bool = True
    """Check digests on download when the object records one."""
    digest_metadata: bool = True
    """Store the file digest as object metadata (may need a hashing pass before an S3 multipart upload)."""
    fsync: bool | None = None
    """fsync before a written file becomes visible. None (the default): writes to a local or NFS *store* (a
    checkpoint's home) are fsynced, downloads to a local path are not (the object store keeps the data, as with
    s5cmd, the AWS CLI, gsutil and pyarrow; a rerun re-checks what it finds); True: both (durable downloads);
    False: neither."""

    @property
    def stream_memory(self) -> int:
        """Bytes of buffers one stream (a file open for writing or reading through a face) holds at most: a quarter
        of ``memory_limit``, so that a few open at once stay within it."""
        return max(self.part_size, self.memory_limit // 4)

    @property
    def store_fsync(self) -> bool:
        """Whether the local store fsyncs what it writes."""
        return self.fsync is not False

    @property
    def download_fsync(self) -> bool:
        """Whether a download fsyncs a file before its rename."""
        return self.fsync is True

    @property
    def journal_dir(self) -> str:
        """Where upload journals are kept."""
        return os.path.join(self.state_dir or default_state_dir(), "uploads")

    @classmethod
    def from_env(cls, **overrides: object) -> TransferConfig:
        """Defaults, then ``FASTCKPT_<FIELD>`` environment variables, then ``overrides``."""
        values: dict[str, object] = {}
        for f in fields(cls):
            env = os.environ.get(f"FASTCKPT_{f.name.upper()}")
            if env is not None:
                values[f.name] = _convert(f.name, f.type, env)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return replace(cls(), **values)


def _convert(name: str, type_name: object, text: str) -> object:
    kind = str(type_name)
    try:
        if kind in ("bool", "bool | None"):
            return parse_bool(text, f"FASTCKPT_{name.upper()}")
        if kind == "float":
            return float(text)
        if name in ("part_size", "range_size", "multipart_threshold", "min_rate", "memory_limit",
                    "target_throughput"):
            return parse_size(text)
        if kind == "str":
            return text
        return int(text)
    except ValueError:
        raise ValueError(f"invalid value {text!r} for FASTCKPT_{name.upper()}") from None
