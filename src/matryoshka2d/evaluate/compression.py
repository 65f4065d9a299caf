"""What a cut keeps of the whole vector: ESE's Figure 7 (arXiv 2402.14776v2, sec. 4.4) and the same view for depth.

Each sentence has two vectors: the whole one, at a cell (L, FULL), and a cut of it: its first K numbers (L, K),
or the vector an exit gives, (N, FULL). The figure puts both sets of points in one t-SNE plane and the paper
reports "the average distance between the 768-dimensional embedding points and the 128-dimensional embedding
points" under each panel. The paper does not say how vectors of two widths meet in one t-SNE; here a first-K
vector is the point the cut leaves in the full space (its other numbers zero), all 2n points go through one
t-SNE with the cosine metric (so the cut vector is compared by direction, as STS compares it: re-normalised),
and the distance is the mean Euclidean distance, in the plane, between each sentence's two points.

That number moves with t-SNE's layout (seed, perplexity, number of points), so two numbers that do not depend on
it sit beside it: the mean cosine distance between each sentence's whole vector and its cut, and the share of
each sentence's nearest neighbours (by cosine, among the same sentences) under the whole vector that the cut
loses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy.linalg import orthogonal_procrustes

from matryoshka2d.cells import unit_rows
from matryoshka2d.evaluate.plots import paired_points
from matryoshka2d.evaluate.sts import distinct_rows, load_pairs, sts_file
from matryoshka2d.outputs import make_folder, write_json, write_text

NEIGHBOURS = 10
LAYOUTS = ("joint", "separate")


@dataclass
class Panel:
    """One model's view: the whole vector at `full`, the cut at `cut` (cells as (layer, dim)), the t-SNE points
    of both (n x 2 each) and the three distances."""

    name: str
    view: str  # "width" (first K numbers) or "depth" (an exit)
    full: tuple[int, int]
    cut: tuple[int, int]
    sentences: int
    tsne_distance: float
    cosine_distance: float
    neighbour_loss: float
    full_points: np.ndarray
    cut_points: np.ndarray

    def record(self) -> dict:
        """The numbers, without the points."""
        record = asdict(self)
        del record["full_points"], record["cut_points"]
        return record


def padded(vectors: np.ndarray, width: int) -> np.ndarray:
    """The vectors with zeros appended up to `width` numbers: a first-K vector as a point of the full space."""
    if vectors.shape[1] > width:
        raise ValueError(f"a cut of {vectors.shape[1]} numbers is wider than the whole vector ({width})")
    return np.pad(vectors, ((0, 0), (0, width - vectors.shape[1])))


def paired_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean Euclidean distance between row i of `a` and row i of `b` (the paper's average distance, in the plane)."""
    return float(np.linalg.norm(a - b, axis=1).mean())


def cosine_distance(full: np.ndarray, cut: np.ndarray) -> float:
    """Mean of 1 - cos(whole vector, its cut), the cut zero-padded to the whole width (0: the cut points the same
    way as the whole; for a first-K cut it is 1 - the share of the vector's length in its first K numbers)."""
    cut = padded(cut, full.shape[1])
    return float(1.0 - np.einsum("ij,ij->i", unit_rows(full), unit_rows(cut)).mean())


def nearest(vectors: np.ndarray, k: int) -> np.ndarray:
    """Each row's k nearest other rows by cosine (n x k indices, any order)."""
    unit = unit_rows(vectors)
    similarity = unit @ unit.T
    np.fill_diagonal(similarity, -np.inf)
    return np.argpartition(-similarity, k - 1, axis=1)[:, :k]


def neighbour_loss(full: np.ndarray, cut: np.ndarray, k: int = NEIGHBOURS) -> float:
    """The share of each sentence's k nearest neighbours under the whole vector that are not among its k nearest
    under the cut, averaged over sentences (0: the cut keeps every neighbourhood)."""
    if len(full) <= k:
        raise ValueError(f"{len(full)} sentences: the neighbour loss at {k} neighbours needs more than {k}")
    a, b = nearest(full, k), nearest(cut, k)
    kept = [len(np.intersect1d(a[i], b[i], assume_unique=True)) for i in range(len(a))]
    return float(1.0 - np.mean(kept) / k)


def tsne_pairs(full: np.ndarray, cut: np.ndarray, seed: int = 0, perplexity: float = 30.0, layout: str = "joint"):
    """The plane points of the whole vectors and of their cuts (scikit-learn TSNE, cosine metric, PCA start,
    fixed seed). "joint": one t-SNE of both sets, the cuts zero-padded to the whole width; vectors of the same
    direction go in once and share their point (scikit-learn's neighbour search breaks ties between copies
    unevenly, and would pull two copies apart). "separate": a t-SNE of each set at its own width, the cuts' layout
    then turned onto the whole's (orthogonal Procrustes, no scaling), so that the distance compares the two
    neighbourhood structures, not where two clouds happen to land."""
    if layout not in LAYOUTS:
        raise ValueError(f"--layout {layout}: choose one of {', '.join(LAYOUTS)}")
    if layout == "separate":
        whole, part = _tsne(full, seed, perplexity), _tsne(cut, seed, perplexity)
        whole -= whole.mean(axis=0)
        part -= part.mean(axis=0)
        rotation, _ = orthogonal_procrustes(part, whole)
        return whole, part @ rotation
    points = _tsne(np.vstack([full, padded(cut, full.shape[1])]), seed, perplexity)
    return points[: len(full)], points[len(full) :]


