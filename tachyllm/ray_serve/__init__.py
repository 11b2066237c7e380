"""Scale-out on Ray Serve: engine replicas, multi-model routing, prefix-cache-aware routing (docs/scale_out.md).

`tachyllm.ray_serve:build_app` is the application builder for `serve run` / `serve deploy`. It is loaded
on first use, so that importing this package (for its config, say) does not import Ray.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from tachyllm.ray_serve.app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
