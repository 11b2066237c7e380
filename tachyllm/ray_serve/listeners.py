"""Where the Ray processes behind `tachy serve --replicas` listen.

Ray's internal services (GCS, raylet and object manager, the dashboard and runtime-env agents, the
metrics exporters, each worker's gRPC server) are unauthenticated: whoever reaches them can run code.
Ray binds them to loopback only when its node IP is a loopback address, and on Linux it never keeps one:
`ray.init(_node_ip_address="127.0.0.1")` is turned into the host's outward address unless
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is 0, Ray's switch for a single-host instance, which it reads when
it is imported. Ray Serve's replicas also open an inter-deployment gRPC server on all interfaces
whatever the node IP; `serve_grpc_on_node_ip` binds it to the node IP, where Serve connects to it.
"""

from __future__ import annotations

import ipaddress
import os
from typing import Any

# Ray reads it at import: off, a node's IP is the loopback address.
RAY_MULTI_HOST_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
WILDCARDS = ("", "0.0.0.0", "::")


def ip_of(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address `host` names literally (None for a host name)."""
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    ip = ip_of(host)
    return host == "localhost" or (ip is not None and ip.is_loopback)


def local_ray_options(host: str) -> dict[str, Any]:
    """The ray.init arguments that put a local Ray instance's node on `host` (the server's --host), and
    for a loopback host every Ray listener on loopback. Call it before Ray is imported. A wildcard or a
    host name leaves the node address to Ray."""
    ip = ip_of(host)
    if is_loopback(host):
        os.environ[RAY_MULTI_HOST_SWITCH] = "0"
        return {"_node_ip_address": host if ip is None else str(ip)}
    return {"_node_ip_address": str(ip)} if ip is not None and not ip.is_unspecified else {}


def check_node_ip(host: str) -> None:
    """After ray.init: refuses a loopback --host on a Ray node whose services other hosts can reach (Ray
    was imported, with its multi-host default, before local_ray_options could switch it off)."""
    import ray

    node_ip = ray.util.get_node_ip_address()
    if is_loopback(host) and not is_loopback(node_ip):
        raise RuntimeError(
            f"--host {host} asks for loopback only, but the local Ray node listens on {node_ip}: "
            f"set {RAY_MULTI_HOST_SWITCH}=0 before Ray is imported"
        )


def serve_grpc_on_node_ip() -> None:
    """In a Serve replica's process, before Serve starts the replica's inter-deployment gRPC server
    (a replica's constructor runs first): binds that server to the node IP instead of all interfaces.
    Serve reaches it at the node IP; Ray has no option for its address."""
    import ray
    from ray._common.network_utils import build_address, parse_address
    from ray.serve._private import replica

    add_port = replica.add_port_to_grpc_server
    if getattr(add_port, "binds_node_ip", False):
        return
    node_ip = ray.util.get_node_ip_address()

    def add_port_on_node_ip(server, address: str) -> int:
        host, port = parse_address(address)
        if host in WILDCARDS:
            address = build_address(node_ip, port)
        return add_port(server, address)

    add_port_on_node_ip.binds_node_ip = True  # type: ignore[attr-defined]  # the marker Ray reads off the function
    replica.add_port_to_grpc_server = add_port_on_node_ip
