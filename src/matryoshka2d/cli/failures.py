"""The one line `main` prints for what no reader or check of the toolkit stopped first: running out of memory, a
number past what a library underneath takes, a text that is not Unicode. The readers and converters name the file,
line or option of each case they know (files.py, result_files.py, cli/args.py); this is what remains, said in the
toolkit's words with what the command line can tell (the largest number given), never a library's own message."""

from __future__ import annotations

import re

_NUMBER_GIVEN = re.compile(r"(--[\w-]+)(?:=|\s+)(\d+)")


def largest_number_given(argv: list[str]) -> str | None:
    """'--top-k 3000000000': the option given the largest whole number on the command line, or None."""
    given = [(int(m[2]), f"{m[1]} {m[2]}") for m in _NUMBER_GIVEN.finditer(" ".join(map(str, argv)))]
    return max(given)[1] if given else None


def failure_line(exc: BaseException, argv: list[str]) -> str:
    """What went wrong, in one line, for the failures `main` maps itself (MemoryError, OverflowError, UnicodeError)."""
    largest = largest_number_given(argv)
    if isinstance(exc, MemoryError):
        named = f" (the largest number given: {largest})" if largest else ""
        return f"not enough memory for what was asked{named}; ask for less, or run it where there is more memory"
    if isinstance(exc, OverflowError):
        named = f" (the largest number given: {largest})" if largest else ""
        return f"a number past what the libraries underneath take{named}; give a smaller one"
    if isinstance(exc, UnicodeEncodeError):
        char = exc.object[exc.start]
        near = exc.object[max(0, exc.start - 30) : exc.start + 30].encode("utf-8", "backslashreplace").decode()
        return (
            f"a text holds '\\u{ord(char):04x}', half of a surrogate pair standing alone, which is no character and "
            f"cannot be written as UTF-8 (near {near!r}); it came from an input (a JSON escape, or a name given on "
            "the command line): remove it there"
        )
    if isinstance(exc, UnicodeDecodeError):
        return f"an input is not UTF-8 text (byte {exc.object[exc.start]:#04x}); save it as UTF-8"
    return f"a text that is not Unicode ({type(exc).__name__})"
