"""faiss indexes of a cell's unit vectors: the factory string of an index kind and storage, the index built and
trained, and what a search calls on an index read from a file (int8-direct behind its one scale, the HNSW graph of
any kind). The build (matryoshka2d.retrieval.index) writes them; search and the cascade read and build them.
"""

from __future__ import annotations

import numpy as np

from matryoshka2d.retrieval.shards import INDEX_KINDS, STORAGES, IndexBuildError

# How wide an HNSW graph's construction searches for each new vector's links (faiss's default is 40; hnswlib's
# 200). On 208,041 minilm-l6 vectors, HNSW32 (6,384) built at 200 keeps 99.0% of flat's top 10 at efSearch 64
# (0.21 ms a query), where the graph built at 40 needs efSearch 384 (0.78 ms), for about 2x the build time
# (docs/benchmarks.md, issue 20).
HNSW_EF_CONSTRUCTION = 200
HNSW_M = 32  # links per vector and layer (twice that on the bottom layer)
# int8-direct: one scale for every number, so that faiss reads a stored number as it is (no per-dimension
# offset and step to apply, as its trained SQ8 does). On 208,041 minilm-l6 vectors (384 numbers) an HNSW32 walk
# at efSearch 72 plus the float16 rescoring of 12 took 0.156 ms a query, against 0.184 ms for the float32
# graph's walk at efSearch 64 (1.18x, in turns), at 99% of flat's top 10 both (docs/benchmarks.md, "int8 under
# one scale", 2026-11-24 10:16). The scale puts all but a 1e-5 share of the numbers inside +-127; those few are
# clipped.
INT8_DIRECT_QUANTILE = 0.99999


def factory_string(kind: str, storage: str, n_vectors: int) -> str:
    """The faiss index_factory description of an index kind with a storage type."""
    if kind not in INDEX_KINDS:
        raise IndexBuildError(f"--index {kind!r}: choose one of {', '.join(INDEX_KINDS)}")
    if storage not in STORAGES:
        raise IndexBuildError(f"--storage {storage!r}: choose one of {', '.join(STORAGES)}")
    if storage == "binary":  # faiss's binary indexes: Hamming distance on sign bits
        return {"flat": "BFlat", "hnsw": f"BHNSW{HNSW_M}", "ivf": f"BIVF{ivf_lists(n_vectors)}"}[kind]
    code = {"float32": "Flat", "float16": "SQfp16", "int8": "SQ8", "int8-direct": "SQ8_direct_signed"}[storage]
    if kind == "flat":
        return code
    if kind == "hnsw":
        return f"HNSW{HNSW_M}" if storage == "float32" else f"HNSW{HNSW_M}_{code}"
    return f"IVF{ivf_lists(n_vectors)},{code}"


