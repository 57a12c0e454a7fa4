"""Engine replicas under Ray Serve: `kvlab serve --replicas N` and `serve run kvlab.deploy:app`.

    settings   what one application is: the engine, the server limits, replicas, routing
    replica    one engine replica (a Serve deployment) running the single-server app in process
    ingress    the HTTP front door: forwards each request to a replica, faults become 503
    router     prefix-cache-aware routing (Serve's request-router extension point)
    board      replicas report their /health and /metrics here; /health and /metrics read it
    merge      the replicas' metrics as one Prometheus text, each sample labelled by replica

The engine never learns it is replicated: a replica wraps `create_app(AsyncEngine(engine),
front_ends())`, the same app a single `kvlab serve` runs, and the ingress relays bytes.
Ray is imported only by these modules, and only when a replicated app is built.
"""
