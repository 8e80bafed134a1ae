"""The training objectives: one small class per task (see base.py)."""
