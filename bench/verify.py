"""Check every engine's result before its time counts: file set, sizes and sampled content hashes.

A run that "succeeds" but leaves files missing, short or wrong (pyarrow's ``copy_files`` returns normally
after HTTP 411 errors, for instance) is reported as failed, never timed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import xxhash

from fastckpt.stores.s3 import RECORD_DIR

SAMPLE = 1 << 20


@dataclass(frozen=True)
class Entry:
    """Expected size and sampled digest of one file."""

    size: int
    sample: str


Manifest = dict[str, Entry]


def _ranges(size: int) -> list[tuple[int, int]]:
    if size <= 3 * SAMPLE:
        return [(0, size)]
    return [(0, SAMPLE), (size // 2 - SAMPLE // 2, SAMPLE), (size - SAMPLE, SAMPLE)]


def sample_digest(size: int, read_range: Callable[[int, int], bytes]) -> str:
    """XXH3-128 over the first, middle and last MiB of an object (all of it when small)."""
    h = xxhash.xxh3_128()
    for offset, length in _ranges(size):
        data = read_range(offset, length)
        if len(data) != length:
            return f"short read at {offset}"
        h.update(data)
    return h.hexdigest()


def _file_reader(path: str) -> Callable[[int, int], bytes]:
    def read(offset: int, length: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(length)
    return read


def is_record(rel: str) -> bool:
    """Whether ``rel`` is one of fastckpt's records of an S3 object's digest (``stores.s3``)."""
    return f"/{RECORD_DIR}/" in f"/{rel}"


def local_files(root: str) -> dict[str, str]:
    """Relative '/'-path -> path of every file below ``root``."""
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            out[os.path.relpath(path, root).replace(os.sep, "/")] = path
    return out


def scan(root: str) -> Manifest:
    """The manifest of a local directory."""
    out = {}
    for rel, path in sorted(local_files(root).items()):
        size = os.path.getsize(path)
        out[rel] = Entry(size, sample_digest(size, _file_reader(path)))
    return out


def compare(expected: Manifest, sizes: dict[str, int], read: Callable[[str, int, int], bytes]) -> list[str]:
    """Problems of a result whose files have ``sizes``; ``read(rel, offset, length)`` reads its content."""
    problems = []
    missing = sorted(set(expected) - set(sizes))
    extra = sorted(set(sizes) - set(expected))
    if missing:
        problems.append(f"{len(missing)} of {len(expected)} files missing, e.g. {missing[:3]}")
    if extra:
        problems.append(f"{len(extra)} unexpected files, e.g. {extra[:3]}")
    for rel in sorted(set(expected) & set(sizes)):
        want = expected[rel]
        if sizes[rel] != want.size:
            problems.append(f"{rel}: size {sizes[rel]}, expected {want.size}")
        elif sample_digest(want.size, lambda o, n, rel=rel: read(rel, o, n)) != want.sample:
            problems.append(f"{rel}: content differs (sampled hash)")
    return problems


def verify_dir(expected: Manifest, root: str) -> list[str]:
    """Problems of a local directory against ``expected`` (empty when it matches)."""
    if not os.path.isdir(root):
        return [f"{root} does not exist"]
    files = local_files(root)
    sizes = {rel: os.path.getsize(path) for rel, path in files.items()}
    sizes = {rel: n for rel, n in sizes.items() if not (n == 0 and is_record(rel))}  # a peer's copy of them
    return compare(expected, sizes, lambda rel, o, n: _file_reader(files[rel])(o, n))


def verify_s3(expected: Manifest, client: object, bucket: str, prefix: str) -> list[str]:
    """Problems of the objects below ``prefix`` (a boto3 S3 client lists and range-reads them)."""
    prefix = prefix.strip("/") + "/"
    sizes = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):  # type: ignore[attr-defined]
        for obj in page.get("Contents", []):
            rel = obj["Key"][len(prefix):]
            if obj["Size"] == 0 and (rel == "" or rel.endswith("/") or is_record(rel)):
                continue  # directory markers (pyarrow), fastckpt's records of S3 objects' digests
            sizes[rel] = obj["Size"]

    def read(rel: str, offset: int, length: int) -> bytes:
        if length == 0:
            return b""
        resp = client.get_object(Bucket=bucket, Key=prefix + rel,  # type: ignore[attr-defined]
                                 Range=f"bytes={offset}-{offset + length - 1}")
        return resp["Body"].read()

    return compare(expected, sizes, read)


def verify_torch(expected: Manifest, src: str, root: str) -> list[str]:
    """Problems of a ``torch.save`` result: every safetensors shard of ``src`` saved as ``.pt`` with the same
    tensor names (first and last tensors compared bytewise), every other file copied as is."""
    import torch
    from safetensors import safe_open

    if not os.path.isdir(root):
        return [f"{root} does not exist"]
    files = local_files(root)
    plain = {rel: e for rel, e in expected.items() if not rel.endswith(".safetensors")}
    saved = {rel.removesuffix(".safetensors") + ".pt" for rel in expected if rel not in plain}
    sizes = {rel: os.path.getsize(path) for rel, path in files.items() if rel not in saved}
    problems = compare(plain, sizes, lambda rel, o, n: _file_reader(files[rel])(o, n))
    for rel in sorted(set(expected) - set(plain)):
        pt = rel.removesuffix(".safetensors") + ".pt"
        if pt not in files:
            problems.append(f"{pt} missing")
            continue
        loaded = torch.load(files[pt], mmap=True, weights_only=True)
        with safe_open(os.path.join(src, *rel.split("/")), framework="pt") as handle:
            names = list(handle.keys())
            if set(names) != set(loaded):
                problems.append(f"{pt}: tensor names differ from {rel}")
                continue
            for name in {names[0], names[-1]}:
                if not torch.equal(loaded[name].reshape(-1).view(torch.uint8),
                                   handle.get_tensor(name).reshape(-1).view(torch.uint8)):
                    problems.append(f"{pt}: tensor {name} differs from {rel}")
    return problems
