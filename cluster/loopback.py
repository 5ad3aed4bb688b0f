"""Keep a local cluster's Serve replicas on 127.0.0.1.

Ray 2.60's Serve replica starts an inter-deployment gRPC server on ``[::]:0``, hard-coded in
``ray/serve/_private/replica.py``, whatever the node's address: on a local cluster that is the
one port per replica left listening beyond loopback. A replica constructs its user class before
it starts that server, so each duet deployment calls ``keep_replica_on_loopback()`` first; on a
loopback cluster (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, see ``duet.cluster.deploy``) it
rebinds the server's address to 127.0.0.1. Anywhere else it does nothing.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

LOOPBACK_RAY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": Ray's node address is 127.0.0.1


def keep_replica_on_loopback() -> None:
    if os.environ.get(LOOPBACK_RAY_ENV) != "0":
        return
    from ray.serve._private import replica

    bind = getattr(replica, "add_port_to_grpc_server", None)
    if bind is None or getattr(bind, "loopback_only", False):
        if bind is None:
            logger.warning("this Ray's Serve replica has no add_port_to_grpc_server: its gRPC port may listen beyond loopback")
        return

    def loopback_only(server, address: str):
        return bind(server, address.replace("[::]", "127.0.0.1", 1))

    loopback_only.loopback_only = True
    replica.add_port_to_grpc_server = loopback_only
