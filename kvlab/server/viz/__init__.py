"""The live visualiser: a page at /viz and the JSON and streaming endpoints behind it.

    routes    the page, its static files, /viz/api/{run,pool,options,estimate}
    events    one run: N users through the AsyncEngine, each engine step an event
    predict   "this machine", the what-if presets, kvlab.estimate's figures for the page
    static/   viz.html, viz.css, viz.js (no build step)

`router` is mounted on the OpenAI server: `create_app(engine, routers=[router])`. It reads
the engine through `AsyncEngine.snapshot()` (what is served, the KV layout) and the
AsyncEngine's request API, never the engine's parts.
"""

from kvlab.server.viz.routes import router

__all__ = ["router"]
