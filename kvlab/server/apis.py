"""The front ends `kvlab serve` mounts on one port, in one list (the single server, its
replicas and their ingress all read it)."""

from __future__ import annotations

from kvlab.server import viz
from kvlab.server.anthropic import routes as anthropic
from kvlab.server.core.app import FrontEnd
from kvlab.server.ollama import routes as ollama
from kvlab.server.openai import routes as openai


def front_ends(with_viz: bool = True) -> list[FrontEnd]:
    apis = [openai.front_end, anthropic.front_end, ollama.front_end]
    return [*apis, viz.front_end] if with_viz else apis
