"""KV connectors (vLLM v1's interface): KV moved between an engine's device pool and other engines or host memory."""
from raylm.runner.kv_transfer.base import KVConnectorBase, KVConnectorRole, kv_layer_name, kv_transfer_params
from raylm.runner.kv_transfer.factory import KVConnectorFactory

__all__ = ["KVConnectorBase", "KVConnectorFactory", "KVConnectorRole", "kv_layer_name", "kv_transfer_params"]
