"""The one confined reader: nothing outside a folder the toolkit knows (a model, a pair, a static cell, exit heads, a
query encoder, an index, a run, a checkpoint, a graph cache, teacher targets) is opened because that folder names it or
links to it.

`ConfinedFolder` is made before anything in the folder is opened and refuses a folder holding a symbolic link that
leaves it; `inside` resolves every name a file of the folder gives (a record, a manifest, a sentence-transformers
modules.json) and refuses an absolute path, `..`, `~` and a link out. A refusal says only that a path leaves the
folder, never what lies outside. A Hugging Face cache snapshot, whose files link into its own `../../blobs`, is a
folder users have and reads as one (`confinement`).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from matryoshka2d.files import DataFormatError, read_json


class OutsideFolderError(ValueError):
    """A record, manifest or modules.json names a path that leaves the folder it describes."""


def confinement(folder: str | Path) -> tuple[Path, Path | None]:
    """(the folder, resolved; the blobs folder its links may reach, or None). A Hugging Face cache snapshot,
    `.../models--ORG--NAME/snapshots/REV/`, holds links into `../../blobs`: it is a folder users have, so a link
    from it into its own repository's `blobs/` stays inside, on purpose, when that `blobs/` is the repository's own
    (`own_blobs`); nothing else outside the folder does."""
    try:
        real = Path(folder).resolve()
    except (RuntimeError, OSError) as exc:  # the folder itself a loop of links
        raise OutsideFolderError(f"{folder}: cannot be resolved ({exc}); not a folder matryoshka2d can read") from None
    repo = real.parent.parent
    if real.parent.name == "snapshots" and repo.name.startswith(("models--", "datasets--")):
        return real, own_blobs(repo)
    return real, None


def own_blobs(repo: Path) -> Path | None:
    """`repo`/blobs (repo resolved) when it is the repository's own folder of blobs, else None: a real folder, not a
    link (to another folder, another repository's blobs, `/`), on the repository's file system and no mount point;
    compared by resolved path and by (device, inode) with what a link-free walk reaches, so that no second name of
    another folder passes for it. Links into anything else leave the snapshot."""
    blobs = repo / "blobs"
    try:
        itself, reached, parent = os.lstat(blobs), os.stat(blobs), os.stat(repo)
    except OSError:
        return None
    if not stat.S_ISDIR(itself.st_mode) or (itself.st_dev, itself.st_ino) != (reached.st_dev, reached.st_ino):
        return None  # a link, or not a folder
    if blobs.resolve() != blobs or itself.st_dev != parent.st_dev or os.path.ismount(blobs):
        return None  # reached through a link above it, or another file system mounted there
    return blobs


def stays_inside(path: Path, folder: str | Path) -> bool:
    """Whether `path` (a name under `folder`), links followed, lies in the folder, or is a blob (a file, never a
    folder, whose contents no walk of the snapshot checks) of its snapshot's own blobs/."""
    real, blobs = confinement(folder)
    try:
        target = Path(path).resolve()
    except (RuntimeError, OSError):  # a loop of links leads nowhere inside the folder
        return False
    if target.is_relative_to(real):
        return True
    return blobs is not None and target.is_relative_to(blobs) and target != blobs and not target.is_dir()


def _loops(path: Path) -> bool:
    try:
        path.resolve(strict=False)
    except (RuntimeError, OSError):
        return True
    return False


def inside(folder: str | Path, name, named_by: str | Path, field: str, folder_itself: bool = False) -> Path:
    """`folder / name` for a path that a file inside `folder` names (a record, a manifest, a sentence-transformers
    modules.json, a Router's router_config.json): the one place such a path is resolved. Refused
    (OutsideFolderError, before anything there is opened, whatever it holds) unless it is a plain relative name that
    stays inside the folder: an absolute path, `..`, or a symbolic link (of the name or of a folder on its way) that
    resolves outside would let a planted folder read, apply or test the contents of any file of the machine. A
    Hugging Face cache snapshot's links into its blobs/ stay inside (`confinement`). `named_by` is the file that
    names the path, `field` the field that holds it; `folder_itself` accepts "" (sentence-transformers' path of a
    module stored at the folder's top)."""
    folder = Path(folder)
    refused = f"{named_by}: {field} names {name!r}, which"
    what = "only a file inside the folder, or a folder in it, may be named there"
    if not isinstance(name, str) or (not name and not folder_itself) or "\0" in name:
        raise OutsideFolderError(f"{refused} is not a name of a file inside {folder}; {what}")
    if Path(name).is_absolute() or ".." in Path(name).parts or name.startswith("~"):
        raise OutsideFolderError(f"{refused} leaves {folder} (an absolute path or '..'); {what}")
    path = folder / name
    if not stays_inside(path, folder):
        raise OutsideFolderError(f"{refused} leaves {folder} through a symbolic link; {what}")
    return path


class ConfinedFolder:
    """The one reader of a folder the toolkit knows (a model, a pair, a static cell, exit heads, a query encoder,
    an index, a run, a graph cache, teacher targets): made before anything in the folder is opened, it refuses a
    folder holding a symbolic link that leaves it (`check_links`: a file the library behind a reader opens by a
    fixed name, such as a tokenizer's, could otherwise be read from anywhere), and `path` resolves every name a
    file of the folder gives through `inside`. The refusal says only that a path leaves the folder, never what
    lies outside (no content oracle)."""

    def __init__(self, folder: str | Path, kind: str = "model", check: bool = True):
        self.folder = Path(folder)
        self.kind = kind
        if check:
            self.check_links()

    def check_links(self) -> None:
        if not self.folder.is_dir():
            return
        for root, dirs, files in os.walk(self.folder, followlinks=False):
            for name in sorted(dirs + files):
                entry = Path(root) / name
                # one message whether the link leaves or loops: what lies outside the folder changes no word of it
                if entry.is_symlink() and (_loops(entry) or not stays_inside(entry, self.folder)):
                    raise OutsideFolderError(
                        f"{entry} is a symbolic link that leaves the {self.kind} folder {self.folder} or loops: the "
                        "folder is read only inside itself, through links that reach a file in it (a Hugging Face "
                        "cache snapshot may link into its own blobs/); nothing in it was read: put the file itself "
                        "in the folder"
                    )

    def path(self, name, named_by: str | Path | None = None, field: str = "a file name", folder_itself=False) -> Path:
        return inside(self.folder, name, named_by or self.folder, field, folder_itself)

    def read_json(self, name: str, error: type[Exception] | None = None, named_by=None, field: str = "a file name"):
        return read_json(self.path(name, named_by, field), error or DataFormatError)

    def read_bytes(self, name: str, named_by=None, field: str = "a file name") -> bytes:
        return self.path(name, named_by, field).read_bytes()

    def read_text(self, name: str, named_by=None, field: str = "a file name") -> str:
        return self.path(name, named_by, field).read_text(encoding="utf-8")
