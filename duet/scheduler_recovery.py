"""A failed step's requests found out one by one: the step is rolled back, its requests start
over as suspects, each run alone (the others held still) until it has passed a step; the one
that fails alone is failed. ``Scheduler`` has these as its own methods; they touch only its
queues, its suspects and its KV cache manager."""

from __future__ import annotations

from duet.outputs import SchedulerOutput
from duet.request import Request, RequestStatus


class StepRecovery:
    """The ``Scheduler``'s isolation of a failed step's requests (its ``suspects``, ``running``,
    ``waiting``, ``requests``, ``kv_cache_manager``, ``_runner_known``, ``_restart`` and
    ``finish_request``)."""

    def _victim(self, request: Request) -> Request:
        """Who gives way when ``request`` finds no free block: the newest running request; while
        a failed step's suspect reruns, the newest of the others (held still, they would never
        free a block for it)."""
        if self.suspects and request.request_id == self.suspects[0]:
            others = [running for running in self.running if running is not request]
            if others:
                return others[-1]
        return self.running[-1]

    def _may_run(self, request: Request) -> bool:
        """While a failed step's requests are being rerun, only the first of them runs."""
        return not self.suspects or request.request_id == self.suspects[0]

    def reset_step(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """Roll back a step whose execution failed; return the requests failed for it.

        The runner has forgotten the step's requests. A step that ran one suspect alone fails
        that request (``FINISHED_ERROR``). Otherwise every request of the step withdraws the
        blocks the step published before computing them and starts over, as a suspect.
        """
        request_ids = [request_id for request_id in scheduler_output.num_scheduled_tokens if request_id in self.requests]
        self._runner_known -= set(scheduler_output.num_scheduled_tokens)
        if self.suspects and request_ids == self.suspects[:1]:
            request = self.requests[request_ids[0]]
            self.kv_cache_manager.uncache_uncomputed(request)  # or a later prompt reads never-computed KV as a hit
            self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
            return [request]
        restarted = [self.requests[request_id] for request_id in request_ids]
        for request in restarted:
            self.kv_cache_manager.uncache_uncomputed(request)
        for request in restarted:
            if request in self.running:
                self.running.remove(request)
            self._restart(request)
        self.waiting.extendleft(reversed(restarted))
        self.suspects = [request_id for request_id in request_ids if request_id not in self.suspects] + self.suspects
        return []
