"""Scale-out on Ray Serve (issue #18): engine replicas behind one OpenAI-compatible ingress, routed by
which replica holds a request's prefix in its KV cache. So far: the routing index (prefix_index)."""
