"""The variant libraries: attention (library.py) and linear attention (linear.py)."""

from engine.variants.base import SpecParts, Variant
from engine.variants.library import VARIANTS
from engine.variants.linear import LINEAR_VARIANTS, LinearVariant, get_linear_variant


def get_variant(name: str) -> Variant:
    """The variant called `name`; a ValueError lists the known names otherwise."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(
            f"unknown variant {name!r}; known: {', '.join(sorted(VARIANTS))}"
        ) from None


__all__ = ["LINEAR_VARIANTS", "VARIANTS", "LinearVariant", "SpecParts", "Variant",
           "get_linear_variant", "get_variant"]
