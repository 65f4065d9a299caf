"""The texts a model is distilled on, or heads are fitted and a ladder calibrated on: the distinct texts of any
source in order. Training data of any kind (TSV or JSONL of triplets, NLI or scored pairs; its texts, labels
ignored), plain text files (one sentence per line), or a BEIR corpus (a folder holding corpus.jsonl, or the file),
whose documents are cut into passages of a chosen number of tokens: what a query encoder meets are short texts.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from matryoshka2d.beir import find_corpus, read_beir_file
from matryoshka2d.training.data import read_sentences


def passages(text: str, tokenizer, max_tokens: int) -> list[str]:
    """`text` cut into pieces of at most `max_tokens` tokens each, special tokens included (so each piece is
    encoded whole), at whitespace between words where the window has any (a word longer than a window is cut inside);
    pieces are slices of the original text, casing and spacing kept."""
    room = max(1, max_tokens - tokenizer.num_special_tokens_to_add())
    try:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)[
            "offset_mapping"
        ]
    except NotImplementedError:  # a slow tokenizer has no offsets: keep the text whole (it is truncated later)
        return [text]
    if len(offsets) <= room:
        return [text]
    out, begin = [], 0
    while begin < len(offsets):
        end = min(begin + room, len(offsets))  # tokens begin..end-1
        if end < len(offsets):
            # the last token of the window after which whitespace follows: a word is not split
            gaps = [k for k in range(end - 1, begin, -1) if offsets[k + 1][0] > offsets[k][1]]
            end = gaps[0] + 1 if gaps else end
        piece = text[offsets[begin][0] : offsets[end - 1][1]].strip()
        if piece:
            out.append(piece)
        begin = end
    return out


def read_texts(sources: Iterable[str], tokenizer=None, max_tokens: int | None = None) -> Iterator[str]:
    """Distinct texts of every source in order: training data of any kind (TSV or JSONL of triplets, NLI or scored
    pairs), plain text files (one sentence per line), or a BEIR corpus (a folder holding corpus.jsonl, or the file):
    its documents' title and text, split into passages of at most `max_tokens` tokens when a tokenizer is given."""
    seen: set[str] = set()
    for source in sources:
        path = Path(source)
        if not path.exists():
            raise FileNotFoundError(f"--data {source}: no such file or folder")
        corpus = find_corpus(path)
        if corpus is not None:
            documents = (text for _, _, text in read_beir_file(corpus, titles=True))
            if tokenizer is not None and max_tokens:
                texts: Iterator[str] = (p for text in documents for p in passages(text, tokenizer, max_tokens))
            else:
                texts = documents
        elif path.is_dir():
            raise ValueError(f"--data {source}: a folder, but not a BEIR corpus (no corpus.jsonl in it)")
        else:
            texts = iter(read_sentences(path))
        for text in texts:
            if text.strip() and text not in seen:
                seen.add(text)
                yield text
