"""A follower's link to a detached job's supervisor: questions asked with a time limit,
through a network that may be down for minutes and a Ray Client session the cluster may
end (the supervisor is then found again by name in a new one); the supervisor's loss said
as `SupervisorLostError`."""

from __future__ import annotations

import time
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from orchestrator.connect import cluster
from orchestrator.errors import SupervisorLostError
from orchestrator.show import messages
from orchestrator.supervise.supervisor import NAMESPACE

RETRY_S = 1.0
"""While the supervisor cannot be reached (the network is down), how often to try again."""
ASK_TIMEOUT_S = 30.0
"""How long one question to the supervisor may take before it counts as unreachable."""


class SupervisorLink:
    """Job `job_id`'s link to its supervisor, the actor named `supervisor` (`handle`)."""

    def __init__(self, job_id: str, name: str, supervisor: str, handle: Any) -> None:
        """A link through `handle`, made in this Ray session; `name`: the job's, for what
        it says."""
        self.job_id, self.name, self.supervisor = job_id, name, supervisor
        self.handle = handle
        self.session = cluster.session()
        """The Ray session `handle` belongs to (see `cluster.rejoin`)."""
        self.down_since: float | None = None
        """Since when the supervisor does not answer (None: it does)."""

    def ask(self, method: str, *args: Any) -> Any:
        """The supervisor's method `method` on this job, called with `args`; its answer."""
        try:
            try:
                call = getattr(self.handle, method).remote(self.job_id, *args)
                return ray.get(call, timeout=ASK_TIMEOUT_S)
            except Exception as exc:  # Ray Client's session lost: once more, in a new one
                if not (cluster.lost_session(exc) or self.void(exc)) or not self.reconnect():
                    raise
                call = getattr(self.handle, method).remote(self.job_id, *args)
                return ray.get(call, timeout=ASK_TIMEOUT_S)
        except RayActorError as exc:
            raise SupervisorLostError(f"job {self.job_id}: its supervisor is gone") from exc

    def unreachable(self, exc: BaseException) -> None:
        """The supervisor did not answer (the network is down; or Ray Client's session was
        lost, and a new one is tried): say so once, and wait to try again."""
        lost = cluster.lost_session(exc) or self.void(exc)
        answered = isinstance(exc, RayTaskError)  # the supervisor raised: no network matter
        if answered or not (lost or isinstance(exc, (RayError, GetTimeoutError))):
            raise exc
        if self.down_since is None:
            self.down_since = time.monotonic()
            why = (
                f"lost this driver's Ray Client session ({exc}); connecting again"
                if lost
                else f"cannot reach the supervisor of {self.job_id} ({type(exc).__name__}); "
                "trying again"
            )
            messages.say(f"{why} every {RETRY_S:g} s (the job runs on)", job=self.name)
        if not (lost and self.reconnect()):
            time.sleep(RETRY_S)

    def reached(self) -> None:
        """The supervisor answered: say so where it did not before."""
        if self.down_since is not None:
            messages.say(f"reached the supervisor of {self.job_id} again", job=self.name)
            self.down_since = None

    def void(self, exc: BaseException) -> bool:
        """Whether `handle` is void: another thread made a new session (Ray Client says first)."""
        return self.session != cluster.session() or cluster.void_handle(exc)

    def reconnect(self) -> bool:
        """After Ray Client's session was lost: a new one (see `cluster.rejoin`), and the
        supervisor found again by name. False while the cluster cannot be reached."""
        if not cluster.rejoin(self.session):
            return False
        try:
            handle = ray.get_actor(self.supervisor, namespace=NAMESPACE)
        except ValueError:  # connected, and the supervisor is gone
            raise SupervisorLostError(
                f"job {self.job_id}: its supervisor is gone (found again after this driver's "
                "Ray Client session was lost): the node that supervised it died or the actor "
                "was killed meanwhile"
            ) from None
        except ConnectionError:
            return False
        self.handle, self.session = handle, cluster.session()
        return True
