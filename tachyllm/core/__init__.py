"""Scheduling state: sequences, the KV block manager, the scheduler and its step-cost model."""
