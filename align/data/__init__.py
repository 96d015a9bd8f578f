"""Data cards and canonical data formats."""
