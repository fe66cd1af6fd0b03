"""The data: the tasks' one prompt format (tasks.py) and the training text of Debian's documentation (corpus.py)."""
