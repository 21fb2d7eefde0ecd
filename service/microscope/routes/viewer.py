"""GET /inspect/ui: the viewer's page, the scripts it loads (one route serves every script of
service/microscope/static/ by name), and the docs page it links to."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException

from service.common.errors import APIError

router = APIRouter()

STATIC = resources.files("service.microscope").joinpath("static")
# the names the page's <script> tags load: a request names one of these files, never a path
SCRIPTS = frozenset(f.name for f in STATIC.iterdir() if f.name.endswith(".js"))


@router.get("/inspect/ui", response_class=HTMLResponse, include_in_schema=False)
async def viewer():
    return HTMLResponse(STATIC.joinpath("inspect.html").read_text(encoding="utf-8"))


# The viewer's "what this shows" link. The page lives in the source tree (docs/inspection.md), which `make serve`
# runs from; an installed wheel (the Docker image) carries no docs/, and says where to read them instead.
INSPECTION_DOC = Path(__file__).resolve().parents[3] / "docs" / "inspection.md"


@router.get("/inspect/ui/docs", include_in_schema=False)
async def viewer_docs():
    if not INSPECTION_DOC.is_file():
        raise APIError(404, "the docs are not installed with this server: read docs/inspection.md in the llamascope "
                            "source tree", code="not_found")
    return Response(INSPECTION_DOC.read_text(encoding="utf-8"), media_type="text/plain; charset=utf-8")


@router.get("/inspect/ui/{name}", include_in_schema=False)
async def viewer_script(name: str):
    if name not in SCRIPTS:  # the 404 of a path no route serves, as for any other
        raise HTTPException(404)
    return Response(STATIC.joinpath(name).read_text(encoding="utf-8"), media_type="text/javascript")
