"""The driver's own messages (not the ranks' output), through `logging.getLogger("orchestrator")`.

They are shown on stderr by default, worded "[orchestrator] ..." or "[JOB] ...". A user
silences them with standard logging (`logging.getLogger("orchestrator").setLevel(
logging.ERROR)`) or sends them elsewhere (replace the logger's handlers, or set
`propagate = True` and remove ours to use the root logger's). The default handler
writes to whatever `sys.stderr` is when a message is emitted, so in a notebook a
message lands in the cell that caused it, and a redirected stderr gets it.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("orchestrator")


IN_PLACE = "orchestrator_in_place"
"""A record with this attribute true is drawn over the last one so drawn (a status line)."""
_drawn = False
"""Whether a line drawn in place is on the terminal now."""


class _CurrentStderr(logging.Handler):
    """Writes each record to the sys.stderr of the moment (a notebook cell's, a redirect)."""

    def emit(self, record: logging.LogRecord) -> None:
        """Print the formatted record and flush; an IN_PLACE one without its newline."""
        global _drawn  # noqa: PLW0603 - one terminal line per process
        try:
            text = self.format(record)
            if getattr(record, IN_PLACE, False):
                sys.stderr.write(f"\r\x1b[K{text}")
                sys.stderr.flush()
                _drawn = True
                return
            clear_in_place()
            print(text, file=sys.stderr, flush=True)
        except Exception:  # noqa: BLE001 - logging's own policy for a failing handler
            self.handleError(record)


def clear_in_place() -> None:
    """Erase a line drawn in place (a status line) before other output takes the terminal."""
    global _drawn  # noqa: PLW0603 - one terminal line per process
    if _drawn:
        _drawn = False
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()


def _install() -> None:
    if any(isinstance(handler, _CurrentStderr) for handler in logger.handlers):
        return
    handler = _CurrentStderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)
    logger.propagate = False  # shown once, by the handler above, unless the user says so


_install()


def say(message: str, *, job: str | None = None, level: int = logging.INFO) -> None:
    """Tell the user `message`, as "[orchestrator] ..." or, about one job, "[JOB] ..."."""
    logger.log(level, "[%s] %s", job or "orchestrator", message)


def warn(message: str, *, job: str | None = None) -> None:
    """Say `message` at WARNING level: something the user may want to change."""
    say(message, job=job, level=logging.WARNING)
