"""kvlab's HTTP front ends over the public engine API.

    core/       what every API shares: the asyncio engine, the app (CORS, key and size guard,
                errors in each API's shape, /health, /metrics), bodies, `Serving` (a
                conversation -> prompt ids), tool calls
    openai/     OpenAI's completions, chat completions and models; /tokenize, /detokenize
    viz/        the live visualiser (`kvlab viz`, and /viz under `kvlab serve`)
    replicas/   the same server over N engine replicas under Ray Serve (`--replicas`)
    apis        which front ends `kvlab serve` mounts

Each API is a translation layer onto the one engine request: it imports core, never another
API.
"""
