"""A submitted job's rank output, shown in the notebook cell that submitted it.

A blocking call prints into its own cell like any code. A submitted job keeps
printing while later cells run; plain prints would land in whichever cell runs then,
or be dropped by the front end once the submitting cell is done. So the submitting
cell gets a display (with a display id) that is updated as lines arrive: front ends
update a display wherever it is. Updates are sent with the kernel's current parent
message, not the submitting cell's, because clients such as nbclient only read the
messages of the cell they are executing.
"""

from __future__ import annotations

import contextvars
import sys
import threading
import time
from collections import deque
from typing import Any

MAX_LINES = 1000
"""Lines a cell shows at most; older ones are only in the job's log files."""
_UPDATE_S = 0.25
"""A cell's display is redrawn at most this often."""


def in_kernel() -> bool:
    """Whether this process is a Jupyter kernel (its output goes to notebook cells)."""
    if "ipykernel" not in sys.modules:
        return False
    from IPython import get_ipython

    shell = get_ipython()
    return shell is not None and getattr(shell, "kernel", None) is not None


class CellOutput:
    """The display of the cell that submitted a job, holding the job's newest lines."""

    def __init__(self, title: str) -> None:
        """Show `title` in the current cell; lines written later go below it."""
        from IPython.display import Pretty, display

        self._pretty = Pretty
        self._title = title
        self._lines: deque[str] = deque(maxlen=MAX_LINES)
        self._seen = 0
        self._lock = threading.RLock()
        self._last = 0.0
        self._timer: threading.Timer | None = None
        self._handle: Any = display(Pretty(title), display_id=True)

    def write(self, stream: str, text: str) -> None:
        """Add `text` (whole lines, each ending in a newline) to the cell."""
        with self._lock:
            lines = text.splitlines()
            self._lines.extend(lines)
            self._seen += len(lines)
            wait = self._last + _UPDATE_S - time.monotonic()
            if wait > 0:
                if self._timer is None:
                    self._timer = threading.Timer(wait, self.flush)
                    self._timer.daemon = True
                    self._timer.start()
                return
        self.flush()

    def set_title(self, title: str) -> None:
        """Change the first line (the job's state) and redraw."""
        with self._lock:
            self._title = title
        self.flush()

    def flush(self) -> None:
        """Redraw the cell with every line so far."""
        with self._lock:  # held while sending too, so that redraws arrive in order
            self._timer = None
            self._last = time.monotonic()
            hidden = self._seen - len(self._lines)
            head = [self._title]
            if hidden:
                head.append(f"... {hidden} earlier line(s) are in the job's log files")
            text = "\n".join([*head, *self._lines])
            # An empty context: the kernel's current parent message, not the submitter's.
            contextvars.Context().run(self._handle.update, self._pretty(text))
