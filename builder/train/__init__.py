"""Training: one loop (loop.py) for the base (base.py), the MTP head (head.py) and the independent drafter
(drafter.py); the self-distillation data the head and the drafter share (distill.py)."""
