"""The teacher's targets for distillation: its last-layer vectors at unit length, computed once per run.

A distillation run (matryoshka2d.training.distill) compares the student with the same teacher vectors every epoch;
encoding them again each step would cost the teacher's whole forward pass. They are streamed once, in chunks, to a
float16 file in the run folder and read back memory-mapped:

OUTPUT/teacher-targets/
  targets.f16     rows x dim float16, row i the unit vector of text i (C order, no header)
  targets.json    rows, dim, the file's sha256, the teacher (location and weights sha256), how long the pass took,
                  the cache key (cache_keys.cache_key) over everything that changes the vectors: the teacher's
                  weights, its configuration and its tokenizer (as loaded, every setting), its max length and
                  pooling, the width and the texts (hashed with their lengths, cache_keys.texts_sha256), each also
                  recorded on its own; and the signature of the record and the vectors under this machine's key
                  (models.signing)

A resumed run, or a new run into a folder that holds targets, reads them again only if every one of those still
holds: a deleted or damaged file, other texts, another teacher's weights, configuration, tokenizer, max length or
pooling are refused by name, and so is a file whose rows are not unit vectors or whose signature does not hold (a
row edited and its checksum recorded again by hand); nothing in the folder is replaced (start again with
--overwrite). Checking costs one read of the file (the sha256 and the signature in one pass: 0.1 s for the 60 MB of
78,091 texts x 384 here, against 0.06 s for the sha256 alone), next to the teacher's pass it saves (25 minutes).

While the run trains, every read of the mapped rows compares the file, before and after, with the one checked
(device, inode, size, modification and change times: any write or replacement changes one; `MappedTargets`), and
the run checks the signature again before it saves its model: targets rewritten under a running distillation stop
it with a message naming the file, at the first batch read after the change, and no model is saved from them. A
copy in memory would shield the run instead, but it costs the file's size in memory (rows x dim x 2 bytes) where
the mapping costs the pages read, and the run would still have to say that its folder no longer holds the targets
it trained on.

The folder is the run's own: a `teacher-targets` that is a link (to another run's) is refused, never read, filled or
deleted through (outputs.make_folder(own=True), remove_tree). float16 keeps 3 significant digits; a cosine between
a float16 and a float32 unit vector of minilm-l6 differs from 1 by about 1e-7, far below what a student learns.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from matryoshka2d import outputs
from matryoshka2d.cache_keys import cache_key, encoder_config_sha256, texts_sha256, tokenizer_sha256
from matryoshka2d.confined import ConfinedFolder, OutsideFolderError
from matryoshka2d.files import file_sha256
from matryoshka2d.models.identity import short
from matryoshka2d.models.signing import key_path, sign

FOLDER = "teacher-targets"
VECTORS = "targets.f16"
RECORD = "targets.json"
CHUNK = 2048  # texts per teacher call while streaming the targets
BLOCK = 1 << 20  # bytes per read while the file is checked


class TargetsError(ValueError):
    """Cached teacher targets that cannot be used; the message names the file and what differs."""


KIND = "teacher-targets"  # the cache kind in the key


def encoder_tokenizer_sha256(encoder) -> str:
    """The checksum of the tokenizer an encoder tokenizes with, as loaded (cache_keys.tokenizer_sha256 says why)."""
    return tokenizer_sha256(encoder.tokenizer)


@dataclass(frozen=True)
class TargetsKey:
    """What the teacher's targets depend on, besides the texts and the teacher's weights (given to load): each is
    recorded in targets.json and compared by name, and all of them make the record's cache key."""

    tokenizer_sha256: str | None
    config_sha256: str | None
    max_length: int
    pooling: str

    @classmethod
    def of(cls, teacher) -> TargetsKey:
        return cls(
            encoder_tokenizer_sha256(teacher),
            encoder_config_sha256(teacher),
            int(teacher.max_length),
            str(teacher.pooling),
        )

    def key(self, teacher_sha: str, dim: int, texts_digest: str) -> str:
        return cache_key(
            KIND,
            weights_sha256=teacher_sha,
            config_sha256=self.config_sha256,
            tokenizer_sha256=self.tokenizer_sha256,
            max_length=self.max_length,
            pooling=self.pooling,
            widths=[int(dim)],  # the teacher's full vectors
            texts_sha256=texts_digest,
        )


