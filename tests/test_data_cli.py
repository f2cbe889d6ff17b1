"""`p4bench data ...` offline: info, download (network monkeypatched away), partition."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from test_data_loaders import make_cifar10

from p4bench.cli import main
from p4bench.data import download as download_module
from p4bench.data.download import DOWNLOADS, DownloadSpec, Resource
from p4bench.host.manager import reset_default


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("P4BENCH_DISABLE_PLUGIN_AUTOLOAD", "1")
    monkeypatch.setenv("P4BENCH_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.delenv("P4BENCH_CACHE_DIR", raising=False)
    reset_default()
    yield
    reset_default()


@pytest.fixture
def offline(monkeypatch):
    calls = []

    def refuse(request, *args, **kwargs):
        calls.append(request.full_url if hasattr(request, "full_url") else request)
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(urllib.request, "urlopen", refuse)
    return calls


def cli(*args: str) -> int:
    try:
        main(list(args))
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0


def error_lines(captured) -> list[str]:
    return [line for line in captured.err.splitlines() if line.strip()]


def test_info_lists_datasets(capsys, tmp_path):
    assert cli("data", "info", "--json") == 0
    report = json.loads(capsys.readouterr().out)
    rows = {row["name"]: row for row in report["datasets"]}
    assert report["data_dir"] == str(tmp_path / "data")
    assert {
        "digits",
        "cifar10",
        "cifar100",
        "mnist",
        "femnist",
        "leaf-femnist",
        "synthetic",
    } <= set(rows)
    assert rows["cifar10"]["present"] is False
    assert rows["cifar10"]["path"] == str(tmp_path / "data" / "cifar-10-batches-py")
    assert rows["digits"]["present"] is True and rows["digits"]["path"] is None
    make_cifar10(tmp_path / "data")
    assert cli("data", "info") == 0
    out = capsys.readouterr().out
    assert "cifar10" in out and "present" in out and "missing" in out


def test_download_offline_fails_with_one_line(capsys, offline, tmp_path):
    assert cli("data", "download", "cifar10") == 2
    lines = error_lines(capsys.readouterr())
    assert len(lines) == 1, lines
    line = lines[0]
    assert "cannot download cifar10" in line and "cifar-10-python.tar.gz" in line
    assert str(tmp_path / "data" / "downloads") in line  # where to place the archive
    assert offline == ["https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"]


def test_download_other_names(capsys, offline, tmp_path):
    assert cli("data", "download", "digits") == 0
    assert "nothing to download" in capsys.readouterr().err
    assert cli("data", "download", "leaf-femnist") == 2
    lines = error_lines(capsys.readouterr())
    assert (
        len(lines) == 1
        and "preprocess.sh" in lines[0]
        and str(tmp_path / "data" / "leaf-femnist") in lines[0]
    )
    assert cli("data", "download", "imagenet") == 2
    assert "unknown downloadable dataset 'imagenet'" in capsys.readouterr().err
    assert cli("data", "download", "mnist", "--data-dir", str(tmp_path / "elsewhere")) == 2
    assert str(tmp_path / "elsewhere" / "downloads") in capsys.readouterr().err
    assert len(offline) == 2 and all(
        u.endswith("/train-images-idx3-ubyte.gz") for u in offline
    )  # both mirrors


class FakeResponse(io.BytesIO):
    def __init__(self, body: bytes, status: int, length: int | None = None) -> None:
        super().__init__(body)
        self.status = status
        self.headers = {"Content-Length": str(len(body) if length is None else length)}

    def getcode(self) -> int:
        return self.status


def cifar_archive(tmp_path: Path) -> bytes:
    source = tmp_path / "source"
    make_cifar10(source)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        tar.add(source / "cifar-10-batches-py", arcname="cifar-10-batches-py")
    return buffer.getvalue()


def test_download_resumes_verifies_and_unpacks(monkeypatch, tmp_path, capsys):
    blob = cifar_archive(tmp_path)
    url = "https://example.invalid/cifar-10-python.tar.gz"
    resource = Resource("cifar-10-python.tar.gz", (url,), hashlib.md5(blob).hexdigest())
    monkeypatch.setitem(DOWNLOADS, "cifar10", DownloadSpec("cifar10", (resource,), "tar", "x"))
    requests = []

    def serve(request, *args, **kwargs):
        requests.append(request.get_header("Range"))
        if len(requests) == 1:  # the connection drops after the first half
            return FakeResponse(blob[: len(blob) // 2], 200, length=len(blob))
        start = int(request.get_header("Range").split("=")[1].rstrip("-"))
        return FakeResponse(blob[start:], 206)

    monkeypatch.setattr(urllib.request, "urlopen", serve)
    root = tmp_path / "data"
    assert cli("data", "download", "cifar10") == 2  # short read: reported, the part file kept
    assert "run again to resume" in capsys.readouterr().err
    part = root / "downloads" / "cifar-10-python.tar.gz.part"
    assert part.stat().st_size == len(blob) // 2
    assert cli("data", "download", "cifar10") == 0
    assert requests == [None, f"bytes={len(blob) // 2}-"]
    assert (root / "cifar-10-batches-py" / "data_batch_5").is_file()
    assert not part.exists() and not (root / "downloads" / "cifar-10-python.tar.gz").exists()
    manifest = json.loads((root / "downloads" / "manifest.json").read_text())
    assert manifest["cifar-10-python.tar.gz"]["sha256"] == hashlib.sha256(blob).hexdigest()
    assert cli("data", "download", "cifar10") == 0  # already present: nothing fetched
    assert len(requests) == 2


def test_download_rejects_bad_checksum(monkeypatch, tmp_path, capsys):
    url = "https://example.invalid/cifar-10-python.tar.gz"
    monkeypatch.setitem(
        DOWNLOADS,
        "cifar10",
        DownloadSpec("cifar10", (Resource("c.tar.gz", (url,), "0" * 32),), "tar", "x"),
    )
    monkeypatch.setattr(
        urllib.request, "urlopen", lambda request, *a, **k: FakeResponse(b"tampered", 200)
    )
    assert cli("data", "download", "cifar10") == 2
    assert "MD5 mismatch" in capsys.readouterr().err
    assert not list((tmp_path / "data" / "downloads").glob("c.tar.gz*"))


def test_manually_placed_archive_is_used_offline(monkeypatch, tmp_path, offline):
    blob = cifar_archive(tmp_path)
    resource = Resource(
        "cifar-10-python.tar.gz", ("https://example.invalid/x",), hashlib.md5(blob).hexdigest()
    )
    monkeypatch.setitem(DOWNLOADS, "cifar10", DownloadSpec("cifar10", (resource,), "tar", "x"))
    downloads = tmp_path / "data" / "downloads"
    downloads.mkdir(parents=True)
    (downloads / "cifar-10-python.tar.gz").write_bytes(blob)
    assert cli("data", "download", "cifar10") == 0
    assert offline == [] and (tmp_path / "data" / "cifar-10-batches-py" / "batches.meta").is_file()


def test_unsafe_tar_is_refused(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    archive = tmp_path / "evil.tar.gz"
    archive.write_bytes(buffer.getvalue())
    with pytest.raises(Exception, match="unsafe"):
        download_module._extract_tar(archive, tmp_path / "out")
    assert not (tmp_path / "escape.txt").exists()


def test_partition_summary_and_heatmap(capsys, tmp_path):
    plot = tmp_path / "heatmap.png"
    code = cli(
        "data",
        "partition",
        "--dataset",
        "digits",
        "--partitioner",
        "shards",
        "--clients",
        "10",
        "--samples-per-client",
        "100",
        "-o",
        "shards_per_client=2",
        "--seed",
        "3",
        "--plot",
        str(plot),
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "10 clients, 1000 samples" in out and "2..2 classes" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (
        cli(
            "data",
            "partition",
            "--partitioner",
            "alpha",
            "--clients",
            "5",
            "--similarity",
            "0.25",
            "--json",
        )
        == 0
    )
    counts = json.loads(capsys.readouterr().out)["counts"]
    assert len(counts) == 5 and len(counts[0]) == 10


def test_partition_errors_are_one_line(capsys):
    assert cli("data", "partition", "--partitioner", "shards", "--clients", "7") == 2
    lines = error_lines(capsys.readouterr())
    assert len(lines) == 1 and "not an integer" in lines[0]
    assert cli("data", "partition", "--partitioner", "natural", "--clients", "3") == 2
    assert "writer ids" in capsys.readouterr().err
    assert cli("data", "partition", "--dataset", "cifar10") == 2
    assert "p4bench data download cifar10" in capsys.readouterr().err


def test_partition_natural_on_synthetic(capsys):
    code = cli(
        "data",
        "partition",
        "--dataset",
        "synthetic",
        "--partitioner",
        "natural",
        "--clients",
        "4",
        "--samples-per-client",
        "30",
        "-o",
        "synthetic_dim=10",
        "--json",
    )
    assert code == 0
    counts = json.loads(capsys.readouterr().out)["counts"]
    assert [sum(row) for row in counts] == [30] * 4


def test_info_for_one_missing_dataset_exits_2_saying_where(capsys, tmp_path):
    from p4bench.cli import main

    with pytest.raises(SystemExit) as info:
        main(["data", "info", "cifar10", "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "cifar10" in err and str(tmp_path) in err and len(err.strip().splitlines()) <= 3
    with pytest.raises(SystemExit) as info:
        main(["data", "info", "digits", "--data-dir", str(tmp_path)])
    assert (info.value.code or 0) == 0
