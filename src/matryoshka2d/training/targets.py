"""The teacher's targets for distillation: its last-layer vectors at unit length, computed once per run.

A distillation run (matryoshka2d.training.distill) compares the student with the same teacher vectors every epoch;
encoding them again each step would cost the teacher's whole forward pass. They are streamed once, in chunks, to a
float16 file in the run folder and read back memory-mapped:

OUTPUT/teacher-targets/
  targets.f16     rows x dim float16, row i the unit vector of text i (C order, no header)
  targets.json    rows, dim, the file's sha256, the sha256 of the texts (in order), the teacher (location and
                  weights sha256), how long the pass took

A resumed run reads them again only if every one of those still holds: a deleted or damaged file, other texts or
another teacher's weights are refused by name, and so is a file whose rows are not unit vectors (re-signed to pass
the checksums); nothing in the folder is replaced (start again with --overwrite).
float16 keeps 3 significant digits; a cosine between a float16 and a float32 unit vector of minilm-l6 differs from 1
by about 1e-7, far below what a student learns.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from matryoshka2d.files import OutsideFolderError, file_sha256, inside
from matryoshka2d.models.identity import short

FOLDER = "teacher-targets"
VECTORS = "targets.f16"
RECORD = "targets.json"
CHUNK = 2048  # texts per teacher call while streaming the targets


class TargetsError(ValueError):
    """Cached teacher targets that cannot be used; the message names the file and what differs."""


def texts_sha256(texts: Sequence[str]) -> str:
    """sha256 of the texts in order (each one's UTF-8 bytes, then a NUL): the same texts in the same order."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8", "surrogatepass"))
        digest.update(b"\0")
    return digest.hexdigest()


def unit_targets(teacher, texts: Sequence[str], batch_size: int = 64) -> np.ndarray:
    """The teacher's last-layer vectors of `texts`, scaled to length 1 (float32)."""
    top = teacher.num_layers
    vectors = teacher.pooled_states(list(texts), [top], batch_size=batch_size)[top]
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


class TeacherTargets:
    """The targets folder of one run: `compute` writes it, `load` checks and maps it."""

    def __init__(self, run_folder: str | Path):
        self.run_folder = Path(run_folder)
        self.folder = self.run_folder / FOLDER

    @property
    def vectors_path(self) -> Path:
        return self.folder / VECTORS

    @property
    def record_path(self) -> Path:
        return self.folder / RECORD

    def exists(self) -> bool:
        return self.record_path.exists() or self.vectors_path.exists()

    def remove(self) -> None:
        for path in (self.vectors_path, self.record_path, self.folder / f".{VECTORS}.tmp"):
            path.unlink(missing_ok=True)
        if self.folder.is_dir() and not any(self.folder.iterdir()):
            self.folder.rmdir()

    def compute(
        self,
        teacher,
        texts: Sequence[str],
        teacher_sha: str,
        log: Callable[[str], None] | None = None,
        progress: bool = True,
        engine: Callable | None = None,
    ) -> np.ndarray:
        """Encode `texts` with the teacher chunk by chunk into the float16 file (written under a temporary name,
        renamed when complete), record it, and return it memory-mapped. `engine(texts, chunk)`: another encoder
        pass (`distill --engine ray`), yielding the unit vectors of each chunk of `chunk` texts in order."""
        from tqdm.auto import tqdm

        self.folder.mkdir(parents=True, exist_ok=True)
        dim = teacher.hidden_size
        tmp = self.folder / f".{VECTORS}.tmp"
        tmp.unlink(missing_ok=True)  # a link left in its place is removed, never written through
        start = time.perf_counter()
        bar = tqdm(total=len(texts), desc="teacher targets", unit="text", disable=not progress)
        try:
            chunks = (
                engine(texts, CHUNK)
                if engine is not None
                else (unit_targets(teacher, texts[b : b + CHUNK]) for b in range(0, len(texts), CHUNK))
            )
            with tmp.open("wb") as f:
                for vectors in chunks:
                    f.write(np.asarray(vectors, dtype=np.float32).astype(np.float16).tobytes())
                    bar.update(len(vectors))
                f.flush()
                os.fsync(f.fileno())
        finally:
            bar.close()
        if tmp.stat().st_size != len(texts) * dim * 2:
            raise TargetsError(f"{tmp}: the encoder pass gave {tmp.stat().st_size // (dim * 2)} of {len(texts)} rows")
        os.replace(tmp, self.vectors_path)
        seconds = round(time.perf_counter() - start, 1)
        record = {
            "rows": len(texts),
            "dim": dim,
            "dtype": "float16",
            "sha256": file_sha256(self.vectors_path),
            "texts_sha256": texts_sha256(texts),
            "teacher": teacher.location or teacher.name,
            "teacher_weights_sha256": teacher_sha,
            "what": "the teacher's last-layer vectors, unit length",
            "seconds": seconds,
            "engine": "ray" if engine is not None else "local",
        }
        self.record_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        if log:
            log(f"teacher targets: {len(texts)} texts x {dim} in {seconds:.1f} s -> {self.vectors_path}")
        return self.load(texts, teacher_sha, dim)

    def load(self, texts: Sequence[str], teacher_sha: str, dim: int) -> np.ndarray:
        """The cached targets, memory-mapped, after checking that they are this run's: complete, undamaged, of
        these texts and of this teacher."""
        again = "start the run again with --overwrite (it recomputes them), or choose another --output"
        try:  # before either file is opened: a link out of the run folder would be read and hashed
            inside(self.run_folder, f"{FOLDER}/{RECORD}", self.run_folder, "the teacher targets' record")
            inside(self.run_folder, f"{FOLDER}/{VECTORS}", self.record_path, "the teacher targets' vectors")
        except OutsideFolderError as exc:
            raise TargetsError(f"{exc}; {again}") from None
        if not self.record_path.is_file():
            raise TargetsError(f"{self.record_path} is missing: the cached teacher targets cannot be checked; {again}")
        try:
            record = json.loads(self.record_path.read_text(encoding="utf-8"))
            rows, width, expected = int(record["rows"]), int(record["dim"]), str(record["sha256"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise TargetsError(f"{self.record_path}: not a readable targets record ({exc!r}); {again}") from None
        if not self.vectors_path.is_file():
            raise TargetsError(f"{self.vectors_path} is missing (the teacher targets were deleted); {again}")
        if self.vectors_path.stat().st_size != rows * width * 2 or file_sha256(self.vectors_path) != expected:
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
        if rows != len(texts) or record.get("texts_sha256") != texts_sha256(texts):
            raise TargetsError(
                f"{self.record_path}: the targets are of other texts ({rows} recorded, {len(texts)} read now, or the "
                f"texts differ): the data changed since the run started; {again}"
            )
        if width != dim:
            raise TargetsError(f"{self.record_path}: targets of {width} numbers, the model outputs {dim}; {again}")
        targets = np.memmap(self.vectors_path, dtype=np.float16, mode="r", shape=(rows, width))
        check_unit_rows(targets, self.vectors_path, again)
        return targets


# A unit vector stored in float16 has a length within about 1e-3 of 1 (3 significant digits per number); anything
# further off (zeros, NaN, a scaled or random file re-signed to pass the checksums) is not a target.
UNIT_TOLERANCE = 1e-2


def check_unit_rows(targets: np.ndarray, path: Path, again: str) -> None:
    """Refuse targets that are not unit vectors, naming the file and the first such row: they are written at unit
    length, so any other is a file that was replaced (and re-signed), not the teacher's vectors. Read in chunks of
    CHUNK rows (a pass over the file, as its checksum was)."""
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
