"""fastckpt's fsspec face against fsspec's own abstract test suite (the copy / get / put / open / pipe classes that
s3fs and gcsfs run), on the local filesystem and on moto; and what fastckpt adds there (engine transfers, atomic
writes, chained URLs)."""

from __future__ import annotations

import os
import uuid

import pytest

fsspec = pytest.importorskip("fsspec")
import fsspec.tests.abstract as abstract  # noqa: E402

from fastckpt.fsspec import FastckptFileSystem  # noqa: E402

from ..servers.s3 import BUCKET  # noqa: E402


class Fixtures(abstract.AbstractFixtures):
    @pytest.fixture(params=["local", "s3"])
    def where(self, request: pytest.FixtureRequest) -> str:
        return request.param

    @pytest.fixture
    def fs(self, where: str, request: pytest.FixtureRequest) -> FastckptFileSystem:
        if where == "s3":
            server = request.getfixturevalue("moto_server")
            return FastckptFileSystem(endpoint_override=server.endpoint)
        return FastckptFileSystem()

    @pytest.fixture
    def fs_join(self):
        return lambda *parts: "/".join([p.rstrip("/") for p in parts[:-1]] + [parts[-1]])

    @pytest.fixture
    def fs_path(self, where: str, tmp_path_factory: pytest.TempPathFactory) -> str:
        if where == "s3":
            return f"s3://{BUCKET}/fsspec-{uuid.uuid4().hex[:8]}"
        return str(tmp_path_factory.mktemp("fsspec"))

    @pytest.fixture
    def supports_empty_directories(self, where: str) -> bool:
        return where == "local"


class TestCopy(abstract.AbstractCopyTests, Fixtures):
    pass


class TestGet(abstract.AbstractGetTests, Fixtures):
    pass


class TestPut(abstract.AbstractPutTests, Fixtures):
    pass


class TestOpen(abstract.AbstractOpenTests, Fixtures):
    pass


class TestPipe(abstract.AbstractPipeTests, Fixtures):
    pass


def test_registered_for_fastckpt_urls_only() -> None:
    """``fastckpt`` comes from the package's entry point; ``s3://`` stays whatever fsspec maps it to."""
    assert fsspec.get_filesystem_class("fastckpt") is FastckptFileSystem
    try:
        assert fsspec.get_filesystem_class("s3") is not FastckptFileSystem
    except ImportError:  # s3fs not installed: fsspec says so, fastckpt does not step in
        pass


def test_urls_writes_and_engine_transfers(moto_server, tmp_path) -> None:
    """A ``fastckpt://`` URL opens through ``fsspec.open``; a write whose ``with`` block raises leaves no object;
    ``put`` / ``get`` go through the engine (a multi-part file, its digest checked on the way back)."""
    opts = {"endpoint_override": moto_server.endpoint}
    base = f"s3://{BUCKET}/face-{uuid.uuid4().hex[:8]}"
    with fsspec.open(f"fastckpt://{base}/a.txt", "wb", **opts) as f:
        f.write(b"hello")
    with fsspec.open(f"fastckpt://{base}/a.txt", "rb", **opts) as f:
        assert f.read() == b"hello"
    fs = fsspec.filesystem("fastckpt", **opts)
    with pytest.raises(RuntimeError), fs.open(f"{base}/b.txt", "wb") as f:
        f.write(b"partial")
        raise RuntimeError("the writer fails")
    assert not fs.exists(f"{base}/b.txt")
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(20 << 20))
    fs.put(str(big), f"{base}/big.bin")
    assert fs.info(f"{base}/big.bin")["size"] == 20 << 20
    fs.get(f"{base}/big.bin", str(tmp_path / "back.bin"))
    assert (tmp_path / "back.bin").read_bytes() == big.read_bytes()
    with fs.open(f"{base}/big.bin", "rb") as f:
        f.seek(5 << 20)
        assert f.read(100) == big.read_bytes()[5 << 20:(5 << 20) + 100]
    assert sorted(fs.find(base)) == [f"{base}/a.txt", f"{base}/big.bin"]
    fs.rm(base, recursive=True)
    assert not fs.exists(base)


def test_chained_url_of_a_local_file(tmp_path) -> None:
    """``fastckpt::file://...``: fsspec builds fastckpt's filesystem for the chain and hands it the path."""
    url = f"fastckpt::file://{tmp_path}/model/a.bin"
    with fsspec.open(url, "wb") as f:
        f.write(b"chained")
    assert isinstance(fsspec.core.url_to_fs(url)[0], FastckptFileSystem)
    assert (tmp_path / "model" / "a.bin").read_bytes() == b"chained"
    with fsspec.open(url, "rb") as f:
        assert f.read() == b"chained"


def test_chained_s3_url(moto_server) -> None:
    """``fastckpt::s3://bucket/key``: fsspec asks s3fs to parse the inner path, so this form needs s3fs installed;
    its ``endpoint_url`` option reaches fastckpt as ``endpoint_override``."""
    pytest.importorskip("s3fs")
    url, opts = f"fastckpt::s3://{BUCKET}/chain-{uuid.uuid4().hex[:8]}/a.bin", {"s3": {"endpoint_url":
                                                                                       moto_server.endpoint}}
    with fsspec.open(url, "wb", **opts) as f:
        f.write(b"chained")
    with fsspec.open(url, "rb", **opts) as f:
        assert f.read() == b"chained"


def test_a_stored_file_changed_in_place_fails_every_read(tmp_path) -> None:
    """``get``, ``cat`` and ``open().read()`` of a local file edited after fastckpt wrote it raise IntegrityError
    naming it (its digests stay recorded, for the version fastckpt wrote), as ``fastckpt.download`` does."""
    import fastckpt
    from fastckpt import IntegrityError

    fs = FastckptFileSystem()
    src, store = tmp_path / "src", tmp_path / "store"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(3 << 20))
    fs.put(str(src / "big.bin"), str(store / "big.bin"))
    with open(store / "big.bin", "r+b") as f:
        f.seek(1 << 20)
        byte = f.read(1)
        f.seek(1 << 20)
        f.write(bytes([byte[0] ^ 1]))
    for read in (lambda: fs.get(str(store / "big.bin"), str(tmp_path / "out.bin")),
                 lambda: fs.cat_file(str(store / "big.bin")),
                 lambda: fs.open(str(store / "big.bin"), "rb").read(),
                 lambda: fastckpt.download(str(store), str(tmp_path / "out"))):
        with pytest.raises(IntegrityError, match=r"big\.bin.*changed after it was written"):
            read()
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out" / "big.bin").exists()
