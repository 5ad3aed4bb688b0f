"""Moving KV blocks between replicas over pairwise torch.distributed groups (NCCL or gloo).

``connector.KVConnectorWorker`` is the workers' side of the engine's KV connector; it drives a
``sender.KVSender`` and a ``receiver.KVReceiver`` on the worker's own KV cache.
"""
