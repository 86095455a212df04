"""Batch extraction: run the target once over a dataset and fill the store (Ray or in-process)."""
