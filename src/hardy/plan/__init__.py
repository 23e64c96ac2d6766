"""The planner: memory, time, MFU, cost and failure-aware goodput for training and serving."""
