"""POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter: LoRA adapters loaded and unloaded while serving, as
vLLM's endpoints (its `lora_name` / `lora_path` bodies, a plain-text answer). Mounted only with
--enable-lora-runtime-updates."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from service.common.serving import Serving, get_serving

router = APIRouter()


class LoadLoRARequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRARequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body; its optional lora_int_id is accepted and not used)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRARequest, serving: Serving = Depends(get_serving)):
    await serving.load_adapter(req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRARequest, serving: Serving = Depends(get_serving)):
    await serving.unload_adapter(req.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
