"""``python -m graphc``: the graphc command line."""

from .cli import main_entry

main_entry()
