"""A shard run's cancel checks that outlive a Redis outage instead of throwing the run's work away.

While the rows run, a cancel check that cannot reach Redis (unreachable, out of memory…) answers
"not cancelled": nobody can raise the cancel flag through a Redis that does not answer, and the
rows computed so far are kept. Before the run commits, the check waits for a real answer (with
backoff, up to `COMMIT_WAIT_S`), so a cancel requested just before the outage is still honoured and
nothing is written for a cancelled job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from bulkinfer.jobs.state.repository import JobRepository
from bulkinfer.worker.transient import is_transient

logger = logging.getLogger(__name__)

COMMIT_WAIT_S = 15 * 60  # as long as a retry waits to be published (worker/process/tasks.py)
MAX_POLL_S = 5.0


class CancelCheck:
    def __init__(self, repository: JobRepository, job_id: str,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.repository = repository
        self.job_id = job_id
        self.sleep = sleep
        self.unanswered = 0  # checks Redis could not answer while the rows ran

    def while_running(self) -> bool:
        """Is a cancel requested? An unreachable Redis is "no": the rows go on."""
        try:
            return self.repository.is_cancel_requested(self.job_id)
        except Exception as error:  # noqa: BLE001 - only infrastructure faults are waited out
            if not is_transient(error):
                raise
            if not self.unanswered:
                logger.warning("job %s: Redis does not answer (%s); the shard's rows go on", self.job_id,
                               error)
            self.unanswered += 1
            return False

    def before_commit(self, wait_s: float = COMMIT_WAIT_S) -> bool:
        """Is a cancel requested? Waits out an outage (raising its error after `wait_s`)."""
        started, pause = time.monotonic(), 0.5
        while True:
            try:
                return self.repository.is_cancel_requested(self.job_id)
            except Exception as error:  # noqa: BLE001 - only infrastructure faults are waited out
                if not is_transient(error) or time.monotonic() - started + pause > wait_s:
                    raise
                logger.warning("job %s: Redis does not answer (%s); the computed shard waits to commit",
                               self.job_id, error)
                self.sleep(pause)
                pause = min(pause * 2, MAX_POLL_S)
