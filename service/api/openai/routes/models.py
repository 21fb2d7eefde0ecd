"""GET /v1/models (the base model and each adapter served), POST /tokenize, POST /detokenize (vLLM's)."""

from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from service.common.errors import APIError
from service.api.openai.prepare import check_token_ids, render_chat
from service.api.openai.schemas import DetokenizeRequest, TokenizeRequest
from service.common.serving import Serving, get_serving

router = APIRouter()


@router.get("/v1/models")
async def models(serving: Serving = Depends(get_serving)):
    base = {"id": serving.model_name, "object": "model", "created": 0, "owned_by": "llamascope",
            "max_model_len": serving.max_model_len, **serving.precision, "speculative_config": serving.speculative,
            "execution": serving.execution}
    return {"object": "list", "data": [base, *serving.adapters.cards(serving.model_name, serving.max_model_len)]}


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, serving: Serving = Depends(get_serving)):
    serving.check_model(req.model, adapters=True)  # an adapter shares the base's tokenizer
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt", code="invalid_value")
    if req.messages is not None:
        ids = render_chat(serving, req.messages, template_kwargs=req.chat_template_kwargs)
    else:
        ids = serving.tokenizer.encode(req.prompt, add_bos=None if req.add_special_tokens else False)
    return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, serving: Serving = Depends(get_serving)):
    serving.check_model(req.model, adapters=True)
    check_token_ids(req.tokens, serving, "tokens")
    return JSONResponse({"prompt": serving.tokenizer.decode(req.tokens)})
