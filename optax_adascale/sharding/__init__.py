"""Sharded parameters and state: the reduction strategies (replicated, ZeRO rows, FSDP), the ZeRO update, FSDP under
``shard_map`` and the tensor-parallel checks. Internal: the public names are ``optax_adascale.__all__``."""
