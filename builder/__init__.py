"""Frozen MTP in the browser: a frozen Llama-family base, an MTP head trained on it, their ONNX export and a
static site that decodes speculatively with onnxruntime-web.

The subpackages follow the architecture (README.md, "What each folder holds"), bottom to top; a module
imports only its own room or rooms below it (tests/test_rooms.py):

    contract.py the facts every room shares: modes, defaults, precisions, blocks, the manifest's reader
    models/     the one model definition (llama.py), the MTP head (head.py)
    data/       the tasks' one prompt format (tasks.py), the training text (corpus.py)
    decode/     the decode loop, written once (loop.py), over its backends: PyTorch, onnxruntime, drafter
    export/     ONNX graphs, their fusions, and the manifest: the one I/O contract with the page
    site/       build and serve the static site; headless Chromium
    train/      one training loop (loop.py) and what it trains: the base, the head, the drafter
    bench/      the benchmark and its report
    cli.py      the command line
"""
