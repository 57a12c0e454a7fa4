"""The OpenAI API on the shared server (kvlab.server.core).

    protocol   request bodies (strictly typed) and their sampling settings
    formats    completions vs chat shapes: choices, deltas, logprobs, usage
    chat       one completions / chat call: its engine requests, its JSON or SSE answer
    tokenize   /tokenize and /detokenize in vLLM's and llama.cpp's shapes
    infill     llama.cpp's /infill and /v1/completions' suffix: code completion (FIM)
    responses          the Responses API: one /v1/responses call, body to Response object
    responses_input    its input items -> template messages; flat function tools
    responses_output   its output items and their stream events, built as text arrives
    responses_store    the stored responses behind previous_response_id, GET and DELETE
    routes     the routes, and `front_end` that mounts them
"""