def ivf_lists(n_vectors: int) -> int:
    """About 4 sqrt(n) inverted lists, with at least 39 training points per list (faiss's own minimum)."""
    return max(1, min(int(4 * np.sqrt(max(n_vectors, 1))), n_vectors // 39))


def sign_bits(vectors: np.ndarray) -> np.ndarray:
    """One bit per number (1 where it is positive), packed eight to a byte: what a binary index stores."""
    return np.packbits(np.asarray(vectors) > 0, axis=1)


def make_index(vectors: np.ndarray, kind: str, storage: str, ef_construction: int = HNSW_EF_CONSTRUCTION):
    """A trained faiss index holding `vectors` (unit rows, float32), searchable by inner product; with
    binary storage, a faiss binary index of their sign bits, searched by Hamming distance; with int8-direct,
    their int8 codes under one scale, searched by L2 distance (the same order as cosine for unit vectors)."""
    import faiss

    n, d = vectors.shape
    if storage == "binary":
        bits = sign_bits(vectors)  # d bits padded with zeros to whole bytes: padding never changes a distance
        index = faiss.index_binary_factory(8 * bits.shape[1], factory_string(kind, storage, n))
        if kind == "hnsw":
            index.hnsw.efConstruction = ef_construction
        if not index.is_trained:
            index.train(bits)
        index.add(bits)
        return index
    if storage == "int8-direct":
        return int8_direct_index(vectors, kind, ef_construction)
    index = faiss.index_factory(d, factory_string(kind, storage, n), faiss.METRIC_INNER_PRODUCT)
    if kind == "hnsw":
        faiss.downcast_index(index).hnsw.efConstruction = ef_construction
    if not index.is_trained:
        index.train(vectors)
    index.add(vectors)
    if kind == "ivf":
        faiss.extract_index_ivf(index).make_direct_map()  # lets the cascade read stored vectors back by id
    return index


def int8_direct_index(vectors: np.ndarray, kind: str, ef_construction: int = HNSW_EF_CONSTRUCTION):
    """`vectors` times one scale, rounded and clipped to int8, in a faiss SQ8_direct_signed index (L2), behind a
    transform that multiplies each query by the same scale. So the file alone searches like the others (unit
    float queries in), and faiss's direct codec, which truncates and wraps around outside +-128, only ever
    receives whole numbers within +-127. L2, not inner product: faiss 1.15.1 returns 0 for every inner
    product with the direct int8 codecs; for unit vectors L2 ranks as cosine does."""
    import faiss

    n, d = vectors.shape
    scale = 127.0 / max(float(np.quantile(np.abs(vectors), INT8_DIRECT_QUANTILE)), 1e-12)
    codes = np.clip(np.rint(vectors * scale), -127, 127).astype(np.float32)
    inner = faiss.index_factory(d, factory_string(kind, "int8-direct", n), faiss.METRIC_L2)
    if kind == "ivf":  # the codes themselves, not their (fractional) residuals from the list's centroid
        faiss.extract_index_ivf(inner).by_residual = False
    if kind == "hnsw":
        # The graph's links come from the float vectors (inner product; for unit vectors the same neighbours
        # as L2), and only the stored numbers are int8. On 208,041 minilm-l6 vectors a graph built over the
        # int8 codes kept 98.86% and 99.00% of flat's top 10 at efSearch 64 and 72 (shortlist 16); this one
        # 98.96% and 99.11%.
        graph = faiss.IndexHNSWFlat(d, HNSW_M, faiss.METRIC_INNER_PRODUCT)
        graph.hnsw.efConstruction = ef_construction
        graph.add(vectors)
        view = faiss.downcast_index(inner)  # a view: `inner` owns the C++ index and must outlive it
        view.hnsw = graph.hnsw  # a copy of the links, and of the float graph's flag that larger is better:
        view.hnsw.is_similarity = False  # here, a smaller L2 distance is (faiss sets this again on reading)
        view.storage.add(codes)
        view.ntotal = view.storage.ntotal
    else:
        if not inner.is_trained:
            inner.train(codes)
        inner.add(codes)
    if kind == "ivf":
        faiss.extract_index_ivf(inner).make_direct_map()
    scaling = faiss.LinearTransform(d, d, False)
    faiss.copy_array_to_vector((scale * np.eye(d, dtype=np.float32)).ravel(), scaling.A)
    faiss.copy_array_to_vector(np.zeros(d, dtype=np.float32), scaling.b)
    scaling.is_trained = True
    index = faiss.IndexPreTransform(scaling, inner)
    index.ntotal = inner.ntotal  # the vectors went into `inner` already scaled and rounded
    return index


class ScaledQueryIndex:
    """An int8-direct index as it is searched: each query is multiplied by the file's one scale here, and the
    inner index is searched directly. faiss's IndexPreTransform would apply the scale as a dense d x d matrix
    product (BLAS) per query, which on 384 numbers cost 0.04 ms and more with BLAS's threads: more than the
    whole HNSW walk it saves time on (0.12 ms at efSearch 64; docs/benchmarks.md, issue 20)."""

    def __init__(self, owner, scale: float):
        import faiss

        self.owner = owner  # the Python object that owns the C++ index: the views below die with it
        wrapped = faiss.downcast_index(owner)
        self.inner = faiss.downcast_index(wrapped.index)
        self.scale = scale
        self.d, self.ntotal, self.metric_type = wrapped.d, wrapped.ntotal, wrapped.metric_type

    def search(self, queries: np.ndarray, k: int):
        return self.inner.search(np.ascontiguousarray(queries * self.scale, dtype=np.float32), k)


def searchable(index):
    """What a search should call for a faiss index read from a file: int8-direct's index behind its scaling
    (ScaledQueryIndex), every other index as it is."""
    import faiss

    if isinstance(index, faiss.IndexBinary):
        return index
    view = faiss.downcast_index(index)
    scale = one_scale(view) if isinstance(view, faiss.IndexPreTransform) else None
    return index if scale is None else ScaledQueryIndex(index, scale)


def one_scale(index) -> float | None:
    """The scale by which an IndexPreTransform's only step multiplies every number (int8-direct's), or None
    where its steps do anything else."""
    import faiss

    if index.chain.size() != 1:
        return None
    step = faiss.downcast_VectorTransform(index.chain.at(0))
    if not isinstance(step, faiss.LinearTransform) or step.d_in != step.d_out:
        return None
    matrix = faiss.vector_to_array(step.A).reshape(step.d_out, step.d_in)
    if not np.array_equal(matrix, matrix[0, 0] * np.eye(step.d_in, dtype=matrix.dtype)):
        return None
    return float(matrix[0, 0])


def hnsw_graph(index):
    """The HNSW structure of a faiss index (float, quantised, binary, or behind int8-direct's query transform),
    or None for an index without one. It is a view into `index`, valid while `index` is alive."""
    import faiss

    if isinstance(index, ScaledQueryIndex):
        index = index.inner
    if isinstance(index, faiss.IndexBinary):
        return getattr(index, "hnsw", None)
    index = faiss.downcast_index(index)
    if isinstance(index, faiss.IndexPreTransform):
        index = faiss.downcast_index(index.index)
    return getattr(index, "hnsw", None)