def unit_targets(teacher, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
    """The teacher's last-layer vectors of `texts`, scaled to length 1 (float32)."""
    top = teacher.num_layers
    vectors = teacher.pooled_states(list(texts), [top], batch_size=batch_size)[top]
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


# ---- the signature: the record and the vectors, under this machine's key --------------------------------------


def _blocks(path: Path) -> Iterator[bytes]:
    with Path(path).open("rb") as f:
        yield from iter(lambda: f.read(BLOCK), b"")


def _signed_record(record: dict) -> bytes:
    """The record's fields that the signature covers: all but the signature itself, framed by their length."""
    text = json.dumps({k: v for k, v in record.items() if k != "signature"}, sort_keys=True).encode()
    return len(text).to_bytes(8, "big") + text


def read_and_sign(record: dict, vectors: Path) -> tuple[str, str]:
    """(the file's sha256, the signature of `record` and the file under this machine's key), in one read."""
    digest = hashlib.sha256()

    def hashed() -> Iterator[bytes]:
        yield _signed_record(record)
        for block in _blocks(vectors):
            digest.update(block)
            yield block

    signature = sign(str(record.get("cache_key")), hashed())  # reads the whole file, so the digest is complete
    return digest.hexdigest(), signature


def sign_record(record: dict, vectors: Path) -> dict:
    """`record` with the signature of itself and the vectors file (what compute writes beside the file)."""
    return {**record, "signature": read_and_sign(record, vectors)[1]}


def file_state(path: Path) -> tuple[int, ...]:
    """What any write or replacement of the file changes: device, inode, size, modification and change times (the
    change time cannot be set back by a user)."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


class MappedTargets:
    """The checked targets, memory-mapped: `targets[rows]` reads rows as numpy does, comparing the file with the one
    checked (`file_state`) before and after, so rows of a file written or replaced since are never handed to the run
    (a file cut short is noticed before its pages are read, which would end the process with SIGBUS);
    `check_intact` reads it whole again against its signature (the run does, before it saves its model)."""

    def __init__(self, path: Path, record: dict, state: tuple[int, ...], again: str):
        self.path, self.record, self.state, self.again = path, record, state, again
        self.rows = np.memmap(path, dtype=np.float16, mode="r", shape=(int(record["rows"]), int(record["dim"])))

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows.shape

    @property
    def dtype(self):
        return self.rows.dtype

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index) -> np.ndarray:
        self.check_unchanged()
        rows = np.array(self.rows[index])  # a copy: nothing the run holds stays mapped
        self.check_unchanged()
        return rows

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = self[:]
        return rows if dtype is None else rows.astype(dtype)

    def check_unchanged(self) -> None:
        """The file is still the one checked: nothing wrote, replaced, cut or deleted it since (file_state)."""
        try:
            now = file_state(self.path)
        except OSError:
            now = None
        if now != self.state:
            raise TargetsError(
                f"{self.path} was {'deleted' if now is None else 'written or replaced'} while the run read it: the "
                "run stops rather than train on targets other than those it checked (its checkpoints so far were "
                f"made from those); restore them and --resume, or {self.again}"
            )

    def check_intact(self) -> None:
        """The file is still the one checked, and its bytes still those the record signs."""
        self.check_unchanged()
        if not hmac.compare_digest(read_and_sign(self.record, self.path)[1], str(self.record.get("signature"))):
            raise TargetsError(
                f"{self.path}: its bytes changed while the run read it (its signature no longer holds): the run "
                f"stops and saves no model from them; restore them and --resume, or {self.again}"
            )
        self.check_unchanged()


class TeacherTargets:
    """The targets folder of one run: `compute` writes it, `load` checks and maps it."""

    def __init__(self, run_folder: str | Path):
        self.run_folder = Path(run_folder)
        self.folder = self.run_folder / FOLDER
        self.record: dict = {}  # what load or compute last read or wrote

    @property
    def vectors_path(self) -> Path:
        return self.folder / VECTORS

    @property
    def record_path(self) -> Path:
        return self.folder / RECORD

    def exists(self) -> bool:
        """Whether the run folder holds targets, or anything in their place (a link is there too: load refuses it)."""
        return self.folder.is_symlink() or self.record_path.exists() or self.vectors_path.exists()

    def remove(self) -> None:
        """--overwrite: the folder goes, through the one writer: a `teacher-targets` that is a link (to another
        run's) is refused (outputs.OutputError), never followed, so the other run's files stay as they are."""
        outputs.remove_tree(self.folder)

    def compute(
        self,
        teacher,
        texts: Sequence[str],
        teacher_sha: str,
        log: Callable[[str], None] | None = None,
        progress: bool = True,
        engine: Callable | None = None,
        settings: TargetsKey | None = None,
    ) -> MappedTargets:
        """Encode `texts` with the teacher chunk by chunk into the float16 file (written under a temporary name,
        moved into place when complete), record it with its cache key and signature, and return it mapped.
        `engine(texts, chunk)`: another encoder pass (`distill --engine ray`), yielding the unit vectors of each
        chunk of `chunk` texts in order. `settings`: the teacher's (default: read from `teacher`)."""
        from tqdm.auto import tqdm

        settings = settings or TargetsKey.of(teacher)
        outputs.make_folder(self.folder, own=True)  # a link in its place (to another run's) is refused
        dim = teacher.hidden_size
        start = time.perf_counter()
        bar = tqdm(total=len(texts), desc="teacher targets", unit="text", disable=not progress)
        try:
            chunks = (
                engine(texts, CHUNK)
                if engine is not None
                else (unit_targets(teacher, texts[b : b + CHUNK]) for b in range(0, len(texts), CHUNK))
            )
            # a temporary file beside, renamed when whole: a link in its place is replaced, never written through
            with outputs.open_for_writing(self.vectors_path, "wb") as f:
                for vectors in chunks:
                    f.write(np.asarray(vectors, dtype=np.float32).astype(np.float16).tobytes())
                    bar.update(len(vectors))
                f.flush()
                os.fsync(f.fileno())
                if f.tell() != len(texts) * dim * 2:
                    raise TargetsError(
                        f"{self.vectors_path}: the encoder pass gave {f.tell() // (dim * 2)} of {len(texts)} rows"
                    )
        finally:
            bar.close()
        seconds = round(time.perf_counter() - start, 1)
        digest = texts_sha256(texts)
        record = {
            "rows": len(texts),
            "dim": dim,
            "dtype": "float16",
            "texts_sha256": digest,
            "teacher": teacher.location or teacher.name,
            "teacher_weights_sha256": teacher_sha,
            **asdict(settings),
            "cache_key": settings.key(teacher_sha, dim, digest),
            "what": "the teacher's last-layer vectors, unit length",
            "seconds": seconds,
            "engine": "ray" if engine is not None else "local",
        }
        record["sha256"] = file_sha256(self.vectors_path)
        outputs.write_json(self.record_path, sign_record(record, self.vectors_path))
        if log:
            log(f"teacher targets: {len(texts)} texts x {dim} in {seconds:.1f} s -> {self.vectors_path}")
        return self.load(texts, teacher_sha, dim, settings)

    def load(
        self, texts: Sequence[str], teacher_sha: str, dim: int, settings: TargetsKey | None = None
    ) -> MappedTargets:
        """The cached targets, mapped, after checking that they are this run's: complete, undamaged, of these texts
        and of this teacher, and, with `settings` (a run always gives them), made with its configuration,
        tokenizer, max length and pooling under the cache key they make; signed under this machine's key; unit
        rows. What differs is named."""
        again = "start the run again with --overwrite (it recomputes them), or choose another --output"
        folder = self._confined(again)
        record, rows, width, expected = self._read_record(folder, again)
        if not self.vectors_path.is_file():
            raise TargetsError(f"{self.vectors_path} is missing (the teacher targets were deleted); {again}")
        state = file_state(self.vectors_path)
        sha, signature = read_and_sign(record, self.vectors_path) if state[2] == rows * width * 2 else (None, None)
        if sha != expected:
            raise TargetsError(
                f"{self.vectors_path} is damaged or was changed (its size or sha256 is not the one recorded in "
                f"{self.record_path.name}); {again}"
            )
        if record.get("teacher_weights_sha256") != teacher_sha:
            raise TargetsError(
                f"{self.record_path}: the targets were computed by a teacher with weights sha256 "
                f"{short(record.get('teacher_weights_sha256'))}, but {record.get('teacher')} now has "
                f"{short(teacher_sha)}: the teacher changed since the run started; {again}"
            )
        if settings is not None and "cache_key" not in record:
            raise TargetsError(
                f"{self.record_path} records no cache key (written by an older matryoshka2d, before targets were "
                f"keyed by the teacher's configuration, tokenizer, max length and pooling): they cannot be checked; "
                f"{again}"
            )
        digest = texts_sha256(texts)
        if rows != len(texts) or record.get("texts_sha256") != digest:
            raise TargetsError(
                f"{self.record_path}: the targets are of other texts ({rows} recorded, {len(texts)} read now, or the "
                f"texts differ): the data changed since the run started; {again}"
            )
        if width != dim:
            raise TargetsError(f"{self.record_path}: targets of {width} numbers, the model outputs {dim}; {again}")
        if settings is not None:
            check_settings(record, settings, self.record_path, again)
            if record.get("cache_key") != settings.key(teacher_sha, dim, digest):
                raise TargetsError(
                    f"{self.record_path}: cache_key {short(str(record.get('cache_key')))} is not the key of this "
                    f"run's teacher, texts and settings ({short(settings.key(teacher_sha, dim, digest))}): the "
                    f"targets were made under other settings; {again}"
                )
        self._check_signature(record, signature, again)
        targets = MappedTargets(self.vectors_path, record, state, again)
        targets.check_unchanged()  # the file mapped is the one read and signed: nothing wrote it in between
        check_unit_rows(targets.rows, self.vectors_path, again)
        self.record = record
        return targets

    def _confined(self, again: str) -> ConfinedFolder:
        """The run folder's reader, after refusing a record or vectors that lead out of it (they would be read and
        hashed) and a `teacher-targets` that is a link (to another run's)."""
        try:
            folder = ConfinedFolder(self.run_folder, "run", check=False)
            folder.path(f"{FOLDER}/{RECORD}", self.run_folder, "the teacher targets' record")
            folder.path(f"{FOLDER}/{VECTORS}", self.record_path, "the teacher targets' vectors")
        except OutsideFolderError as exc:
            raise TargetsError(f"{exc}; {again}") from None
        if self.folder.is_symlink():
            raise TargetsError(
                f"{self.folder} is a symbolic link (-> {os.readlink(self.folder)}): a run reads only the teacher "
                f"targets it made itself; remove the link, or {again}"
            )
        return folder

    def _read_record(self, folder: ConfinedFolder, again: str) -> tuple[dict, int, int, str]:
        """(the record, its rows, its width, the sha256 it records), or TargetsError naming what is wrong."""
        if not self.record_path.is_file():
            raise TargetsError(f"{self.record_path} is missing: the cached teacher targets cannot be checked; {again}")
        try:
            record = folder.read_json(f"{FOLDER}/{RECORD}", TargetsError)
            rows, width, expected = int(record["rows"]), int(record["dim"]), str(record["sha256"])
        except (ValueError, KeyError, TypeError) as exc:
            raise TargetsError(f"{self.record_path}: not a readable targets record ({exc!r}); {again}") from None
        if rows < 0 or width < 1:
            raise TargetsError(f"{self.record_path}: rows {rows} and dim {width} describe no targets; {again}")
        return record, rows, width, expected

    def _check_signature(self, record: dict, signature: str | None, again: str) -> None:
        """A record and vectors whose signature does not hold under this machine's key are not trusted: an edit
        can give a row another unit vector and record the file's sha256 again, but cannot sign it."""
        if "signature" not in record:
            raise TargetsError(
                f"{self.record_path} records no signature (written by an older matryoshka2d, or by hand): the "
                f"targets cannot be trusted as the teacher's vectors; {again}"
            )
        if not (isinstance(record["signature"], str) and hmac.compare_digest(record["signature"], signature or "")):
            raise TargetsError(
                f"{self.record_path}: its signature does not hold under this machine's key ({key_path()}): the "
                "vectors or the record were changed after the run wrote them (a row edited and its sha256 recorded "
                "again included), or they were signed under another key (made on another machine or with another "
                "MATRYOSHKA2D_CACHE; a run moved between machines takes that key file with it); they are not "
                f"trusted as the teacher's vectors; {again}"
            )


# How each setting is named when it differs: the option that sets it, or the file it is read from.
SETTING_NAMES = {
    "max_length": "--max-length (tokens per text)",
    "pooling": "--pooling",
    "tokenizer_sha256": "the teacher's tokenizer (sha256 of its definition and settings)",
    "config_sha256": "the teacher's configuration (sha256 of its config.json as loaded)",
}
CHECKSUMS = {"tokenizer_sha256", "config_sha256"}  # shown by their first digits


def check_settings(record: dict, settings: TargetsKey, where: Path, again: str) -> None:
    """Refuse targets made with another configuration, tokenizer, max length or pooling than the run's, naming each
    that differs."""
    differ = []
    for name, now in asdict(settings).items():
        made = record.get(name)
        if made != now:
            shown = (short(made), short(now)) if name in CHECKSUMS else (made, now)
            differ.append(f"{SETTING_NAMES[name]}: {shown[0]} when they were made, {shown[1]} now")
    if differ:
        raise TargetsError(
            f"{where}: the targets were made with other settings than this run's ({'; '.join(differ)}): they are not "
            f"this run's teacher vectors; {again}"
        )


# A unit vector stored in float16 has a length within about 1e-3 of 1 (3 significant digits per number); anything
# further off (zeros, NaN, a scaled or random file) is not a target.
UNIT_TOLERANCE = 1e-2


def check_unit_rows(targets: np.ndarray, path: Path, again: str) -> None:
    """Refuse targets that are not unit vectors, naming the file and the first such row: they are written at unit
    length, so any other is a file that was replaced, not the teacher's vectors (a file signed under this machine's
    key by hand included). Read in chunks of CHUNK rows (a pass over the file, as its checksum was)."""
    for start in range(0, len(targets), CHUNK):
        lengths = np.linalg.norm(np.asarray(targets[start : start + CHUNK], dtype=np.float32), axis=1)
        bad = np.flatnonzero(~(np.abs(lengths - 1) <= UNIT_TOLERANCE))
        if bad.size:
            row = start + int(bad[0])
            raise TargetsError(
                f"{path}: row {row + 1} has length {float(lengths[bad[0]]):.4g}, not 1 ({bad.size} such rows in rows "
                f"{start + 1}..{start + len(lengths)}): the teacher's targets are unit vectors, so the file is not "
                f"the one the teacher wrote; {again}"
            )
