"""KVConnectorFactory: the connector `kv_connector` names, from raylm's own or from kv_connector_module_path."""
from __future__ import annotations

import importlib

from raylm.configs import EngineConfig
from raylm.runner.kv_transfer.base import KVConnectorBase, KVConnectorRole


class KVConnectorFactory:
    @staticmethod
    def get_connector_class(config: EngineConfig) -> type[KVConnectorBase]:
        kv = config.kv_transfer_config
        assert kv.kv_connector is not None
        if kv.kv_connector_module_path is not None:
            module = importlib.import_module(kv.kv_connector_module_path)
            cls = getattr(module, kv.kv_connector, None)
            if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
                raise ValueError(f"kv_connector: {kv.kv_connector_module_path} has no KVConnectorBase subclass named "
                                 f"{kv.kv_connector!r}")
            return cls
        if kv.kv_connector == "OffloadingConnector":
            from raylm.runner.kv_transfer.offloading_connector import OffloadingConnector

            return OffloadingConnector
        assert kv.kv_connector == "RayKVConnector", f"kv_connector {kv.kv_connector!r} was not checked"
        from raylm.runner.kv_transfer.ray_kv_connector import RayKVConnector

        return RayKVConnector

    @staticmethod
    def create_connector(config: EngineConfig, role: KVConnectorRole) -> KVConnectorBase | None:
        """The engine's connector for `role`, or None without kv_connector."""
        if config.kv_transfer_config.kv_connector is None:
            return None
        return KVConnectorFactory.get_connector_class(config)(config, role)
