"""Training methods, one short file each: which views get the loss at each step, plus extra terms."""

from matryoshka2d.methods.asymmetric import Asymmetric
from matryoshka2d.methods.base import Method, Plan
from matryoshka2d.methods.ese import ESE
from matryoshka2d.methods.mrl import MRL
from matryoshka2d.methods.plain import Plain
from matryoshka2d.methods.separate import Separate
from matryoshka2d.methods.starbucks import Starbucks
from matryoshka2d.methods.twodmse import TwoDMSE

METHODS: dict[str, type[Method]] = {m.name: m for m in (Plain, MRL, TwoDMSE, ESE, Starbucks, Separate)}
METHODS[Asymmetric.name] = Asymmetric  # shallow queries, deep documents (retrieval)


def make_method(name: str, num_layers: int, hidden_size: int, **options) -> Method:
    if name not in METHODS:
        raise ValueError(f"Unknown method '{name}'; choose one of {', '.join(METHODS)}")
    return METHODS[name](num_layers, hidden_size, **options)


__all__ = ["METHODS", "Method", "Plan", "make_method"]
