"""POST /v1/responses (OpenAI's Responses API), run as a chat completion (service/api/openai/responses/input.py), its reply
spoken as output items and typed events (service/api/openai/responses/output.py); GET and DELETE /v1/responses/{response_id}
on the stored ones (service/api/openai/responses/store.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, StreamingResponse

from model.engine import RequestOutput
from service.common.errors import APIError
from service.api.openai.prepare import prepare_chat
from service.api.openai.responses.input import chat_request, in_responses_terms, input_items, output_items
from service.api.openai.responses.output import ResponseOutput, event_text, response_usage
from service.api.openai.responses.schemas import ResponsesRequest
from service.api.openai.responses.store import StoredResponse
from service.common.runner import RunStats, collect, finish, start
from service.common.serving import Serving, get_serving

router = APIRouter()


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no stored response {response_id!r} (never stored, deleted, or dropped as the least "
                         f"recently used past --max-stored-responses)", param=param, code="response_not_found")


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, request: Request, serving: Serving = Depends(get_serving)):
    adapter = serving.check_model(req.model, adapters=True)
    model = adapter or serving.model_name  # the base's name, or the adapter's
    conversation: list[dict] = []
    if req.previous_response_id is not None:
        previous = serving.responses.get(req.previous_response_id)
        if previous is None:
            raise _not_found(req.previous_response_id, "previous_response_id")
        conversation = list(previous.conversation)
    conversation += input_items(req)
    stats = RunStats("responses")
    try:
        run = await prepare_chat(serving, chat_request(req, conversation), adapter)
        out = ResponseOutput(serving.tokenizer, run.plan, req, stats.request_id, model)
        outputs = await start(serving, [run.prompt], run.params, stats, run.options)  # refusals raise here
    except APIError as e:
        raise in_responses_terms(e) from None

    def keep(response: dict) -> dict:
        if req.store and response["status"] != "failed":
            serving.responses.put(StoredResponse(response, conversation + output_items(response["output"])))
        return response

    if req.stream:
        return StreamingResponse(_events(serving, stats, outputs, out, keep), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    reasons = await collect(request, serving, stats, outputs, lambda _, o: out.add(o))
    usage = response_usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
    return JSONResponse(keep(out.response(out.status(reasons.get(0)), usage)))


async def _events(serving: Serving, stats: RunStats, outputs: AsyncIterator[tuple[int, RequestOutput]],
                  out: ResponseOutput, keep) -> AsyncIterator[str]:
    """The stream: created and in_progress, each output's events, then the whole response in the last event (OpenAI
    sends no `[DONE]` here). A failed generation ends it with `response.failed`; the client leaving aborts the
    request at once (as runner.stream_response does for the other routes)."""
    status, reason, error = 200, None, None
    try:
        for event in out.head():
            yield event_text(event)
        async for _, o in outputs:
            error = error or o.error
            for event in out.add(o):
                yield event_text(event)
            reason = o.finish_reason or reason
        usage = response_usage(stats.prompt_tokens, stats.completion_tokens, stats.cached_tokens)
        last = out.tail(reason, usage, error)
        keep(last["response"])
        status = 500 if error else 200
        yield event_text(last)
    except Exception:  # the engine failed mid-stream
        status = 500
        yield event_text(out.tail(None, None, "generation failed"))
    finally:
        finish(serving, stats, status if len(stats.finish_reasons) == 1 or status != 200 else 499)
        await outputs.aclose()  # at once, not at GC time: a client that left is aborted now


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, serving: Serving = Depends(get_serving)):
    entry = serving.responses.get(response_id)
    if entry is None:
        raise _not_found(response_id)
    return JSONResponse(entry.response)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, serving: Serving = Depends(get_serving)):
    if not serving.responses.delete(response_id):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}
