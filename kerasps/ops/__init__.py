"""Layer 7, the top: operating a cluster, on the public API.

The `kerasps` command (`cli`), the launcher and its spec and console, the warm
standby interpreter, Kubernetes manifests and the demo. Layer 6, the public API, is
`kerasps/__init__.py` and `kerasps/strategy.py`.
"""
