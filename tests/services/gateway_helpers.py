"""Shared pieces of the gateway tests: a served model, settings, a running gateway."""

from __future__ import annotations

from pathlib import Path

from services.gateway.model import ServedModel
from services.runtime.settings import CommonSettings, GatewaySettings

MODEL_NAME = "tiny"


def gateway_settings(model: Path, redis_url: str, cluster: str, **kw) -> GatewaySettings:
    common = CommonSettings(model=str(model), served_model_name=MODEL_NAME, host="127.0.0.1",
                            redis_url=redis_url, cluster=cluster, heartbeat_interval=0.2, log_level="warning")
    return GatewaySettings(common=common, **kw)


_models: dict[str, ServedModel] = {}


def served_model(model: Path) -> ServedModel:
    if str(model) not in _models:
        _models[str(model)] = ServedModel.load(model, MODEL_NAME)
    return _models[str(model)]
