"""The live visualiser: a page at /viz and the JSON and streaming endpoints behind it.

    routes    the page, its static files, /viz/api/{run,pool,options,estimate}
    events    one run: N users through the AsyncEngine, each engine step an event
    predict   "this machine", the what-if presets, kvlab.estimate's figures for the page
    static/   viz.html, viz.css, viz.js (no build step)

`front_end` mounts `router` on the server: `create_app(engine, [front_end, ...])`. It reads
the engine through `AsyncEngine.snapshot()` (what is served, the KV layout) and the
AsyncEngine's request API, never the engine's parts.
"""

from kvlab.server.core.app import FrontEnd
from kvlab.server.viz.routes import router

front_end = FrontEnd(router)

__all__ = ["front_end", "router"]
