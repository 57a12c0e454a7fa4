"""The replicated server as a Ray Serve application: `serve run kvlab.deploy:app`.

`app` is a Serve application builder. Its arguments are `kvlab serve`'s own flags without
the dashes, as `serve run` passes them (`key=value`) or as a config file's `args:` holds
them; `KVLAB_SERVE_ARGS` (the flags as a command line) comes first, the arguments after:

    serve run kvlab.deploy:app replicas=2 threads=1 routing=prefix
    KVLAB_SERVE_ARGS="--replicas 2 --threads 1" serve run kvlab.deploy:app

    # serve deploy config.yaml
    applications:
      - name: kvlab
        route_prefix: /
        import_path: kvlab.deploy:app
        args: {model: /models/model.gguf, replicas: 2, threads: 1, max-num-seqs: 16}

A flag without a value (`no-prefix-caching`) takes `true`. HTTP host and port are Serve's
own settings here (a config file's `http_options: {host, port}`; `serve run` alone listens on
127.0.0.1:8000), not arguments.
"""

from __future__ import annotations

import argparse
import os
import shlex
from typing import Any

from ray.serve import Application

from kvlab.cli.serve import app_settings, register
from kvlab.server.replicas.application import build


def flags(args: dict[str, Any]) -> list[str]:
    """{"max_num_seqs": 8, "no-prefix-caching": True} -> ["--max-num-seqs", "8", ...]."""
    argv = shlex.split(os.environ.get("KVLAB_SERVE_ARGS", ""))
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True or str(value).lower() == "true":
            argv.append(flag)
        elif value is not False and str(value).lower() != "false":
            argv += [flag, str(value)]
    return argv


def parse(args: dict[str, Any]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvlab.deploy:app")
    register(parser.add_subparsers())
    ns = parser.parse_args(["serve", *flags(args)])
    if ns.replicas is None and ns.max_replicas is None:
        ns.replicas = 1
    return ns


def app(args: dict[str, Any]) -> Application:
    """Serve's application builder (see the module docstring for the arguments)."""
    return build(app_settings(parse(args)))
