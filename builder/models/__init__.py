"""The models: the one Llama-family definition (llama.py) and the MTP head that drafts for it (head.py)."""
