"""Anthropic's Messages API on the shared server (kvlab.server.core).

    protocol   request bodies (strictly typed), their translation onto template messages,
               tools and sampling settings, and Anthropic's error body
    reply      a reply's text as content blocks: thinking, text, tool_use; whole or streamed
    messages   one /v1/messages call (build, submit, answer, close) and count_tokens
    routes     the routes, and `front_end` that mounts them
"""
