"""The dashboard: one self-contained HTML page plus a markdown summary (`attnbench report`)."""