def _tsne(vectors: np.ndarray, seed: int, perplexity: float) -> np.ndarray:
    """t-SNE of the unit rows, each distinct row once, every row given its point."""
    from sklearn.manifold import TSNE

    distinct, row = np.unique(unit_rows(vectors).astype(np.float64), axis=0, return_inverse=True)
    perplexity = min(perplexity, (len(distinct) - 1) / 3)  # scikit-learn needs fewer than the points
    points = TSNE(n_components=2, metric="cosine", init="pca", perplexity=perplexity, random_state=seed)
    return points.fit_transform(distinct)[row.reshape(-1)]


def compare(
    name: str,
    view: str,
    cells: dict[tuple[int, int], np.ndarray],
    full: tuple[int, int],
    cut: tuple[int, int],
    seed: int = 0,
    perplexity: float = 30.0,
    layout: str = "joint",
) -> Panel:
    """The panel of one model: `cells` holds a row per sentence at both cells."""
    whole, part = cells[full], cells[cut]
    full_points, cut_points = tsne_pairs(whole, part, seed, perplexity, layout)
    return Panel(
        name,
        view,
        full,
        cut,
        len(whole),
        paired_distance(full_points, cut_points),
        cosine_distance(whole, part),
        neighbour_loss(whole, part),
        full_points,
        cut_points,
    )


def markdown(panels: Sequence[Panel]) -> str:
    """A table of the numbers, a row per panel."""
    lines = [
        f"| view | model | whole | cut | sentences | t-SNE distance | cosine distance | neighbour loss@{NEIGHBOURS} |",
        "|---|---|---|---|---:|---:|---:|---:|",
    ]
    for p in panels:
        lines.append(
            f"| {p.view} | {p.name} | ({p.full[0]}, {p.full[1]}) | ({p.cut[0]}, {p.cut[1]}) | {p.sentences} | "
            f"{p.tsne_distance:.2f} | {p.cosine_distance:.4f} | {p.neighbour_loss:.3f} |"
        )
    return "\n".join(lines) + "\n"


def stsb_sentences(data_dir, limit: int | None = None) -> list[str]:
    """The distinct sentences of STS-B test (raw), in order of first appearance; the first `limit` of them."""
    texts = list(distinct_rows(load_pairs(sts_file(Path(data_dir), "raw", "stsb"), "stsb")))
    if limit is not None and limit <= NEIGHBOURS:
        raise ValueError(f"--sentences {limit}: give more than {NEIGHBOURS} (the neighbour loss needs them)")
    return texts[:limit] if limit else texts


def check_views(layer: int, dims: Sequence[int] | None, exit: int | None, num_layers: int, hidden: int, name: str):
    """--layer, --dims K FULL and --exit against a model: each in range, the cut smaller than the whole."""
    if dims is None and exit is None:
        raise ValueError("give --dims K FULL (the width view), --exit N (the depth view), or both")
    if not 1 <= layer <= num_layers:
        raise ValueError(f"--layer {layer}: {name} has layers 1..{num_layers}")
    if dims is not None:
        if len(dims) != 2:
            raise ValueError(f"--dims takes two numbers, K and FULL (the cut and the whole), got {len(dims)}")
        k, full = dims
        if full > hidden:
            raise ValueError(f"--dims {k} {full}: FULL {full} is wider than {name}'s embeddings ({hidden} numbers)")
        if not 1 <= k < full:
            raise ValueError(f"--dims {k} {full}: K must be at least 1 and smaller than FULL ({full})")
    if exit is not None and not 1 <= exit < layer:
        raise ValueError(f"--exit {exit}: the exit must be a layer below --layer {layer} (1..{layer - 1})")


def model_panels(
    embedder,
    name: str,
    layer: int,
    dims,
    exit: int | None,
    texts: Sequence[str],
    seed: int,
    perplexity: float,
    layout: str = "joint",
) -> list[Panel]:
    """One model's panels from one pass over `texts` (an EncoderCells giving every needed cell): the width view
    (layer, FULL) vs (layer, K) and the depth view (layer, FULL) vs (exit, FULL), those asked for."""
    cells = embedder.embed(list(texts))
    full = dims[1] if dims is not None else max(d for _, d in cells)
    panels = []
    if dims is not None:
        panels.append(compare(name, "width", cells, (layer, full), (layer, dims[0]), seed, perplexity, layout))
    if exit is not None:
        panels.append(compare(name, "depth", cells, (layer, full), (exit, full), seed, perplexity, layout))
    return panels


def write_report(panels: Sequence[Panel], output, settings: dict, overwrite: bool = False) -> list:
    """compression.json (settings and numbers), compression.md (the table) and compression.png (a row of
    panels per view) in `output`; an earlier report there is replaced only with `overwrite`."""
    out = Path(output)
    paths = [out / "compression.json", out / "compression.md", out / "compression.png"]
    if not overwrite and (old := [p for p in paths if p.exists() or p.is_symlink()]):
        raise ValueError(f"--output {out} already holds {old[0].name}; pass --overwrite or choose another folder")
    make_folder(out, check=False)  # a folder of named files, each checked as written
    record = {"settings": settings, "panels": [p.record() for p in panels]}
    # Each file through the one writer (outputs.py): a link in a file's place (say, into a model's config.json) is
    # replaced, never written through, and refused when it reaches a file the command reads.
    write_json(paths[0], record, indent=1)
    write_text(paths[1], markdown(panels))
    rows = [[p for p in panels if p.view == view] for view in ("width", "depth")]
    title = (
        f"t-SNE of {settings['sentences']} STS-B test sentences (seed {settings['seed']}): whole (dark) vs cut (light)"
    )
    paired_points([row for row in rows if row], paths[2], title)
    return paths
