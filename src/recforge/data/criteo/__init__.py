"""Criteo click logs for DLRM: raw text to prepared parquet, and the data module that streams it."""
