"""`bench`: plain vs MTP vs drafter side by side in one run (run.py), and its report (report.py)."""
