"""Discrete-event simulator of lowered schedules on a cluster (torch-free)."""
