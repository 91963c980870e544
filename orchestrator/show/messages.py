"""The driver's own messages (not the ranks' output), through `logging.getLogger("orchestrator")`.

Worded "[orchestrator] ..." or "[JOB] ...". This library adds no handler: at each message
it looks whether the application has set up logging (a handler on the way from our
logger to the root, as `logging.basicConfig` or pytest add). If it has, the message goes
through logging, and the application's handlers, levels and format decide. If not, it is
printed to whatever `sys.stderr` is at that moment (a notebook cell's, a redirect), as
`logging.lastResort` does for warnings. Our logger's level is INFO unless the
application sets another: `logging.getLogger("orchestrator").setLevel(logging.ERROR)`
silences them either way.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("orchestrator")
if logger.level == logging.NOTSET:
    logger.setLevel(logging.INFO)  # shown by default; the application may set another

_drawn = False
"""Whether a line drawn in place is on the terminal now."""


def configured(log: logging.Logger = logger) -> bool:
    """Whether the application handles `log`'s records: a handler on the way to the root."""
    node: logging.Logger | None = log
    while node is not None:
        if node.handlers:
            return True
        if not node.propagate:
            return False
        node = node.parent
    return False


def emit(log: logging.Logger, level: int, text: str, *, in_place: bool = False) -> None:
    """`text` through `log` where the application handles it, else on the current stderr.

    `in_place`: drawn over the last line so drawn (a status line), on our stderr only.
    """
    global _drawn  # noqa: PLW0603 - one terminal line per process
    if configured(log):
        log.log(level, "%s", text)
        return
    if not log.isEnabledFor(level):
        return
    if in_place:
        sys.stderr.write(f"\r\x1b[K{text}")
        sys.stderr.flush()
        _drawn = True
        return
    clear_in_place()
    print(text, file=sys.stderr, flush=True)


def clear_in_place() -> None:
    """Erase a line drawn in place (a status line) before other output takes the terminal."""
    global _drawn  # noqa: PLW0603 - one terminal line per process
    if _drawn:
        _drawn = False
        sys.stderr.write("\r\x1b[K")
        sys.stderr.flush()


def say(message: str, *, job: str | None = None, level: int = logging.INFO) -> None:
    """Tell the user `message`, as "[orchestrator] ..." or, about one job, "[JOB] ..."."""
    emit(logger, level, f"[{job or 'orchestrator'}] {message}")


def warn(message: str, *, job: str | None = None) -> None:
    """Say `message` at WARNING level: something the user may want to change."""
    say(message, job=job, level=logging.WARNING)
