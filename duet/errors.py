"""The errors that cross from an engine to the router, and the router's own when no pool can take
a request, importable without torch. Each says, in its message, what went wrong and what to
change; the router turns each into an HTTP status."""

from __future__ import annotations


class ConfigError(ValueError):
    """A setting is out of range or inconsistent; the message says what to change."""


class InvalidRequestError(ValueError):
    """The request cannot be served as given (HTTP 400); ``param`` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ReplicaFullError(RuntimeError):
    """The replica has no KV room for this request right now; another replica or a later try may."""


class KVTransferFailedError(RuntimeError):
    """The prompt's KV never reached the decode replica, and the policy is to fail the request."""


class ReplicaGoneError(RuntimeError):
    """A call pinned to a replica that no longer runs; what it held there is gone with it."""

    @classmethod
    def check(cls, replica_id: str, here: str) -> None:
        """Refuse a pinned call that Serve routed here because its replica is gone."""
        if replica_id != here:
            raise cls(f"replica {replica_id} is gone")


class PoolUnavailableError(RuntimeError):
    """No replica of a pool could take the request; the client should retry later (HTTP 503)."""


class RequestFailedError(RuntimeError):
    """The engine failed on this request, with it alone in a step; the others went on (HTTP 500)."""


class WorkerDiedError(RuntimeError):
    """A worker of the engine (one of its ranks) is gone: no step can run until the replica is replaced."""


class CheckpointError(ValueError):
    """A model that cannot be loaded; the message names the path, the tensor or the config field."""


class UnsupportedCheckpointError(CheckpointError):
    """A checkpoint duet does not run: its architecture, or a part its config asks for."""


class DamagedCheckpointError(CheckpointError):
    """A checkpoint that disagrees with itself: a missing tensor, or a shape its config does not give."""
