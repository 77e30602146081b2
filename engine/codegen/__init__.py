"""TileLang code generation from the traced IR."""
