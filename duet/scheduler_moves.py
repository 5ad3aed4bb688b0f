"""Moving a running sequence off a scheduler: held still between two decode steps, then its KV
shipped to another replica (``decode_node.migration`` drives it through ``LLMEngine``), or let go
on here. ``Scheduler`` has these as its own methods; they touch only its queues and its KV
connector."""

from __future__ import annotations

from duet.request import RequestStatus


class SequenceMoves:
    """The ``Scheduler``'s moves (its ``requests``, ``running``, ``kv_connector`` and
    ``finish_request``)."""

    def freeze(self, request_id: str) -> list[int] | None:
        """Hold a running sequence still, its KV about to move to another replica; return its
        output tokens. None when it is not between two decode steps (waiting, preempted, in
        its prompt): it can move only by recompute."""
        request = self.requests.get(request_id)
        if (
            request is None or request.status != RequestStatus.RUNNING or not request.output_token_ids
            or request.num_computed_tokens != request.num_tokens - 1
        ):  # a prompt chunk that ended one token short passes the last test alone
            return None
        self.running.remove(request)
        request.status = RequestStatus.MIGRATING
        request.spec_token_ids = []
        return list(request.output_token_ids)

    def unfreeze(self, request_id: str) -> None:
        """Let a frozen sequence go on here: its move did not happen."""
        request = self.requests.get(request_id)
        if request is not None and request.status == RequestStatus.MIGRATING:
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def migrate(self, request_id: str, destination) -> bool:
        """Ship a frozen sequence's KV to ``destination`` (``KVDestination``) and end it here."""
        request = self.requests.get(request_id)
        if request is None or request.status != RequestStatus.MIGRATING:
            return False
        request.kv_send = destination
        self.kv_connector.start_send(request, computed=True)
        self.finish_request(request_id, RequestStatus.FINISHED_MIGRATED)
        return True
