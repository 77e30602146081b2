"""The variant library (see library.py)."""

from engine.variants.base import SpecParts, Variant
from engine.variants.library import VARIANTS


def get_variant(name: str) -> Variant:
    """The variant called `name`; a ValueError lists the known names otherwise."""
    try:
        return VARIANTS[name]
    except KeyError:
        raise ValueError(
            f"unknown variant {name!r}; known: {', '.join(sorted(VARIANTS))}"
        ) from None


__all__ = ["VARIANTS", "SpecParts", "Variant", "get_variant"]
