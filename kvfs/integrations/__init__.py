"""kvfs plug-ins for inference engines, each loaded by the engine's own plug-in mechanism.

- :mod:`kvfs.integrations.sglang`: a HiCache ``HiCacheStorage`` (``--hicache-storage-backend
  dynamic``);
- :mod:`kvfs.integrations.lmcache`: a ``RemoteConnector`` (``remote_storage_plugins: [kvfs]``);
- :mod:`kvfs.integrations.vllm`: a ``SecondaryTierManager`` for vLLM's KV-offload tiering.

Each module imports its engine, so import only the one whose engine is installed.  The
settings they share are :class:`kvfs.config.EngineConfig`; what the engines have in common
(a blocking client with a short timeout, memoryviews over tensors) lives in :mod:`._common`.
"""
