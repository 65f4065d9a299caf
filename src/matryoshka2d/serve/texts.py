"""A request's texts on their way to the model: bounded by their characters before the tokenizer sees them, then
tokenized once (the token ids go to the backend, which does not tokenize again), checked against the model's
length, or cut as the tokenizer cuts them with --truncate.

Pure functions of the texts and a tokenizer: the engine (serve/engine.py) calls them on the event loop for a short
request and on its tokenizer thread for a long one.
"""

from __future__ import annotations

from matryoshka2d.serve.protocol import ApiError

# The characters per token of a text's maximum length past which a text is refused (or cut, with --truncate) before
# it is tokenized: English prose is 4-5 characters a WordPiece token, code and URLs up to about 8; 32 leaves room
# for any text a model reads, and keeps one text's tokenizing to milliseconds (an 8 MB text took 8 s of the event
# loop before it was refused, with /health waiting behind it).
CHARS_PER_TOKEN = 32
# A request of more characters than this is tokenized on a thread of its own, not on the event loop: about 2 ms of
# tokenizing (minilm-l6's tokenizer reads 1-2 MB a second on this machine), the most one request may hold the loop
# for; a query of a few words stays on the loop, where it costs no hand-over between threads.
OFF_LOOP_CHARS = 4096


def within_characters(texts: list[str], limit: int, max_length: int, truncate: bool) -> tuple[list[str], set[int]]:
    """The texts the tokenizer may see, and which of them were cut. A text longer than `limit` characters is a 400
    without being tokenized (its length in tokens need not be known to refuse it), or, with --truncate, is cut
    there first, at the last whitespace before the bound when there is one, so the tokens it keeps are the whole
    text's first ones (`tokenized` checks it still holds more than the model's `max_length` tokens)."""
    if max(map(len, texts)) <= limit:
        return texts, set()
    over = [i for i, text in enumerate(texts) if len(text) > limit]
    if not truncate:
        i = over[0]
        raise ApiError(
            400,
            f"input[{i}] has {len(texts[i])} characters, more than the {limit} this server reads per input "
            f"({len(over)} input(s) too long): far more than this model's maximum input length of {max_length} "
            "tokens. Shorten it (the server runs without --truncate; --max-input-chars sets this bound)",
            "input",
            "context_length_exceeded",
        )
    texts = list(texts)
    for i in over:
        head = texts[i][:limit]
        space = max(head.rfind(" "), head.rfind("\n"), head.rfind("\t"))
        texts[i] = head[:space] if space > limit // 2 else head
    return texts, set(over)


def token_ids(counter, texts: list[str]) -> dict:
    """What `counter(texts, add_special_tokens=True)` gives (each text's ids, neither cut nor padded), from a fast
    tokenizer's Rust backend without the Python wrapper around it where that is the same: one SciFact query took
    the wrapper 0.42 ms of the event loop's time inside a loaded server (its cache cold after each model call), more
    than the rest of the route's own work, and the backend alone takes under half of its time. A backend set to cut
    or pad (by its tokenizer.json, or by a call with truncation) goes through the wrapper, which sets it back."""
    backend = getattr(counter, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is None or backend.truncation is not None or backend.padding is not None:
        return dict(counter(texts, add_special_tokens=True, verbose=False))
    # one call for any number of texts: a batch of one without offsets is a tenth less than the single call that
    # makes them (SciFact queries, one core: 27.8 against 31.1 us, medians of 12 rounds in turns, 2026-11-29)
    encodings = fast(texts, add_special_tokens=True)
    encoded = {"input_ids": [e.ids for e in encodings]}
    if "token_type_ids" in counter.model_input_names:
        encoded["token_type_ids"] = [e.type_ids for e in encodings]
    if "attention_mask" in counter.model_input_names:
        encoded["attention_mask"] = [e.attention_mask for e in encodings]
    return encoded


def tokenized(
    counter, texts: list[str], max_length: int, max_chars: int, truncate: bool, cut: set[int] = frozenset()
) -> tuple[dict, list[int], int]:
    """One tokenizer call counts the tokens and gives the model its input: the token ids, the tokens each text
    uses, and how many were cut. A text over the model's `max_length` is a 400, or is cut as the tokenizer cuts
    it with --truncate. `cut`: texts `within_characters` cut to their first `max_chars` characters, each of which
    must still be over the model's length (else its cut would not be the whole text's). `counter`: the tokenizer
    (the event loop's copy, or the tokenizer thread's: a fast tokenizer may not be used by two threads at once)."""
    encoded = token_ids(counter, texts)
    lengths = [len(ids) for ids in encoded["input_ids"]]
    short = [i for i in cut if lengths[i] <= max_length]
    if short:
        i = min(short)
        raise ApiError(
            400,
            f"input[{i}] is over {max_chars} characters, the most this server reads of an input, and those "
            f"make only {lengths[i]} tokens, within this model's maximum input length of {max_length}: cutting it "
            "to its first tokens needs more of it than the server reads. Shorten it (--max-input-chars sets the "
            "bound)",
            "input",
            "context_length_exceeded",
        )
    too_long = [i for i, n in enumerate(lengths) if n > max_length]
    if too_long and not truncate:
        i = too_long[0]
        raise ApiError(
            400,
            f"input[{i}] has {lengths[i]} tokens; this model's maximum input length is {max_length} "
            f"tokens ({len(too_long)} input(s) too long). Shorten it (the server runs without --truncate)",
            "input",
            "context_length_exceeded",
        )
    if too_long:
        cut_ids = counter([texts[i] for i in too_long], truncation=True, max_length=max_length, verbose=False)
        for row, i in enumerate(too_long):
            for k in encoded:
                encoded[k][i] = cut_ids[k][row]
    return encoded, [min(n, max_length) for n in lengths], len(too_long)
