"""Result rows: the schema, and the store that appends them atomically."""
