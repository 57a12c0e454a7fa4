"""Ollama's API on the shared server (kvlab.server.core), so Ollama's clients (the `ollama`
package, apps that speak to localhost:11434) use kvlab unchanged.

    protocol   request bodies (strictly typed), options -> sampling, format -> structure,
               model names, the error shape
    replies    reply text -> thinking / content / tool calls; counts and durations
    calls      one /api/chat or /api/generate call: its engine request, NDJSON or one object
    models     /api/tags, /api/show and /api/ps from the engine's snapshot
    routes     the routes, and `front_end` that mounts them
"""
