"""Rich consoles that wrap only on a terminal.

Rich wraps everything at the terminal width, and at 80 columns when the output is a pipe or a
file. A line a user pipes into ``grep`` (or a test reads) must not break at a point that moves
with the length of a path, so when the stream is not a terminal the width is unbounded and
every line comes out whole; on a terminal rich behaves as usual. The check is made at each
print, since the stream behind a console can change after it is made (pytest's capture does).
"""

from __future__ import annotations

import copy

from rich.console import Console, ConsoleDimensions
from rich.table import Table

__all__ = ["UNWRAPPED_WIDTH", "Output"]

# Wide enough that no line or table the CLI prints is ever folded; tables still take only the
# width of their content (none of them sets ``expand``).
UNWRAPPED_WIDTH = 100_000


class Output(Console):
    """A ``rich.console.Console`` whose lines are never wrapped when it is not a terminal."""

    @property
    def size(self) -> ConsoleDimensions:
        dimensions = super().size
        if self.is_terminal:
            return dimensions
        # Not a terminal: neither the 80-column default nor COLUMNS (which rich reads at
        # construction, when the stream may still have been a terminal) folds a line.
        return ConsoleDimensions(UNWRAPPED_WIDTH, dimensions.height)

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size

    def print_table(self, table: Table) -> None:
        """Print ``table`` with its title on a line of its own: rich folds a title to the width
        of its table, which would split a long path however wide the console is."""
        if table.title is not None:
            self.print(table.title, highlight=False, style="bold")
            table = copy.copy(table)
            table.title = None
        self.print(table)
