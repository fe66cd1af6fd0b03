"""ONNX export: the graphs (graphs.py), their fusions (fuse.py) and the manifest that describes them (manifest.py)."""
